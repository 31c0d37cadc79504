"""Every SQL statement the service runs, by name."""

# Held until the transaction ends: nothing is left on the connection (a pooler in transaction
# mode may hand the next transaction to another server connection).
LOCK_MIGRATIONS = "SELECT pg_advisory_xact_lock($1)"
# The migrator's own bootstrap: the checksum column (SHA-256 of the file's bytes, hex) came after
# the table, so a database migrated before it gains the column here, NULL until backfilled.
CREATE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    checksum    text
)"""
# Asked first: ALTER TABLE locks the table ACCESS EXCLUSIVE even when the column exists, and a
# `migrate --status` would wait for the rest of the migration's transaction.
MIGRATION_CHECKSUM_EXISTS = """
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'schema_migrations'::regclass
               AND attname = 'checksum' AND NOT attisdropped)"""
ADD_MIGRATION_CHECKSUM = "ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS checksum text"
APPLIED_MIGRATIONS = """
SELECT version, name, applied_at, checksum FROM schema_migrations ORDER BY version"""
RECORD_MIGRATION = """
INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)"""
BACKFILL_MIGRATION_CHECKSUM = """
UPDATE schema_migrations SET checksum = $2 WHERE version = $1 AND checksum IS NULL"""
# Read-only, for `migrate --status`: creates nothing, and reads a table from before the checksum
# column too (to_jsonb of the row has no "checksum" key then).
MIGRATIONS_TABLE_EXISTS = "SELECT to_regclass('schema_migrations') IS NOT NULL"
APPLIED_MIGRATIONS_READ_ONLY = """
SELECT version, name, applied_at, to_jsonb(m) ->> 'checksum' AS checksum
FROM schema_migrations AS m ORDER BY version"""

# The session's row, created or locked in one statement: an erasure that deletes the row while
# this waits on its lock leaves the insert to create a new incarnation (two statements, an
# insert then a lock, would find no row to lock). The no-op update takes a NO KEY UPDATE lock
# (no key column changes): pins of one session serialize on it, while the key-share locks that
# foreign keys take on the row (an event, a keyed write naming the session, in this
# transaction or another) do not conflict with it. FOR UPDATE would: two Rotates whose keys had
# each taken a key-share lock would then wait for each other (a deadlock). Erasure's FOR UPDATE
# still excludes all of them.
LOCK_SESSION = """
INSERT INTO sessions (tenant_id, session_id) VALUES ($1, $2)
ON CONFLICT (tenant_id, session_id) DO UPDATE SET current_epoch = sessions.current_epoch
RETURNING current_epoch, incarnation, xmax = 0 AS inserted"""

# A row LOCK_SESSION inserted is numbered again, now that it is held: the column's default was
# taken when the insert began, and an insert that waited on an erasure's lock meanwhile may
# have seen a later incarnation of the session opened, read and erased in that time. Numbered
# here, a session's incarnations only grow (replicas take an older one for an erased one).
NUMBER_SESSION = """
UPDATE sessions SET incarnation = nextval('session_incarnations')
WHERE tenant_id = $1 AND session_id = $2
RETURNING incarnation"""

# The session's incarnation, the row held (as the foreign keys hold it) until the transaction
# ends: a keyed write made for one incarnation's plan checks it first (the session may have been
# erased and planned again since the plan was read).
SESSION_INCARNATION = """
SELECT incarnation FROM sessions WHERE tenant_id = $1 AND session_id = $2 FOR KEY SHARE"""

CURRENT_EPOCH = "SELECT current_epoch FROM sessions WHERE tenant_id = $1 AND session_id = $2"

# The current epoch with the session's incarnation (a session erased and planned again is a new
# incarnation at epoch 1 again): Build and GetPlan without an epoch read this on every call.
CURRENT_SESSION = """
SELECT incarnation, current_epoch FROM sessions WHERE tenant_id = $1 AND session_id = $2"""

# Re-verifies a cached plan: the session's incarnation if it still has the epoch.
PLAN_INCARNATION = """
SELECT s.incarnation FROM sessions s
WHERE s.tenant_id = $1 AND s.session_id = $2
  AND EXISTS (SELECT 1 FROM plans p
              WHERE p.tenant_id = s.tenant_id AND p.session_id = s.session_id AND p.epoch = $3)"""

# A plan row with its session's incarnation (read in the same statement, so the two agree).
PLAN_COLUMNS = """p.tenant_id, p.session_id, p.epoch, p.reason, p.spec_text, p.prefix_sha256,
    p.prefix_tokens, p.classes::text AS classes, p.created_at, s.incarnation, p.counted"""

GET_PLAN = f"""
SELECT {PLAN_COLUMNS}
FROM plans p JOIN sessions s ON s.tenant_id = p.tenant_id AND s.session_id = p.session_id
WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.epoch = $3"""

GET_CURRENT_PLAN = f"""
SELECT {PLAN_COLUMNS}
FROM plans p JOIN sessions s ON s.tenant_id = p.tenant_id AND s.session_id = p.session_id
WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.epoch = s.current_epoch"""

INSERT_PLAN = """
INSERT INTO plans (tenant_id, session_id, epoch, reason, spec_text, spec, prefix_sha256,
    prefix_tokens, classes, model_id, tokenizer, tool_names, deferred_tool_names,
    skipped_tool_names, authority_scope_hashes, builder_version, policy_version, cache_ttl,
    counted)
VALUES ($1, $2, $3, $4, $5::text, $5::text::jsonb, $6, $7, $8::jsonb, $9, $10, $11, $12,
    $13, $14, $15, $16, $17, false)
RETURNING created_at"""

# An epoch written uncounted (INSERT_PLAN) is counted by the one call that turns it counted: the
# writer once its COMMIT answered, or, when that answer was lost, the first call to read it
# after. A row lock orders concurrent claims; the later one finds it counted and claims nothing.
# Only while the session is still the incarnation the plan was read for. Run in a transaction
# of its own, writes the claim's own value ($5, plans.count_claim, migration 0010) and returns
# that transaction's id: a claim whose COMMIT goes unanswered is settled as a cycle's batch is
# (maintenance.XACT_STATUS, maintenance.CLAIMED_BY): counted if the row shows that value.
CLAIM_EPOCH_COUNT = """
UPDATE plans p SET counted = true, count_claim = $5::uuid
FROM sessions s
WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.epoch = $3 AND NOT p.counted
  AND s.tenant_id = p.tenant_id AND s.session_id = p.session_id AND s.incarnation = $4
RETURNING pg_current_xact_id()::text AS xid"""

ADVANCE_SESSION = """
UPDATE sessions SET current_epoch = $3, updated_at = now()
WHERE tenant_id = $1 AND session_id = $2 AND current_epoch = $3 - 1"""

# An event is identified by its event id and created_at (fixed at its first attempt, so a
# retry of a write that did land stores nothing new). context_events is partitioned by day on
# created_at (migration 0006): a day without a partition fails with check_violation.
INSERT_EVENT = """
INSERT INTO context_events (event_id, created_at, tenant_id, session_id, epoch, type, payload)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)
ON CONFLICT (event_id, created_at) DO NOTHING"""

# An event made for one incarnation of its session: written only while the session is that
# incarnation, its row held (FOR KEY SHARE, as the foreign key would) until the transaction
# ends. True when it is (the event written now, or by an earlier attempt), false when the
# session was erased (and maybe planned again) since: nothing written.
INSERT_EVENT_OF_INCARNATION = """
WITH s AS (SELECT 1 FROM sessions
           WHERE tenant_id = $3 AND session_id = $4 AND incarnation = $8 FOR KEY SHARE),
ins AS (INSERT INTO context_events (event_id, created_at, tenant_id, session_id, epoch, type,
            payload)
        SELECT $1, $2, $3, $4, $5, $6, $7::jsonb FROM s
        ON CONFLICT (event_id, created_at) DO NOTHING)
SELECT EXISTS (SELECT 1 FROM s)"""

GET_CALIBRATION = """
SELECT model_id, encoding, factor, reports FROM estimator_calibration
WHERE tenant_id = $1 AND model_id = $2"""

# The row must exist before it can be locked: two first reports would otherwise both read
# nothing and one update would be lost. A row with no reports is the default calibration.
ENSURE_CALIBRATION = """
INSERT INTO estimator_calibration (tenant_id, model_id, encoding, factor, reports)
VALUES ($1, $2, '', 1.0, 0)
ON CONFLICT (tenant_id, model_id) DO NOTHING"""

LOCK_CALIBRATION = GET_CALIBRATION + " FOR UPDATE"

UPSERT_CALIBRATION = """
INSERT INTO estimator_calibration (tenant_id, model_id, encoding, factor, reports)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (tenant_id, model_id) DO UPDATE
SET encoding = EXCLUDED.encoding, factor = EXCLUDED.factor, reports = EXCLUDED.reports,
    updated_at = now()"""

# One counted usage report against its session's epoch, in the report's transaction: returns
# how many the epoch has counted (this one included) and the input tokens of the one before it.
# The row lock of the upsert orders concurrent reports of one epoch.
COUNT_EPOCH_REPORT = """
INSERT INTO epoch_usage AS u (tenant_id, session_id, epoch, reports, last_input_tokens)
VALUES ($1, $2, $3, 1, $4)
ON CONFLICT (tenant_id, session_id, epoch) DO UPDATE
SET reports = u.reports + 1, previous_input_tokens = u.last_input_tokens,
    last_input_tokens = EXCLUDED.last_input_tokens, updated_at = now()
RETURNING reports, previous_input_tokens"""

# The latest reconciled factor of every model id across tenants, oldest first (the metrics'
# correction factor gauge at start-up).
LATEST_FACTORS = """
SELECT model_id, factor FROM (
    SELECT DISTINCT ON (model_id) model_id, factor, updated_at FROM estimator_calibration
    WHERE reports > 0 ORDER BY model_id, updated_at DESC) latest
ORDER BY updated_at, model_id"""

# The key names its session ($4): erasing the session removes it, and the foreign key holds a
# key-share lock on the session's row until the transaction ends (an erasure waits for it, or
# this insert fails with foreign_key_violation once the session is gone). A key older than $5
# (the key TTL, by PostgreSQL's clock, which made it) is claimed anew: a retry after the TTL is
# a new request whether or not a maintenance cycle has deleted the key yet. A fence passes NULL
# and is never claimed anew (it lives as long as the event it fences). A concurrent claim of
# the same expired key waits for this row and then finds it young: a retry of this one.
CLAIM_KEY = """
INSERT INTO idempotency_keys (tenant_id, rpc, key, response, session_id)
VALUES ($1, $2, $3, '{}'::jsonb, $4)
ON CONFLICT (tenant_id, rpc, key) DO UPDATE
    SET response = '{}'::jsonb, session_id = EXCLUDED.session_id, created_at = now()
    WHERE idempotency_keys.created_at < now() - $5::interval
RETURNING key"""

GET_KEY = """
SELECT response::text FROM idempotency_keys WHERE tenant_id = $1 AND rpc = $2 AND key = $3"""

SET_KEY_RESPONSE = """
UPDATE idempotency_keys SET response = $4::jsonb WHERE tenant_id = $1 AND rpc = $2 AND key = $3"""

# A record older than $9 (the key TTL, by PostgreSQL's clock) is replaced, as CLAIM_KEY
# claims an expired key anew.
CLAIM_COMPACTION = """
INSERT INTO compactions (tenant_id, idempotency_key, session_id, fingerprint, depth,
    replaced_through_sequence, compactor_version, result)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb)
ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
    SET session_id = EXCLUDED.session_id, fingerprint = EXCLUDED.fingerprint,
        depth = EXCLUDED.depth, replaced_through_sequence = EXCLUDED.replaced_through_sequence,
        compactor_version = EXCLUDED.compactor_version, result = EXCLUDED.result,
        created_at = now()
    WHERE compactions.created_at < now() - $9::interval
RETURNING idempotency_key"""

GET_COMPACTION = """
SELECT session_id, fingerprint, result::text AS result FROM compactions
WHERE tenant_id = $1 AND idempotency_key = $2"""

# The record a retry answers with: none once it is older than $3 (the key TTL).
GET_LIVE_COMPACTION = GET_COMPACTION + " AND created_at >= now() - $3::interval"
