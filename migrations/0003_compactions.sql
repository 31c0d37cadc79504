-- Compactions (Compact): one row per idempotency key, keyed by tenant. The result is what the
-- runtime writes into its checkpoint; `context.compacted` is written in the same transaction.

CREATE TABLE compactions (
    tenant_id                  text        NOT NULL,
    idempotency_key            text        NOT NULL,
    session_id                 text        NOT NULL,
    fingerprint                text        NOT NULL,
    depth                      smallint    NOT NULL CHECK (depth BETWEEN 1 AND 2),
    replaced_through_sequence  bigint      NOT NULL,
    compactor_version          text        NOT NULL,
    result                     jsonb       NOT NULL,
    created_at                 timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, idempotency_key)
);

CREATE INDEX compactions_session ON compactions (tenant_id, session_id, created_at);
