"""The standard gRPC server metrics and ``context_engine_build_info``, scraped over HTTP from real
servers: every method of every served service at zero before its first call (for every status
code), calls counted by method and code (refusals of the credentials check and of the limits
included, which the interceptor sees because it is the outermost), started equal to handled once
calls are over, message counts per stream, and build_info's labels equal to what
``context-engine --version`` prints, at 1 also when several worker processes merge their
metrics (a gauge summed across workers would read 2)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from context_engine.api.auth import token_sha256
from context_engine.api.rpc_metrics import GRPC_CODES, served_methods
from context_engine.telemetry.logs import LOGGER
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.processes import ServerProcess
from tests.integration.requests import build_request, failure, item, plan_request
from tests.support.fake_llm import FakeProvider

pytestmark = pytest.mark.integration

CLI = Path(sys.executable).parent / "context-engine"
SERVICE = "context_engine.v1.ContextEngine"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
MAX_ITEMS = 5
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def series(samples: Samples, name: str) -> dict[tuple[str, ...], float]:
    """``name``'s samples keyed by their label values (grpc_type, grpc_service, grpc_method
    [, grpc_code]), ``le`` excluded."""
    order = ("grpc_type", "grpc_service", "grpc_method", "grpc_code")
    out: dict[tuple[str, ...], float] = {}
    for (sample, labels), v in samples.items():
        if sample == name:
            found = dict(labels)
            out[tuple(found[k] for k in order if k in found)] = v
    return out


def version_output() -> dict[str, str]:
    out = subprocess.run([str(CLI), "--version"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return dict(line.split(None, 1) for line in out.splitlines())


def expected_build_info() -> dict[str, str]:
    """build_info's labels from ``context-engine --version``: the contract's hash cut to its
    first 12 hex digits."""
    printed = version_output()
    package, _, digest = printed["contract"].partition(" sha256:")
    assert len(digest) == 64
    return {"version": printed["context-engine"], "contract": f"{package} sha256:{digest[:12]}",
            "policy": printed["policy"], "builder": printed["builder"]}


def build_info(samples: Samples) -> list[tuple[dict[str, str], float]]:
    return [(dict(labels), v) for (name, labels), v in samples.items()
            if name == "context_engine_build_info"]


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def secured(database_url: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ServerThread, str, str]]:
    """A server of this module's own (its registry sees only these calls) that requires
    credentials and refuses requests of more than MAX_ITEMS items: (server, tenant, token)."""
    tenant, token = f"tenant-{uuid.uuid4().hex[:10]}", f"token-{uuid.uuid4().hex}"
    path = tmp_path_factory.mktemp("tokens") / "tokens.json"
    path.write_text(json.dumps([{"sha256": token_sha256(token), "tenant_id": tenant,
                                 "rpcs": ["*"]}]))
    server = ServerThread(base_config().replace(dev_mode=False, auth_tokens_file=path,
                                                max_items_per_request=MAX_ITEMS),
                          database_url)
    yield server, tenant, token
    server.stop()


def metrics_address(server: ServerThread) -> str:
    return f"127.0.0.1:{server.running.metrics_port}"


def test_a_fresh_server_has_every_method_at_zero_and_its_build_info(secured):
    server, _, _ = secured
    samples = scrape(metrics_address(server))
    methods = {tuple(m) for m in served_methods()}
    # the contract's methods (DeleteSession too), health's and reflection's, with their types
    assert {(SERVICE, m.name) for m in pb.DESCRIPTOR.services_by_name["ContextEngine"].methods} \
        <= {(s, m) for _, s, m in methods}
    assert {("unary", SERVICE, "DeleteSession"), ("unary", HEALTH, "Check"),
            ("server_stream", HEALTH, "Watch"),
            ("bidi_stream", REFLECTION, "ServerReflectionInfo")} <= methods
    for name in ("grpc_server_started_total", "grpc_server_msg_received_total",
                 "grpc_server_msg_sent_total", "grpc_server_handling_seconds_count"):
        assert series(samples, name) == dict.fromkeys(methods, 0.0), name
    assert series(samples, "grpc_server_handled_total") == {
        (*m, code): 0.0 for m in methods for code in GRPC_CODES}
    assert len(GRPC_CODES) == 17 and "OK" in GRPC_CODES and "UNAUTHENTICATED" in GRPC_CODES
    assert build_info(samples) == [(expected_build_info(), 1.0)]


def test_calls_are_counted_by_method_and_code_refusals_included(secured, db):
    server, tenant, token = secured
    before = scrape(metrics_address(server))
    expected: Counter[tuple[str, str, str, str]] = Counter()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ContextEngineStub(channel)
        session = f"session-{uuid.uuid4().hex[:8]}"
        stub.Plan(plan_request(tenant, session), metadata=bearer(token), timeout=30)
        stub.Build(build_request(tenant, session), metadata=bearer(token), timeout=30)
        expected.update({("unary", SERVICE, "Plan", "OK"): 1,
                         ("unary", SERVICE, "Build", "OK"): 1})
        refusals = (
            # the credentials check: no token, then another tenant's request
            (lambda: stub.Plan(plan_request(tenant, "s"), timeout=30), "Plan",
             "UNAUTHENTICATED"),
            (lambda: stub.GetPlan(pb.GetPlanRequest(tenant_id="someone-else", session_id="s"),
                                  metadata=bearer(token), timeout=30), "GetPlan",
             "PERMISSION_DENIED"),
            # the limits: more items than the process accepts
            (lambda: stub.Build(build_request(tenant, session, items=[
                item(f"u{i}", i, user=pb.UserMessage(text="hi")) for i in range(1, 8)]),
                metadata=bearer(token), timeout=30), "Build", "RESOURCE_EXHAUSTED"),
            # the servicer: a session that does not exist
            (lambda: stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id="nope"),
                                  metadata=bearer(token), timeout=30), "GetPlan", "NOT_FOUND"),
        )
        for call, method, code in refusals:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code().name == code, (method, failure(err.value))
            expected[("unary", SERVICE, method, code)] += 1

        health = health_pb2_grpc.HealthStub(channel)
        health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        with pytest.raises(grpc.RpcError):
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        expected.update({("unary", HEALTH, "Check", "OK"): 1,
                         ("unary", HEALTH, "Check", "NOT_FOUND"): 1})
        # a server stream written through context.write(): one message, then the caller goes
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        expected[("server_stream", HEALTH, "Watch", "CANCELLED")] += 1
        # a bidi stream of an async generator: two requests, two answers
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(reflection.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]),
            timeout=30))
        assert len(answers) == 2
        expected[("bidi_stream", REFLECTION, "ServerReflectionInfo", "OK")] += 1

    def delta(samples: Samples, name: str) -> Counter[tuple[str, ...]]:
        was = series(before, name)
        return Counter({k: v - was.get(k, 0.0) for k, v in series(samples, name).items()
                        if v - was.get(k, 0.0)})

    # the cancelled stream finishes on the server after the client has gone
    deadline = time.monotonic() + 10
    while True:
        after = scrape(metrics_address(server))
        handled = delta(after, "grpc_server_handled_total")
        if handled == expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert handled == expected

    started = delta(after, "grpc_server_started_total")
    per_method: Counter[tuple[str, ...]] = Counter()
    for key, n in handled.items():
        per_method[key[:3]] += n
    assert started == per_method  # every call that started has ended with a code
    assert delta(after, "grpc_server_handling_seconds_count") == per_method
    received = delta(after, "grpc_server_msg_received_total")
    sent = delta(after, "grpc_server_msg_sent_total")
    for key, n in per_method.items():
        if key[0] == "unary":
            assert received[key] == n, key  # one request each
            ok = handled[(*key, "OK")]
            assert sent[key] == ok, key  # one response each, only when it ended OK
    watch_key = ("server_stream", HEALTH, "Watch")
    assert (received[watch_key], sent[watch_key]) == (1, 1)
    bidi = ("bidi_stream", REFLECTION, "ServerReflectionInfo")
    assert (received[bidi], sent[bidi]) == (2, 2)

    # The service's own latency histogram saw the same calls with the same codes.
    rpc = {(m, c): v for (name, labels), v in after.items()
           if name == "context_engine_rpc_seconds_count"
           for m, c in [(dict(labels)["method"], dict(labels)["code"])]}
    was = {(m, c): v for (name, labels), v in before.items()
           if name == "context_engine_rpc_seconds_count"
           for m, c in [(dict(labels)["method"], dict(labels)["code"])]}
    assert Counter({k: v - was[k] for k, v in rpc.items() if v - was[k]}) == Counter(
        {(m, c): n for (_, s, m, c), n in expected.items() if s == SERVICE})


def test_build_info_is_one_across_worker_processes(database_url):
    """``serve --workers 2`` merges its workers' metrics: build_info stays one series at 1, and
    the workers' counters add up."""
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2"})
    try:
        assert server.log[-1]["workers"] == 2
        tenant = f"tenant-{uuid.uuid4().hex[:8]}"
        before = series(scrape(server.metrics), "grpc_server_handled_total")
        for i in range(8):  # a connection each, spread over both workers by the kernel
            with grpc.insecure_channel(
                    server.address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                pb_grpc.ContextEngineStub(ch).Plan(plan_request(tenant, f"s-{i}"), timeout=30)
        samples = scrape(server.metrics)
        assert build_info(samples) == [(expected_build_info(), 1.0)]
        key = ("unary", SERVICE, "Plan", "OK")
        assert series(samples, "grpc_server_handled_total")[key] - before[key] == 8
    finally:
        assert server.terminate() == 0


@pytest.fixture(scope="module")
def slow_summarizer(database_url: str) -> Iterator[tuple[ServerThread, FakeProvider]]:
    """A server whose summarizer takes 3 s to answer (within its own 10 s timeout)."""
    provider = FakeProvider(delay=3.0)
    server = ServerThread(base_config().replace(summarizer_url=provider.url,
                                                summarizer_model="fake",
                                                summarizer_timeout_seconds=10.0),
                          database_url)
    yield server, provider
    server.stop()
    provider.stop()


def _deadline_then_cancel(server: ServerThread, provider: FakeProvider, tenant: str,
                          session: str) -> None:
    """A Compact past its 0.5 s deadline, then one its caller cancels while the summarizer is
    at work."""
    from tests.integration.test_compact_rpc import compact_request

    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ContextEngineStub(channel)
        stub.Plan(plan_request(tenant, session), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            stub.Compact(compact_request(tenant, session, "late"), timeout=0.5)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        provider.started.clear()
        future = stub.Compact.future(compact_request(tenant, session, "given-up"), timeout=30)
        assert provider.started.wait(10)
        future.cancel()


def test_a_call_past_its_deadline_or_cancelled_is_counted_with_that_code(slow_summarizer, ids):
    """A call cancelled under its handler is not OK: its caller's deadline passing is
    DEADLINE_EXCEEDED, the caller giving up is CANCELLED, alike in the standard gRPC counter,
    the service's own latency histogram and its log line (ContextEngineRpcErrors counts
    DEADLINE_EXCEEDED as the server's failure)."""
    server, provider = slow_summarizer
    tenant, session = ids
    address = metrics_address(server)
    # both series exist at zero before the first such call: increase() counts that call
    fresh = {dict(labels)["code"]: v for (name, labels), v in scrape(address).items()
             if name == "context_engine_rpc_seconds_count"
             and dict(labels)["method"] == "Compact"}
    assert (fresh.get("DEADLINE_EXCEEDED"), fresh.get("CANCELLED")) == (0.0, 0.0), fresh
    lines: list[dict[str, object]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "fields", {})
            if record.getMessage() == "rpc" and fields.get("method") == "Compact":
                lines.append({"code": fields["code"], "reason": fields.get("reason"),
                              "level": record.levelname})

    keep = Keep()
    LOGGER.addHandler(keep)
    try:
        _deadline_then_cancel(server, provider, tenant, session)
        deadline = time.monotonic() + 15
        while len(lines) < 2 and time.monotonic() < deadline:  # both ended on the server
            time.sleep(0.05)
    finally:
        LOGGER.removeHandler(keep)
    assert sorted(map(str, lines)) == sorted(map(str, [
        {"code": "DEADLINE_EXCEEDED", "reason": "DEADLINE_EXCEEDED", "level": "WARNING"},
        {"code": "CANCELLED", "reason": "CANCELLED", "level": "WARNING"}]))

    def counts() -> tuple[dict[str, float], dict[str, float]]:
        samples = scrape(address)
        handled = {key[3]: v for key, v in series(samples, "grpc_server_handled_total").items()
                   if key[2] == "Compact" and v}
        rpc = {dict(labels)["code"]: v for (name, labels), v in samples.items()
               if name == "context_engine_rpc_seconds_count"
               and dict(labels)["method"] == "Compact" and v}
        return handled, rpc

    expected = {"DEADLINE_EXCEEDED": 1.0, "CANCELLED": 1.0}
    deadline = time.monotonic() + 15
    while counts() != (expected, expected) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counts() == (expected, expected)
