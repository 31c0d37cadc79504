"""The suite's own set-up: each test module's asserts rewritten once, in xdist's controller,
where every worker's import of it finds them (``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _pytest.assertion import rewrite

from tests import conftest


def _names(code: object) -> set[str]:
    names: set[str] = set(getattr(code, "co_names", ()))
    for const in getattr(code, "co_consts", ()):
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def test_a_module_is_rewritten_where_its_import_reads_it(tmp_path: Path,
                                                          pytestconfig: pytest.Config) -> None:
    module = tmp_path / "test_sample.py"
    module.write_text("def test_one():\n    value = [1, 2]\n    assert value == [1, 2]\n")
    pyc = rewrite.get_cache_dir(module) / f"test_sample{rewrite.PYC_TAIL}"
    conftest._REWRITING[:] = [pytestconfig]
    try:
        conftest._rewritten(str(module))
        code = rewrite._read_pyc(module, pyc)
        assert code is not None, "no bytecode the import would read"
        assert "@pytest_ar" in _names(code), "the asserts were not rewritten"
        # an edit: the stale bytecode is made again, as the import itself would
        module.write_text("def test_one():\n    assert 1 + 1 == 2\n")
        assert rewrite._read_pyc(module, pyc) is None
        conftest._rewritten(str(module))
        assert rewrite._read_pyc(module, pyc) is not None
    finally:
        conftest._REWRITING.clear()
