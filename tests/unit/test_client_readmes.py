"""The clients' READMEs document the API the clients have: the Python client's construction
table (each argument, keyword-only, with its default) against ``Client`` and ``AsyncClient``'s
signatures, its method list against their methods; the TypeScript client's options table
against ``ClientOptions`` and the defaults ``client.ts``, ``channel.ts`` and ``incremental.ts``
declare, its method list against ``ContextEngineClient``'s methods, and its error table against
``ContextEngineError``'s fields."""

from __future__ import annotations

import ast
import inspect
import math
import re
from typing import Any

import pytest
from context_engine_client import AsyncClient, Client

from tests.conftest import REPO

PYTHON_README = REPO / "clients" / "python" / "README.md"
TS = REPO / "clients" / "typescript"
TS_README = TS / "README.md"
BACKTICKED = re.compile(r"`([^`]+)`")
MIB = 1024 * 1024


def table(text: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header row starts ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _number(text: str) -> float:
    """``10`` or ``1,024`` or ``64 MiB`` or ``10 s`` / ``60 s`` (as milliseconds: ``ms``)."""
    value, unit = re.fullmatch(r"([\d,.]+)\s*(MiB|s|)", text.strip()).groups()  # type: ignore[union-attr]
    number = float(value.replace(",", ""))
    return number * {"MiB": MIB, "s": 1000, "": 1}[unit]


# ---------------------------------------------------------------------------- Python


def python_construction() -> dict[str, str]:
    """``{argument: default as written}`` of the Construction table."""
    documented = {}
    for cells in table(PYTHON_README.read_text(), "| argument | default |"):
        for name in BACKTICKED.findall(cells[0]):
            documented[name] = cells[1]
    return documented


def _python_default(written: str) -> Any:
    if written == "required":
        return inspect.Parameter.empty
    if written in ("none", "unset", "packaged"):  # packaged: service_config None
        return None
    shown = re.fullmatch(r"`([^`]+)`", written)
    if shown:
        return ast.literal_eval(shown.group(1))
    return _number(written)


@pytest.mark.parametrize("client", [Client, AsyncClient])
def test_python_construction_table_is_the_signature(client):
    documented = python_construction()
    parameters = {name: p for name, p in inspect.signature(client.__init__).parameters.items()
                  if name != "self"}
    assert set(parameters) == set(documented), set(parameters) ^ set(documented)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    for name, written in documented.items():
        assert parameters[name].default == _python_default(written), (
            f"{client.__name__}({name}=...): README says {written!r}, the code "
            f"{parameters[name].default!r}")


def python_methods() -> list[str]:
    text = PYTHON_README.read_text()
    listed = re.search(r"^Methods: (.*?), each `\(\*, request, timeout=None,\s+metadata=None\)`",
                       text, re.S | re.M)
    assert listed, "README: no 'Methods: ..., each `(*, request, timeout=None, metadata=None)`'"
    return BACKTICKED.findall(listed.group(1))


@pytest.mark.parametrize("client", [Client, AsyncClient])
def test_python_methods_are_the_documented_ones(client):
    methods = python_methods()
    assert len(methods) == 9
    public = {name for name, member in vars(client).items()
              if callable(member) and not name.startswith("_")}
    assert public - set(methods) == {"forget_session", "close"}, public
    for name in methods:
        signature = inspect.signature(getattr(client, name))
        parameters = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
        assert parameters == [
            ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
            ("request", inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty),
            ("timeout", inspect.Parameter.KEYWORD_ONLY, None),
            ("metadata", inspect.Parameter.KEYWORD_ONLY, None)], f"{name}: {signature}"


# ---------------------------------------------------------------------------- TypeScript


def _ts(name: str) -> str:
    return (TS / "src" / name).read_text()


def _interface_fields(source: str, interface: str) -> list[str]:
    body = re.search(rf"^export interface {interface} \{{\n(.*?)^\}}", source, re.S | re.M)
    assert body, f"no interface {interface}"
    return re.findall(r"^  (\w+)\??:", body.group(1), re.M)


def _ts_constant(source: str, name: str) -> float:
    found = re.search(rf"\bconst {name}\b[^=]*= ([\d_* ]+);", source)
    assert found, f"no constant {name}"
    return float(math.prod(int(factor) for factor in found.group(1).split("*")))


def ts_options() -> dict[str, str]:
    return {BACKTICKED.findall(cells[0])[0]: cells[1]
            for cells in table(TS_README.read_text(), "| option | meaning |")}


def test_typescript_options_table_is_client_options():
    documented = ts_options()
    assert list(documented) == _interface_fields(_ts("client.ts"), "ClientOptions")


def test_typescript_options_table_states_the_defaults():
    documented = ts_options()
    client, channel, incremental = _ts("client.ts"), _ts("channel.ts"), _ts("incremental.ts")
    declared = {
        "deadlineMs": _ts_constant(client, "DEFAULT_DEADLINE_MS"),
        "compactDeadlineMs": _ts_constant(client, "DEFAULT_COMPACT_DEADLINE_MS"),
        "maxMessageBytes": _ts_constant(channel, "DEFAULT_MAX_MESSAGE_BYTES"),
    }
    for option, value in declared.items():
        said = re.search(r"\((\d[\d,]* (?:s|MiB))", documented[option])
        assert said, f"{option}: no default in {documented[option]!r}"
        assert _number(said.group(1)) == value, f"{option}: README {said.group(1)}, code {value}"
    sessions = re.search(r"([\d,]+) by default", documented["incremental"])
    assert sessions and _number(sessions.group(1)) == _ts_constant(
        incremental, "DEFAULT_MAX_SESSIONS"), documented["incremental"]


def test_typescript_methods_are_the_documented_ones():
    text = TS_README.read_text()
    listed = re.search(r"^Every method \((.*?)\) takes the request and `\{ deadlineMs, metadata,"
                       r"\s+signal \}`", text, re.S | re.M)
    assert listed, "README: no 'Every method (...) takes the request and { deadlineMs, ... }'"
    methods = BACKTICKED.findall(listed.group(1))
    assert len(methods) == 9
    source = _ts("client.ts")
    taking = set(re.findall(r"^  (?:async )?(\w+)\(request: Input<\w+>,\s*options\?: CallOptions\)",
                            source, re.M))
    assert taking == set(methods), taking ^ set(methods)
    assert _interface_fields(source, "CallOptions") == ["deadlineMs", "metadata", "signal"]


def test_typescript_error_table_is_the_errors_fields():
    documented = {name for cells in table(TS_README.read_text(), "| field | what |")
                  for name in BACKTICKED.findall(cells[0])}
    body = re.search(r"^export class ContextEngineError extends Error \{\n(.*?)^  constructor",
                     _ts("errors.ts"), re.S | re.M)
    assert body
    fields = set(re.findall(r"^  readonly (\w+)", body.group(1), re.M))
    assert documented == fields, documented ^ fields


# ---------------------------------------------------------------------------- provider bodies


def _helper_rows(readme: str) -> dict[str, list[str]]:
    """``{body type: [top-level keys the README lists]}`` of the "| helper | returns |" table:
    the backticked names after the type, up to the parenthesis or colon that ends them."""
    rows = {}
    for cells in table(readme, "| helper | returns |"):
        typed = re.match(r"`(\w+Body)`: (.*)", cells[1])
        if typed:
            keys = re.split(r" \(|: ", typed.group(2), maxsplit=1)[0]
            rows[typed.group(1)] = BACKTICKED.findall(keys)
    return rows


def test_python_body_helpers_list_their_typed_dicts_keys():
    """Each listed key is one the TypedDict has, and every key each body has (a required one)
    is listed. The Python README's helper table left `max_output_tokens` out of
    `OpenAIResponsesBody`, which every Responses body the service renders holds (and the
    TypeScript README lists); an optional key may go unlisted (Gemini's `cachedContent` is the
    cached body's, `toolConfig` one the service never sets)."""
    from typing import NotRequired, get_origin, get_type_hints

    from context_engine_client import formats

    documented = _helper_rows(PYTHON_README.read_text())
    assert len(documented) == 5, documented
    for name, keys in documented.items():
        hints = get_type_hints(getattr(formats, name), include_extras=True)
        required = {key for key, hint in hints.items() if get_origin(hint) is not NotRequired}
        assert set(keys) <= set(hints), name
        assert required <= set(keys), (name, required - set(keys))


def test_typescript_body_helpers_list_their_interfaces_fields():
    source = _ts("formats.ts")
    documented = _helper_rows(TS_README.read_text())
    assert len(documented) == 5, documented
    for name, keys in documented.items():
        body = re.search(rf"^export interface {name} \{{\n(.*?)^\}}", source, re.S | re.M)
        assert body, name
        required = set(re.findall(r"^  (\w+):", body.group(1), re.M))
        assert set(keys) <= set(_interface_fields(source, name)), name
        assert required <= set(keys), (name, required - set(keys))
