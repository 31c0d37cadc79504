-- Sessions, their pinned plans (one row per epoch) and the context event outbox.
-- Every row is keyed by tenant_id.

CREATE TABLE sessions (
    tenant_id      text        NOT NULL,
    session_id     text        NOT NULL,
    current_epoch  integer     NOT NULL DEFAULT 0 CHECK (current_epoch >= 0),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id)
);

CREATE TABLE plans (
    tenant_id              text        NOT NULL,
    session_id             text        NOT NULL,
    epoch                  integer     NOT NULL CHECK (epoch >= 1),
    reason                 text        NOT NULL,
    -- The pinned specification the prefix is re-rendered from, as the canonical JSON text
    -- (jsonb would reorder keys and rewrite numbers such as 1e16 or -0.0); it is parsed and
    -- re-serialized canonically before anything is hashed. `spec` is the same document as
    -- jsonb, for queries only.
    spec_text              text        NOT NULL,
    spec                   jsonb       NOT NULL,
    prefix_sha256          text        NOT NULL CHECK (length(prefix_sha256) = 64),
    prefix_tokens          integer     NOT NULL CHECK (prefix_tokens >= 0),
    classes                jsonb       NOT NULL,
    model_id               text        NOT NULL,
    tokenizer              text        NOT NULL,
    tool_names             text[]      NOT NULL,
    deferred_tool_names    text[]      NOT NULL,
    skipped_tool_names     text[]      NOT NULL,
    authority_scope_hashes text[]      NOT NULL,
    builder_version        text        NOT NULL,
    policy_version         text        NOT NULL,
    cache_ttl              text        NOT NULL,
    created_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, epoch),
    FOREIGN KEY (tenant_id, session_id) REFERENCES sessions (tenant_id, session_id)
);

-- Append-only outbox of the events the service emits.
CREATE TABLE context_events (
    id          bigserial   PRIMARY KEY,
    tenant_id   text        NOT NULL,
    session_id  text        NOT NULL,
    epoch       integer,
    type        text        NOT NULL,
    payload     jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX context_events_by_session ON context_events (tenant_id, session_id, id);
