-- Per-model estimator correction factors, shared by every replica, and idempotency keys.

CREATE TABLE estimator_calibration (
    tenant_id   text             NOT NULL,
    model_id    text             NOT NULL,
    -- The encoding the factor was learned with: a different one starts again from 1.0.
    encoding    text             NOT NULL,
    factor      double precision NOT NULL CHECK (factor > 0),
    reports     bigint           NOT NULL DEFAULT 0,
    updated_at  timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, model_id)
);

CREATE TABLE idempotency_keys (
    tenant_id   text        NOT NULL,
    rpc         text        NOT NULL,
    key         text        NOT NULL,
    response    jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, rpc, key)
);
