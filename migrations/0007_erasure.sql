-- Erasure: DeleteSession removes one session's rows, `context-engine purge-tenant` a tenant's.

-- A session's incarnation: a new number each time its row is inserted. A session erased and
-- planned again starts at epoch 1 again; the incarnation tells the new session from the erased
-- one, so a replica's plan cache (keyed by it) never serves the erased session's plan for the
-- new one. Existing rows get numbers too (the volatile default is evaluated per row).
CREATE SEQUENCE session_incarnations AS bigint;
ALTER TABLE sessions ADD COLUMN incarnation bigint NOT NULL
    DEFAULT nextval('session_incarnations');
ALTER SEQUENCE session_incarnations OWNED BY sessions.incarnation;

-- The session a keyed write belongs to, so erasing the session removes its keys. Keys written
-- before this column get it where it can be told: Rotate's stored response names the session,
-- and a context.snapshot.used key is '<session id>:<epoch>:<run id>' (taken only when exactly
-- one existing session fits it); ReportUsage's keys name none and leave with the idempotency
-- window. A key that names a session holds a key-share lock on its row until its transaction
-- ends, so an erasure (which locks the row FOR UPDATE first) either sees the key or makes the
-- keyed write fail.
ALTER TABLE idempotency_keys ADD COLUMN session_id text;
UPDATE idempotency_keys k SET session_id = s.session_id
FROM sessions s
WHERE k.rpc = 'Rotate' AND k.session_id IS NULL
  AND s.tenant_id = k.tenant_id AND s.session_id = k.response ->> 'session_id';
WITH candidates AS (
    SELECT k.tenant_id, k.rpc, k.key, left(k.key, i - 1) AS session_id
    FROM idempotency_keys k, generate_series(2, length(k.key)) AS i
    WHERE k.rpc = 'context.snapshot.used' AND k.session_id IS NULL
      AND substr(k.key, i, 1) = ':' AND substr(k.key, i + 1) ~ '^[0-9]+:.'
), matched AS (
    SELECT c.tenant_id, c.rpc, c.key, min(c.session_id) AS session_id
    FROM candidates c
    JOIN sessions s ON s.tenant_id = c.tenant_id AND s.session_id = c.session_id
    GROUP BY c.tenant_id, c.rpc, c.key
    HAVING count(*) = 1
)
UPDATE idempotency_keys k SET session_id = m.session_id
FROM matched m
WHERE k.tenant_id = m.tenant_id AND k.rpc = m.rpc AND k.key = m.key;
ALTER TABLE idempotency_keys ADD FOREIGN KEY (tenant_id, session_id)
    REFERENCES sessions (tenant_id, session_id);
CREATE INDEX idempotency_keys_by_session ON idempotency_keys (tenant_id, session_id)
    WHERE session_id IS NOT NULL;

-- Compactions belong to a session that exists, with the same lock as above.
ALTER TABLE compactions ADD FOREIGN KEY (tenant_id, session_id)
    REFERENCES sessions (tenant_id, session_id);

-- One row per erasure, holding no content: no session id (its SHA-256 proves, to someone who
-- knows the id, that this session was erased), no text, no payload; the rows removed by kind,
-- who asked and when (the server's clock). Kept when the tenant is purged.
CREATE TABLE erasures (
    id                bigserial   PRIMARY KEY,
    tenant_id         text        NOT NULL,
    scope             text        NOT NULL CHECK (scope IN ('session', 'tenant')),
    -- hex SHA-256 of the session id's UTF-8 bytes; NULL for a tenant-wide purge
    session_sha256    text        CHECK (session_sha256 ~ '^[0-9a-f]{64}$'),
    sessions          bigint      NOT NULL CHECK (sessions >= 0),
    plans             bigint      NOT NULL CHECK (plans >= 0),
    events            bigint      NOT NULL CHECK (events >= 0),
    compactions       bigint      NOT NULL CHECK (compactions >= 0),
    idempotency_keys  bigint      NOT NULL CHECK (idempotency_keys >= 0),
    usage_rows        bigint      NOT NULL CHECK (usage_rows >= 0),
    calibrations      bigint      NOT NULL CHECK (calibrations >= 0),
    -- 'token:' and the first 12 hex of the caller's token SHA-256, 'dev' (no credentials) or
    -- 'operator-cli'
    requested_by      text        NOT NULL CHECK (requested_by <> ''),
    erased_at         timestamptz NOT NULL,
    CHECK ((scope = 'session') = (session_sha256 IS NOT NULL))
);

CREATE INDEX erasures_by_tenant ON erasures (tenant_id, erased_at);
CREATE INDEX erasures_by_session ON erasures (session_sha256) WHERE session_sha256 IS NOT NULL;
