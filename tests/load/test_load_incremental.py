"""The load generator's incremental Builds (``tests.load.runtime`` through the Python client's
incremental core) and what ``make load`` reports of them, against real servers sharing the
suite's database: fewer bytes than whole Builds, every delta read back, a base unknown to the
replica a runtime moves to counted as a fallback (sent again whole) and not as an error, and
both modes side by side with the server's CPU per Build."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.load import run as load
from tests.load.run import CHANNEL_OPTIONS, Report
from tests.load.runtime import Outcome, Runtime, run_runtimes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def replicas(database_url: str) -> Iterator[tuple[ServerThread, ServerThread]]:
    """Two replicas of the service on one database: bases are each one's own."""
    first = ServerThread(base_config(), database_url)
    second = ServerThread(base_config(), database_url)
    yield first, second
    first.stop()
    second.stop()


def tenant() -> str:
    return f"load-{uuid.uuid4().hex[:8]}"


def load_of(address: str, *, runtimes: int, turns: int, incremental: bool) -> Outcome:
    outcome = Outcome()
    asyncio.run(run_runtimes(address, CHANNEL_OPTIONS, tenant=tenant(), runtimes=runtimes,
                             turns=turns, outcome=outcome, stop=asyncio.Event(),
                             incremental=incremental))
    return outcome


def test_incremental_runtimes_send_less_and_read_every_delta_back(
        replicas: tuple[ServerThread, ServerThread]) -> None:
    address = replicas[0].address
    inc = load_of(address, runtimes=3, turns=4, incremental=True)
    full = load_of(address, runtimes=3, turns=4, incremental=False)
    for outcome in (inc, full):
        assert outcome.turns == 12 and outcome.builds == 24
        assert all(c.code == "OK" for c in outcome.calls)
    # each runtime's first Build goes whole; every later one names the previous Build, and its
    # delta read back (the client core checks every size: a mismatch would be counted)
    assert (inc.incremental_builds, inc.fallbacks, inc.mismatches) == (24 - 3, 0, 0)
    assert (full.incremental_builds, full.fallbacks) == (0, 0)
    # the same conversations, a fraction of the bytes both ways
    assert inc.build_request_bytes < full.build_request_bytes / 2
    assert inc.build_response_bytes < full.build_response_bytes / 2


class Replicas:
    """A runtime's stub that calls the first replica until ``after`` Builds were sent, and the
    second one from then on (its connection moved: the base it names is not held there)."""

    def __init__(self, first: Any, second: Any, after: int) -> None:
        self.stubs = (first, second)
        self.after = after
        self.builds = 0

    def __getattr__(self, method: str) -> Any:
        async def call(request: Any, **kwargs: Any) -> Any:
            stub = self.stubs[self.builds >= self.after]
            if method == "Build":
                self.builds += 1
            return await getattr(stub, method)(request, **kwargs)
        return call


def test_a_base_unknown_to_the_next_replica_is_a_fallback_not_an_error(
        replicas: tuple[ServerThread, ServerThread]) -> None:
    async def drive() -> tuple[Outcome, int]:
        outcome = Outcome()
        async with grpc.aio.insecure_channel(replicas[0].address) as a, \
                grpc.aio.insecure_channel(replicas[1].address) as b:
            stub = Replicas(pb_grpc.ContextEngineStub(a), pb_grpc.ContextEngineStub(b),
                            after=3)
            await Runtime(stub, tenant(), 0, 3, outcome, asyncio.Event(),  # type: ignore[arg-type]
                          incremental=True).run()
            return outcome, stub.builds

    outcome, sent = asyncio.run(drive())
    # Builds 1-3 on the first replica; the 4th names the 3rd's base on the second: refused
    # BUILD_BASE_UNKNOWN, sent again whole (kept there), then incremental again
    assert outcome.turns == 3 and outcome.builds == 6 and sent == 7
    assert outcome.fallbacks == 1 and outcome.mismatches == 0
    assert outcome.incremental_builds == 6 - 2  # the first Build and the resend went whole
    refused = [c for c in outcome.calls if c.code != "OK"]
    assert [(c.method, c.code, c.fallback) for c in refused] == [
        ("Build", "FAILED_PRECONDITION", True)]
    report = Report(runtimes=1, turns=3, workers=1, wall_seconds=1.0, calls=outcome.calls,
                    turns_done=outcome.turns)
    assert report.errors() == 0  # a fallback is not an error
    assert [line.split()[:3] for line in report.table().splitlines()
            if line.startswith("Build")] == [["Build", "7", "0"]]


def test_make_load_runs_both_modes_side_by_side(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The smallest ``make load``: each mode against a server process of its own, bytes and the
    server's CPU per Build reported beside each other."""
    path = tmp_path / "summary.json"
    code = load.main(["--runtimes", "2", "--turns", "2", "--workers", "1", "--build-mode",
                      "both", "--time-limit", "240", "--json", str(path)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    summary = json.loads(path.read_text())
    inc, full = summary["incremental"], summary["full"]
    assert inc["builds"] == full["builds"] == 8 and inc["errors"] == full["errors"] == 0
    assert inc["incremental_builds"] == 8 - 2 and full["incremental_builds"] == 0
    assert inc["build_base_unknown_fallbacks"] == 0 and inc["delta_mismatches"] == 0
    assert inc["bytes_per_build"] < full["bytes_per_build"]
    assert inc["bytes_per_build"] == pytest.approx(
        (inc["build_request_bytes"] + inc["build_response_bytes"]) / 8, abs=0.1)
    for mode in (inc, full):
        assert mode["server_cpu_seconds"] > 0
        assert mode["server_cpu_ms_per_build"] == pytest.approx(
            mode["server_cpu_seconds"] * 1000 / 8, rel=1e-2)
    lines = out.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("Build mode"))
    assert [line.split()[0] for line in lines[header + 1:header + 3]] == ["incremental", "full"]
    assert lines[header + 3].startswith("incremental / full: bytes per Build ")
    assert "server CPU per Build" in lines[header + 3]
