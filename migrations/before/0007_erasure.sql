-- Run in the transaction of migrations/0007_erasure.sql, right before it, on a database that
-- has not applied it (adapters/postgres/migrate.py). 0007 itself stays as released: every
-- database that applied it recorded its checksum, and the release before has the same file.
--
-- 0007 gives compactions a foreign key to sessions. Before DeleteSession existed, an operator
-- could only erase a session by hand (its plans, then its row), which left its compaction
-- records behind: 0007 then failed with ForeignKeyViolationError on
-- compactions_tenant_id_session_id_fkey, and every later migration waited behind it. Those
-- records are kept aside here, unchanged, in compactions_orphaned, as 0006 keeps such events
-- in context_events_orphaned: moved in one statement (one snapshot, so a record is either kept
-- aside or stays), the table dropped again when it is empty, the count said with RAISE WARNING
-- (`migrate` logs it as migration_message). The service never reads the table; DeleteSession
-- (of that session id) and purge-tenant erase its rows; the operator drops it when done.
--
-- Idempotency keys need nothing: 0007 gives a key a session only when that session has a row.

CREATE TABLE compactions_orphaned (LIKE compactions);

WITH kept_aside AS (
    DELETE FROM compactions AS c
    WHERE NOT EXISTS (SELECT 1 FROM sessions AS s
                      WHERE s.tenant_id = c.tenant_id AND s.session_id = c.session_id)
    RETURNING c.*
)
INSERT INTO compactions_orphaned SELECT * FROM kept_aside;

DO $$
DECLARE
    orphaned bigint;
BEGIN
    SELECT count(*) INTO orphaned FROM compactions_orphaned;
    IF orphaned = 0 THEN
        DROP TABLE compactions_orphaned;
    ELSE
        RAISE WARNING '% compaction records of sessions that no longer exist were kept aside '
                      'in compactions_orphaned (not read by the service; DeleteSession and '
                      'purge-tenant erase them; drop it when done)', orphaned;
    END IF;
END
$$;
