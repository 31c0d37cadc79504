"""The README's error tables (API at a glance, and Security's credentials table) name exactly the
(status code, reason) pairs the service can answer with, read from the code itself: every
domain error class (``ContextEngineError`` and its subclasses, each with the code
``api/status.py``'s table gives it), the answer to an unexpected failure
(``status.internal_status``), and the reasons the interceptors refuse calls with before the
servicer runs (``api/auth.py``'s ``Denied`` and ``api/limits.py``'s ``_reject`` and
``Violation``). A reason the code gains without a row, a row whose reason the code no longer
answers, or a status the code moves a reason to fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import context_engine.adapters.postgres.store
import context_engine.api.auth
import context_engine.api.limits
import context_engine.api.servicer
import context_engine.domain.provider_common
import context_engine.engine  # noqa: F401  (every module that defines an error class)
from context_engine.api import status
from context_engine.domain import errors as e
from google.rpc import error_details_pb2

from tests.conftest import REPO

API = REPO / "service" / "context_engine" / "api"
BACKTICKED = re.compile(r"`([A-Z][A-Z_]*)`")


def documented() -> set[tuple[str, str]]:
    """(code, reason) of every row of the README tables headed ``| code | reason | when |``
    and ``| failure | code | `ErrorInfo.reason` |``; a cell may list several reasons."""
    pairs: set[tuple[str, str]] = set()
    columns: tuple[int, int] | None = None
    for line in (REPO / "README.md").read_text().splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:3] == ["code", "reason", "when"]:
            columns = (0, 1)
        elif cells[:3] == ["failure", "code", "`ErrorInfo.reason`"]:
            columns = (1, 2)
        elif columns is not None and not set(cells[0]) <= {"-"}:
            (code,) = BACKTICKED.findall(cells[columns[0]])
            pairs |= {(code, reason) for reason in BACKTICKED.findall(cells[columns[1]])}
    return pairs


def _subclasses(cls: type[e.ContextEngineError]) -> list[type[e.ContextEngineError]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def domain_answers() -> set[tuple[str, str]]:
    """Each error class's reason with the code ``status.code_for`` answers it with (the first
    entry of ``status.CODES`` it is an instance of, else INTERNAL)."""
    pairs = set()
    for cls in _subclasses(e.ContextEngineError):  # the root itself is never raised
        code = next((c for parent, c in status.CODES if issubclass(cls, parent)), None)
        pairs.add(((code.name if code is not None else "INTERNAL"), cls.reason))
    return pairs


def internal_answer() -> tuple[str, str]:
    code, answer = status.internal_status()
    info = error_details_pb2.ErrorInfo()
    assert answer.details[0].Unpack(info)
    return code.name, info.reason


def _calls(path: Path, name: str) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))]


def _status_name(node: ast.expr) -> str:
    assert isinstance(node, ast.Attribute) and ast.unparse(node).startswith("grpc.StatusCode."), (
        ast.unparse(node))
    return node.attr


def _string(node: ast.expr) -> str:
    assert isinstance(node, ast.Constant) and isinstance(node.value, str), ast.unparse(node)
    return node.value


def interceptor_answers() -> set[tuple[str, str]]:
    """The reasons the credentials check and the limits refuse calls with, read from their
    source: ``Denied(code, reason, ...)``, and ``_reject(context, method, reason, ...,
    code=...)`` (its default code when none is given) and ``Violation(reason, ...)``, which
    ``_reject`` answers at that default."""
    pairs = {(_status_name(call.args[0]), _string(call.args[1]))
             for call in _calls(API / "auth.py", "Denied")}
    limits = API / "limits.py"
    (reject,) = [node for node in ast.walk(ast.parse(limits.read_text()))
                 if isinstance(node, ast.AsyncFunctionDef) and node.name == "_reject"]
    default = _status_name(reject.args.kw_defaults[reject.args.kwonlyargs.index(
        next(a for a in reject.args.kwonlyargs if a.arg == "code"))])
    for call in _calls(limits, "_reject"):
        reason = call.args[2]
        if isinstance(reason, ast.Constant):
            code = next((_status_name(k.value) for k in call.keywords if k.arg == "code"),
                        default)
            pairs.add((code, _string(reason)))
        else:  # found.reason: a Violation's
            assert ast.unparse(reason) == "found.reason", ast.unparse(reason)
    pairs |= {(default, _string(call.args[0])) for call in _calls(limits, "Violation")}
    return pairs


def answered() -> set[tuple[str, str]]:
    return domain_answers() | {internal_answer()} | interceptor_answers()


def test_the_code_is_read_whole():
    """The readers above find what is known to be there (so an empty set cannot pass)."""
    pairs = answered()
    assert {("FAILED_PRECONDITION", "BUILD_BASE_UNKNOWN"), ("UNAVAILABLE", "STORE_CONFLICT"),
            ("INVALID_ARGUMENT", "PROVIDER_FORMAT_UNRENDERABLE"), ("INTERNAL", "INTERNAL"),
            ("PERMISSION_DENIED", "TENANT_MISMATCH"), ("UNAVAILABLE", "SHUTTING_DOWN"),
            ("RESOURCE_EXHAUSTED", "ITEM_TOO_LARGE")} <= pairs
    assert len(documented()) >= 25


def test_readme_error_tables_name_every_answer_the_code_gives():
    missing = answered() - documented()
    assert not missing, f"answered but not in README's error tables: {sorted(missing)}"


def test_readme_error_tables_name_nothing_the_code_does_not_answer():
    stale = documented() - answered()
    assert not stale, f"in README's error tables but never answered so: {sorted(stale)}"


def test_every_reason_has_one_code():
    """A reason means one status: a client branching on it never meets it under another."""
    codes: dict[str, set[str]] = {}
    for code, reason in answered():
        codes.setdefault(reason, set()).add(code)
    assert {reason: c for reason, c in codes.items() if len(c) > 1} == {}
