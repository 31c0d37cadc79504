-- Which claim counted the epoch (plans.counted, migration 0008): a value unique to the claim,
-- written by its UPDATE with counted. A claim whose COMMIT went unanswered is settled by the
-- process that made it, counted once its epochs' rows show it: asking PostgreSQL whether the
-- claim's transaction id committed (pg_xact_status) answered, after a failover to a standby
-- that lacked the claim's COMMIT, for another transaction given the same id there, and the
-- epochs, uncounted there, were counted twice. NULL: counted by the release before this column
-- (a replica of it, running beside this release during a rolling deploy, claims without it
-- and settles its claims as it did), or by the writer of an epoch written before migration
-- 0008, or not counted yet. Nullable without a default: added without rewriting the table.
ALTER TABLE plans ADD COLUMN count_claim uuid;
