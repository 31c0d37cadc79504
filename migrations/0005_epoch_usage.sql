-- What the usage reports of each epoch of a session have told so far, for the cache metrics of
-- ReportUsage: an epoch's first report is the necessary miss that writes the prefix to the
-- provider's cache (left out of the cached prefix ratio), and each later report's cached tokens
-- are measured against the full input of the report before it (the cached input ratio). The
-- service is stateless across replicas, so this lives here, and it is updated in the
-- transaction that claims the report's idempotency key: a retried key counts once.

CREATE TABLE epoch_usage (
    tenant_id              text        NOT NULL,
    session_id             text        NOT NULL,
    epoch                  integer     NOT NULL CHECK (epoch >= 1),
    reports                bigint      NOT NULL CHECK (reports >= 1),
    -- input tokens of the last report counted, and of the one before it (NULL: none yet)
    last_input_tokens      bigint      NOT NULL CHECK (last_input_tokens >= 0),
    previous_input_tokens  bigint      CHECK (previous_input_tokens >= 0),
    updated_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, epoch),
    FOREIGN KEY (tenant_id, session_id, epoch) REFERENCES plans (tenant_id, session_id, epoch)
        ON DELETE CASCADE
);
