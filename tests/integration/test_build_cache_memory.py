"""The build cache's byte bound holds what the bases really hold: with each base the only
holder of its items and messages (one base per session, the render memo emptied), freeing the
cache frees no more than it counted (tracemalloc, an oracle of its own: the cache's count is
an estimate from serialized sizes and per-object overheads)."""

from __future__ import annotations

import gc
import tracemalloc

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, item, plan_request

pytestmark = pytest.mark.integration
TENANT = "t-cache-memory"


def items(n: int, text: str) -> list[pb.ConversationItem]:
    return [item(f"u{i}", i + 1, user=pb.UserMessage(text=text)) if i % 2 == 0
            else item(f"a{i}", i + 1, assistant=pb.AssistantMessage(text=text))
            for i in range(n)]


@pytest.mark.parametrize(("text", "n"), [("ok", 2_000), ("word " * 40, 800)])
def test_freeing_the_bases_frees_no_more_than_they_counted(database_url: str, text: str,
                                                           n: int) -> None:
    """Short items, where the objects outweigh the bytes, counted 2.9x too low before the
    per-object overheads; long ones 1.5x."""
    server = ServerThread(base_config().replace(build_cache_mb=64), database_url)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            engine = server.running.engine
            sessions = [f"memory-{k}" for k in range(3)]
            for session in sessions:
                stub.Plan(plan_request(TENANT, session), timeout=30)
            tracemalloc.start()
            try:
                for session in sessions:
                    req = build_request(TENANT, session, items(n, text))
                    req.keep_base = True
                    req.provider_format = pb.PROVIDER_FORMAT_NONE
                    assert stub.Build(req, timeout=60).build_id
                engine.render_memo.clear()
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
                counted = engine.builds.stats().bytes
                assert engine.builds.stats().entries == len(sessions)
                engine.builds.clear()
                gc.collect()
                freed = before - tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            assert freed > 0 and freed <= counted, (counted, freed)
            assert counted < 2 * freed, (counted, freed)  # an estimate, not a wild one
    finally:
        server.stop()
