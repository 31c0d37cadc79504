# syntax=docker/dockerfile:1
# Two stages on one pinned base. The build stage generates the gRPC code (grpcio-tools lives
# only here), builds the wheel and fetches the official tiktoken encodings; the runtime stage
# installs exactly requirements/runtime.txt plus that wheel and runs as a non-root user.
#
# The image listens on 0.0.0.0:50051 (gRPC) and 0.0.0.0:9464 (/metrics). A non-loopback bind
# needs credentials: mount a tokens file and set CE_AUTH_TOKENS_FILE, and/or keep tokens in
# the api_tokens table with CE_AUTH_DB_TOKENS=1 (dev mode is refused off loopback). See
# deploy/README.md.

FROM python:3.11.7-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/ requirements/
# Runtime dependencies plus the two build-only tools, at the versions pinned for code generation.
RUN pip install -r requirements/runtime.txt \
        $(grep -E '^(grpcio-tools|setuptools)==' requirements/gen.txt)
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY service/ service/
RUN rm -rf service/context_engine/v1 && mkdir -p service/context_engine/v1 \
    && python -m grpc_tools.protoc -Iproto --python_out=service --grpc_python_out=service \
        proto/context_engine/v1/*.proto \
    && touch service/context_engine/v1/__init__.py \
    && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .
# The official encodings, fetched once here (tiktoken checks their SHA-256) so that the
# service never downloads at run time.
RUN mkdir -p /tiktoken \
    && TIKTOKEN_CACHE_DIR=/tiktoken python -c \
        "import tiktoken; [tiktoken.get_encoding(n) for n in ('cl100k_base', 'o200k_base')]"

FROM python:3.11.7-slim-bookworm AS runtime
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY requirements/runtime.txt /tmp/runtime.txt
COPY --from=build /wheels /tmp/wheels
RUN pip install -r /tmp/runtime.txt \
    && pip install --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/runtime.txt
RUN groupadd --system --gid 10001 context-engine \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /app \
        --shell /usr/sbin/nologin context-engine \
    && mkdir -p /app/data && chown 10001:10001 /app/data
WORKDIR /app
COPY migrations/ /app/migrations/
COPY --from=build /tiktoken /app/tiktoken
# CE_DATA_DIR is used only without DATABASE_URL (the embedded PostgreSQL, for a quick look).
ENV TIKTOKEN_CACHE_DIR=/app/tiktoken \
    CE_MIGRATIONS_DIR=/app/migrations \
    CE_DATA_DIR=/app/data \
    CE_GRPC_ADDR=0.0.0.0:50051 \
    CE_METRICS_ADDR=0.0.0.0:9464
# Fail the build unless the service itself finds both encodings offline, hash-checked.
RUN python -c "import sys; from context_engine.adapters.tokenizers import cached_offline; \
sys.exit(0 if all(cached_offline(n) for n in ('cl100k_base', 'o200k_base')) else 1)"
USER 10001:10001
EXPOSE 50051 9464
# Plaintext by default. With CE_TLS_CERT_FILE set the probe dials TLS and needs to know how to
# verify the server: CE_HEALTH_TLS_CA_FILE and CE_HEALTH_TLS_SERVER_NAME (plus
# CE_HEALTH_TLS_CERT_FILE and CE_HEALTH_TLS_KEY_FILE under mutual TLS); without them it fails
# with a message saying so rather than dialing plaintext.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["context-engine", "health"]
ENTRYPOINT ["context-engine"]
CMD ["serve"]
