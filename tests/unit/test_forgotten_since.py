"""Engine.forgotten_since: whether a session was forgotten (erased) after a call's mark, so
that a Build that ran meanwhile forgets again what it kept of it, and only of it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from context_engine import engine as engine_module
from context_engine.engine import FORGOTTEN_KEPT, NAMED_KEPT, Engine

from tests import factories as f


def engine() -> Engine:
    return Engine(store=None, events=None, calibrations=None,  # type: ignore[arg-type]
                  catalog=f.CATALOG, tokenizers=f.REGISTRY, assets=f.ASSETS,
                  control_tools=f.CONTROL_TOOLS, metrics=None)  # type: ignore[arg-type]


def test_only_the_session_forgotten_after_the_mark_is() -> None:
    e = engine()
    e.forget_session("t", "before")
    mark = e.forgets
    assert not e.forgotten_since("t", "a", mark)  # nothing forgotten since
    e.forget_session("t", "a")
    assert e.forgotten_since("t", "a", mark)
    assert not e.forgotten_since("t", "b", mark)  # another session's erasure
    assert not e.forgotten_since("t", "before", mark)  # forgotten before the call began
    assert not e.forgotten_since("u", "a", mark)  # another tenant's session of that name
    later = e.forgets
    e.forget_session("t", "b")
    assert not e.forgotten_since("t", "a", later) and e.forgotten_since("t", "b", later)


def test_past_what_is_remembered_every_session_counts_as_forgotten() -> None:
    e = engine()
    mark = e.forgets
    for k in range(FORGOTTEN_KEPT + 1):
        e.forget_session("t", f"s{k}")
    assert e.forgotten_since("t", "never", mark)  # not known either way: forget (harmless)
    assert not e.forgotten_since("t", "never", e.forgets - 1)


def test_a_build_dropping_what_it_kept_is_no_erasure_of_its_own() -> None:
    """A Build that ran across an erasure drops what it kept without counting as one: the
    session's other Builds, begun after the erasure, keep what they keep (no cascade)."""
    e = engine()
    e.forget_session("t", "a")
    after = e.forgets
    e.forget_session("t", "a", counted=False)
    assert e.forgets == after and not e.forgotten_since("t", "a", after)


def test_a_forget_that_found_the_session_planned_again_spares_calls_on_the_new_incarnation(
        ) -> None:
    """A session found planned again as incarnation 3: a call that ran on 3 (or later) keeps
    what it made; one that ran on an older incarnation, or whose incarnation is not known,
    forgets it. An erasure (no incarnation found) reaches every call."""
    e = engine()
    mark = e.forgets
    e._forget_erased("t", "a", 3)
    assert not e.forgotten_since("t", "a", mark, 3)
    assert not e.forgotten_since("t", "a", mark, 4)
    assert e.forgotten_since("t", "a", mark, 2)
    assert e.forgotten_since("t", "a", mark)
    e._forget_erased("t", "a", None)
    assert e.forgotten_since("t", "a", mark, 3)


def test_an_erasure_is_not_hidden_by_a_later_forget_that_found_the_session_planned_again(
        ) -> None:
    """A session erased here after a call began, then found planned again as incarnation 2 by
    a read begun before the erasure (it ends after): a call that ran on 2 ran on what was
    erased and forgets what it kept. So does one that ran on 1 once any forget found 2,
    whatever a later forget found."""
    e = engine()
    mark = e.forgets
    e.forget_session("t", "a")  # erased here
    e._forget_erased("t", "a", 2)  # a read named 2, late
    assert e.forgotten_since("t", "a", mark, 2)
    later = e.forgets
    e._forget_erased("t", "a", 3)
    e._forget_erased("t", "a", 2)  # a stale read naming 2 after one named 3
    assert e.forgotten_since("t", "a", later, 2)  # 3 was found since: 2 is erased
    assert not e.forgotten_since("t", "a", later, 3)  # no erasure since the mark


def test_a_call_on_an_incarnation_older_than_one_read_since_ran_on_an_erased_session() -> None:
    """A read here named incarnation 2 (the session erased and planned again through another
    replica, nothing of 1 held here to forget, so no forget counted): a call that ran on 1
    forgets what it kept; one on 2 keeps it. A session no longer among those whose latest
    incarnation is remembered counts as read again (forgetting is harmless)."""
    e = engine()
    e._named("t", "a", 1)
    mark = e.forgets
    assert not e.forgotten_since("t", "a", mark, 1)
    e._named("t", "a", 2)
    assert e.forgets == mark  # nothing held of 1: no forget counted
    assert e.forgotten_since("t", "a", mark, 1)
    assert not e.forgotten_since("t", "a", mark, 2)
    e._named("t", "a", 1)  # a late read of the older one does not lower it
    assert e.forgotten_since("t", "a", mark, 1)
    e._forget_erased("t", "b", 5)  # a forget that found the session planned again as 5
    assert e.forgotten_since("t", "b", e.forgets, 4)
    assert not e.forgotten_since("t", "b", e.forgets, 5)
    for k in range(NAMED_KEPT):
        e._named("t", f"s{k}", 1)
    assert e.forgotten_since("t", "a", mark, 2)
    assert not e.forgotten_since("t", f"s{NAMED_KEPT - 1}", mark, 1)


class Walked(OrderedDict[Any, None]):
    """The runs remembered, counting the walks over them."""

    walks = 0

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()


def test_the_runs_bound_to_a_snapshot_go_with_their_incarnation_and_are_counted(
        monkeypatch: Any) -> None:
    """A forget drops the session's remembered runs of the incarnations it names, and only
    those; a session with none (one never planned here, a read finding it gone) walks none
    of the remembered runs; the counts per session follow additions, forgets and the bound."""
    e = engine()
    e._snapshot_runs = Walked()
    for key in [("t", "a", 1, 1, "r1"), ("t", "a", 2, 1, "r1"), ("t", "b", 1, 1, "r1")]:
        e._remember_run(key)
    e._forget_erased("t", "never", None)
    assert e._snapshot_runs.walks == 0
    e._forget_erased("t", "a", 2)  # found planned again as 2: 1's runs go, 2's stay
    assert list(e._snapshot_runs) == [("t", "a", 2, 1, "r1"), ("t", "b", 1, 1, "r1")]
    assert e._run_counts == {("t", "a"): 1, ("t", "b"): 1}
    e.forget_session("t", "a", counted=False, incarnation=1)  # a Build on 1 ended: 2 stays
    assert e._run_counts == {("t", "a"): 1, ("t", "b"): 1}
    e.forget_session("t", "a")  # erased here: all of them
    assert list(e._snapshot_runs) == [("t", "b", 1, 1, "r1")] and e._run_counts == {
        ("t", "b"): 1}
    monkeypatch.setattr(engine_module, "RUNS_KEPT", 2)
    e._remember_run(("t", "c", 1, 1, "r1"))
    e._remember_run(("t", "c", 1, 1, "r2"))  # over the bound: b's goes
    assert e._run_counts == {("t", "c"): 2}


def test_the_factors_read_are_remembered_up_to_a_bound(monkeypatch) -> None:
    """Each (tenant, model id) whose correction factor a Build read stayed in memory for the
    life of the process, and a model id is the caller's: 400 sessions of distinct ids held
    400 entries after every one of them was erased. The most recent FACTORS_KEPT are kept."""
    import asyncio
    from dataclasses import replace

    monkeypatch.setattr(engine_module, "FACTORS_KEPT", 3)

    class NoCalibrations:
        def __init__(self) -> None:
            self.read: list[str] = []

        async def calibration(self, tenant_id: str, model_id: str) -> None:
            self.read.append(model_id)

    e = engine()
    calibrations = NoCalibrations()
    e._calibrations = calibrations  # type: ignore[assignment]
    spec = f.loaded().plan.spec

    def of(model_id: str) -> Any:
        return replace(spec, model=replace(spec.model, model_id=model_id))

    async def scenario() -> None:
        for k in range(5):
            assert await e._reconciled_factor("t", of(f"m{k}")) == 1.0
        assert list(e._factors) == [("t", "m2"), ("t", "m3"), ("t", "m4")]
        await e._reconciled_factor("t", of("m2"))  # cached: read most recently now
        await e._reconciled_factor("t", of("m5"))
        assert list(e._factors) == [("t", "m4"), ("t", "m2"), ("t", "m5")]

    asyncio.run(scenario())
    assert calibrations.read == ["m0", "m1", "m2", "m3", "m4", "m5"]
