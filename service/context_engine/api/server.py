"""The entrypoint's server: gRPC (ContextEngine, health, reflection), metrics, graceful stop."""

from __future__ import annotations

import asyncio
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from context_engine import __version__
from context_engine.adapters.assets import (
    load_control_tools,
    load_model_catalog,
    load_platform_assets,
)
from context_engine.adapters.postgres.migrate import migrate
from context_engine.adapters.postgres.store import (
    PostgresCalibrationStore,
    PostgresCompactionStore,
    PostgresEventLog,
    PostgresPlanStore,
)
from context_engine.adapters.summarizer import OpenAISummarizer, load_prompt
from context_engine.adapters.tokenizers import TiktokenRegistry
from context_engine.api.auth import auth_interceptor, server_credentials
from context_engine.api.servicer import ContextEngineServicer
from context_engine.config import Config, split_addr
from context_engine.domain.compaction import StructuredSummarizer, Summarizer
from context_engine.engine import Engine
from context_engine.telemetry.logs import log
from context_engine.telemetry.metrics import Metrics
from context_engine.telemetry.tracing import otlp_provider, tracer_for
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ContextEngine"].full_name


def embedded_database_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL under ``data_dir``; it survives restarts."""
    with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR on import
        warnings.simplefilter("ignore")
        # imported lazily: only the embedded mode needs it
        from pgserver import get_server  # type: ignore[attr-defined]

    pg_dir = data_dir / "pg"
    pg_dir.mkdir(parents=True, exist_ok=True)
    server = get_server(pg_dir, cleanup_mode="stop")
    return str(server.get_uri())


@dataclass
class Running:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    pool: asyncpg.Pool
    engine: Engine
    grpc_port: int
    metrics_port: int | None
    metrics_http: Any
    tracing: Any = None  # the OTLP tracer provider this server created, flushed at stop

    async def stop(self, grace: float, *, drain: float = 0.0) -> None:
        """Health goes NOT_SERVING first and stays so for ``drain`` seconds while RPCs are
        still served (load balancers notice), then in-flight RPCs get ``grace`` seconds."""
        await self.health.enter_graceful_shutdown()
        if drain > 0:
            await asyncio.sleep(drain)
        await self.server.stop(grace)
        await self.pool.close()
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # exports what is still batched


def summarizer_for(config: Config) -> Summarizer:
    """The LLM summarizer when CE_SUMMARIZER_URL is set; the deterministic one otherwise."""
    if config.summarizer_url:
        return OpenAISummarizer(url=config.summarizer_url, model=config.summarizer_model,
                                api_key=config.summarizer_api_key,
                                timeout=config.summarizer_timeout_seconds,
                                prompt=load_prompt(config.assets_dir))
    return StructuredSummarizer()


async def start(config: Config, *, database_url: str,
                registry: CollectorRegistry = REGISTRY,
                tracer_provider: trace.TracerProvider | None = None) -> Running:
    """``tracer_provider``: where spans go; without one, OTLP when the ``OTEL_*`` variables
    ask for it (``Config.trace_export``), else nowhere (a no-op tracer)."""
    applied = await migrate(database_url, config.migrations_dir)
    if applied:
        log("migrated", applied=applied)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=config.db_pool_size,
                                     command_timeout=config.db_timeout_seconds)
    metrics = Metrics(registry)
    owned = otlp_provider(__version__) if tracer_provider is None and config.trace_export \
        else None
    tracer = tracer_for(tracer_provider or owned)
    timeout = config.db_timeout_seconds
    engine = Engine(
        store=PostgresPlanStore(pool, command_timeout=timeout, tracer=tracer),
        events=PostgresEventLog(pool, command_timeout=timeout, tracer=tracer),
        calibrations=PostgresCalibrationStore(pool, command_timeout=timeout, tracer=tracer),
        policy=config.budget_policy(), calibration_ttl=config.calibration_ttl_seconds,
        catalog=load_model_catalog(config.model_catalog),
        tokenizers=TiktokenRegistry(),
        assets=load_platform_assets(config.assets_dir),
        control_tools=load_control_tools(config.assets_dir),
        metrics=metrics, plan_cache_size=config.plan_cache_size,
        compactions=PostgresCompactionStore(pool, command_timeout=timeout, tracer=tracer),
        summarizer=summarizer_for(config), tracer=tracer)

    auth = auth_interceptor(config, pool, metrics)  # None in dev mode
    server = grpc.aio.server(interceptors=[auth] if auth else None, options=[
        ("grpc.max_receive_message_length", config.max_receive_bytes),
        ("grpc.max_send_message_length", config.max_receive_bytes),
    ])
    pb_grpc.add_ContextEngineServicer_to_server(ContextEngineServicer(engine, metrics, tracer),
                                                server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    credentials = server_credentials(config)  # None: plaintext
    grpc_port = (server.add_insecure_port(config.grpc_addr) if credentials is None
                 else server.add_secure_port(config.grpc_addr, credentials))
    if grpc_port == 0:
        raise RuntimeError(f"could not bind gRPC to {config.grpc_addr}")

    metrics_http = None
    metrics_port = None
    if config.metrics_addr:
        host, port = split_addr(config.metrics_addr)
        metrics_http, _ = start_http_server(port, addr=host, registry=registry)
        metrics_port = int(metrics_http.server_port)

    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Running(server=server, health=health_servicer, pool=pool, engine=engine,
                   grpc_port=grpc_port, metrics_port=metrics_port, metrics_http=metrics_http,
                   tracing=owned)


async def serve(config: Config) -> None:
    database_url = config.database_url
    embedded = database_url is None
    if database_url is None:
        database_url = await asyncio.to_thread(embedded_database_url, config.data_dir)
    running = await start(config, database_url=database_url)
    host, _ = split_addr(config.grpc_addr)
    log("serving", grpc=f"{host}:{running.grpc_port}",
        metrics=(f"{split_addr(config.metrics_addr)[0]}:{running.metrics_port}"
                 if running.metrics_port is not None else None),
        database="embedded" if embedded else "external",
        data_dir=str(config.data_dir) if embedded else None)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log("stopping", drain_seconds=config.drain_seconds, grace_seconds=config.grace_seconds)
    await running.stop(config.grace_seconds, drain=config.drain_seconds)
    log("stopped")
