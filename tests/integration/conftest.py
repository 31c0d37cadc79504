"""Fixtures shared by integration modules: a fake LLM summarizer endpoint on loopback and a
real server that summarizes with it (one of each per module)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.support.fake_llm import FakeProvider


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    p = FakeProvider()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def llm_server(database_url: str, provider: FakeProvider) -> Iterator[ServerThread]:
    config = base_config().replace(summarizer_url=provider.url, summarizer_model="fake-model",
                     summarizer_api_key="test-key", summarizer_timeout_seconds=0.5)
    srv = ServerThread(config, database_url)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm_stub(llm_server: ServerThread) -> Iterator[pb_grpc.ContextEngineStub]:
    ch = grpc.insecure_channel(llm_server.address)
    yield pb_grpc.ContextEngineStub(ch)
    ch.close()
