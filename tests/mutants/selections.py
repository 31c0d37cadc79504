"""A pytest plugin that counts the tests each mutant's selection runs, for
``tests/unit/test_mutants_catalog.py``: a selection that runs no test (a ``-k`` naming a test
or a parameter id since renamed) kills nothing, and ``make mutants`` would report its mutant
only when it runs. With ``CE_MUTANT_SELECTIONS`` naming a JSON file of ``{name: [pytest
arguments]}``, it takes the suite as collected once, counts for each selection the items its
paths, ``-k`` and ``-m`` keep, writes ``{name: count}`` to ``CE_MUTANT_SELECTIONS_OUT`` and
deselects every item (nothing runs). ``-k`` and ``-m`` are evaluated by pytest's own matchers
(``_pytest.mark``, private, and the one place that defines what an expression selects).

    CE_MUTANT_SELECTIONS=in.json CE_MUTANT_SELECTIONS_OUT=out.json \\
        python -m pytest --collect-only -q -p tests.mutants.selections tests
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from _pytest.mark import KeywordMatcher, MarkMatcher
from _pytest.mark.expression import Expression

IN, OUT = "CE_MUTANT_SELECTIONS", "CE_MUTANT_SELECTIONS_OUT"


@dataclass(frozen=True)
class Collected:
    """The suite as collected, with what the selections match on made once per item."""
    files: dict[Path, list[tuple[KeywordMatcher, MarkMatcher]]]

    @classmethod
    def of(cls, items: list[pytest.Item]) -> Collected:
        files: dict[Path, list[tuple[KeywordMatcher, MarkMatcher]]] = {}
        for item in items:
            files.setdefault(Path(item.path).resolve(), []).append(
                (KeywordMatcher.from_item(item), MarkMatcher.from_markers(item.iter_markers())))
        return cls(files)

    def selected(self, args: list[str], root: Path) -> int:
        """How many items the pytest arguments ``args`` (paths, ``-k EXPR``, ``-m EXPR``)
        select; no path: every item (the suite's testpaths)."""
        paths: list[Path] = []
        keyword = mark = None
        it = iter(args)
        for arg in it:
            if arg == "-k":
                keyword = Expression.compile(next(it))
            elif arg == "-m":
                mark = Expression.compile(next(it))
            elif arg.startswith("-"):
                raise ValueError(f"a selection argument this count does not know: {arg}")
            else:
                paths.append((root / arg).resolve())
        count = 0
        for where, matchers in self.files.items():
            if paths and not any(where == p or p in where.parents for p in paths):
                continue
            for by_keyword, by_mark in matchers:
                if keyword is not None and not keyword.evaluate(by_keyword):
                    continue
                if mark is not None and not mark.evaluate(by_mark):
                    continue
                count += 1
        return count


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    source, target = os.environ.get(IN), os.environ.get(OUT)
    if not source or not target:
        return
    selections: dict[str, list[str]] = json.loads(Path(source).read_text(encoding="utf-8"))
    root = Path(config.rootpath)
    collected = Collected.of(items)
    counts = {name: collected.selected(args, root) for name, args in selections.items()}
    Path(target).write_text(json.dumps(counts), encoding="utf-8")
    config.hook.pytest_deselected(items=list(items))
    items[:] = []
