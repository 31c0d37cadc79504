# syntax=docker/dockerfile:1
# Multi-stage image: the build stage generates the gRPC code, builds the wheel and fetches the
# official tiktoken encodings; the runtime stage has only runtime dependencies, as non-root.

FROM python:3.11.7-slim-bookworm AS build
WORKDIR /src
COPY requirements/ requirements/
RUN pip install --no-cache-dir -r requirements/dev.txt
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY service/ service/
RUN python -m grpc_tools.protoc -Iproto --python_out=service --grpc_python_out=service \
        proto/context_engine/v1/context_engine.proto \
    && touch service/context_engine/v1/__init__.py \
    && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .
# Official encodings, fetched once here so the service never downloads at run time.
RUN mkdir -p /tiktoken && TIKTOKEN_CACHE_DIR=/tiktoken python -c \
    "import tiktoken; [tiktoken.get_encoding(n) for n in ('cl100k_base', 'o200k_base')]"

FROM python:3.11.7-slim-bookworm AS runtime
RUN useradd --system --uid 10001 --create-home --home-dir /app context-engine
WORKDIR /app
COPY requirements/runtime.txt /tmp/runtime.txt
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir -r /tmp/runtime.txt \
    && pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/runtime.txt
COPY migrations/ /app/migrations/
COPY --from=build /tiktoken /app/tiktoken
ENV TIKTOKEN_CACHE_DIR=/app/tiktoken \
    CE_MIGRATIONS_DIR=/app/migrations \
    CE_DATA_DIR=/app/data \
    CE_GRPC_ADDR=0.0.0.0:50051 \
    CE_METRICS_ADDR=0.0.0.0:9464 \
    PYTHONUNBUFFERED=1
USER 10001
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s CMD ["python", "-c", "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=2).status; sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["context-engine"]
CMD ["serve"]
