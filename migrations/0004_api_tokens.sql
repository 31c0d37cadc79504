-- API bearer tokens, stored only as SHA-256 hashes. Each token is bound to one tenant and a set
-- of RPC names ('*' = every RPC). A revoked token stops working within the server's cache TTL.

CREATE TABLE api_tokens (
    token_sha256  text        NOT NULL UNIQUE CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    tenant_id     text        NOT NULL CHECK (tenant_id <> ''),
    rpcs          text[]      NOT NULL CHECK (cardinality(rpcs) > 0),
    description   text        NOT NULL DEFAULT '',
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz,
    PRIMARY KEY (tenant_id, token_sha256)
);
