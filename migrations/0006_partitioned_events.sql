-- context_events becomes a table partitioned by day: PARTITION BY RANGE (created_at), one
-- partition per UTC day named context_events_pYYYYMMDD, [day 00:00 UTC, next day 00:00 UTC).
-- The service creates the partitions ahead and drops those past CE_EVENTS_RETENTION_DAYS
-- (adapters/postgres/maintenance.py); there is no DEFAULT partition (a row in it would stop
-- the day's partition from being created), so a day without a partition refuses its rows.
--
-- Every event gets an identity, fixed at its first attempt to be written: event_id and
-- created_at (the primary key). A retried write of an event that did land stores nothing new
-- (INSERT ... ON CONFLICT (event_id, created_at) DO NOTHING).
--
-- Events belong to their session: FOREIGN KEY ... ON DELETE CASCADE, so erasing a session
-- removes its events, and an event written for an erased session is refused.
--
-- Existing rows keep their id, created_at and everything else, and get a random event_id.
-- Rows whose session no longer exists (none are expected: nothing deleted sessions before)
-- cannot satisfy the foreign key: they are kept aside, unchanged, in context_events_orphaned,
-- which is dropped again when it is empty; the service never reads it.
--
-- One transaction (the migrator's): the old table is rewritten while it is locked.

ALTER TABLE context_events RENAME TO context_events_before_0006;
ALTER TABLE context_events_before_0006 RENAME CONSTRAINT context_events_pkey
    TO context_events_before_0006_pkey;
ALTER INDEX context_events_by_session RENAME TO context_events_before_0006_by_session;
-- the id sequence outlives the old table and keeps numbering the new one
ALTER SEQUENCE context_events_id_seq OWNED BY NONE;

CREATE TABLE context_events (
    id          bigint      NOT NULL DEFAULT nextval('context_events_id_seq'),
    event_id    uuid        NOT NULL DEFAULT gen_random_uuid(),
    tenant_id   text        NOT NULL,
    session_id  text        NOT NULL,
    epoch       integer,
    type        text        NOT NULL,
    payload     jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, created_at),
    FOREIGN KEY (tenant_id, session_id) REFERENCES sessions (tenant_id, session_id)
        ON DELETE CASCADE
) PARTITION BY RANGE (created_at);

ALTER SEQUENCE context_events_id_seq OWNED BY context_events.id;

-- `context-engine inspect` reads a session's events by id; the cascade finds them by session
CREATE INDEX context_events_by_session ON context_events (tenant_id, session_id, id);

-- A partition for every day that has rows, and for today through 7 days ahead (the default of
-- CE_EVENT_PARTITIONS_AHEAD_DAYS; the service's first maintenance cycle tops it up).
DO $$
DECLARE
    day date;
BEGIN
    FOR day IN
        SELECT DISTINCT (created_at AT TIME ZONE 'UTC')::date FROM context_events_before_0006
        UNION
        SELECT (now() AT TIME ZONE 'UTC')::date + ahead FROM generate_series(0, 7) AS ahead
    LOOP
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF context_events FOR VALUES FROM (%L) TO (%L)',
            'context_events_p' || to_char(day, 'YYYYMMDD'),
            to_char(day, 'YYYY-MM-DD') || ' 00:00:00+00',
            to_char(day + 1, 'YYYY-MM-DD') || ' 00:00:00+00');
    END LOOP;
END
$$;

CREATE TABLE context_events_orphaned AS
SELECT o.* FROM context_events_before_0006 AS o
WHERE NOT EXISTS (SELECT 1 FROM sessions AS s
                  WHERE s.tenant_id = o.tenant_id AND s.session_id = o.session_id);

INSERT INTO context_events (id, event_id, tenant_id, session_id, epoch, type, payload,
                            created_at)
SELECT o.id, gen_random_uuid(), o.tenant_id, o.session_id, o.epoch, o.type, o.payload,
       o.created_at
FROM context_events_before_0006 AS o
WHERE EXISTS (SELECT 1 FROM sessions AS s
              WHERE s.tenant_id = o.tenant_id AND s.session_id = o.session_id);

-- New rows are numbered after every old one, the set-aside ones included.
SELECT setval('context_events_id_seq',
              greatest((SELECT coalesce(max(id), 0) FROM context_events_before_0006),
                       (SELECT last_value FROM context_events_id_seq), 1));

DROP TABLE context_events_before_0006;

DO $$
DECLARE
    orphaned bigint;
BEGIN
    SELECT count(*) INTO orphaned FROM context_events_orphaned;
    IF orphaned = 0 THEN
        DROP TABLE context_events_orphaned;
    ELSE
        RAISE WARNING '% context events of sessions that no longer exist were kept aside in '
                      'context_events_orphaned (not read by the service; drop it when done)',
                      orphaned;
    END IF;
END
$$;

-- The maintenance cycle deletes idempotency keys and compaction records by age.
CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
CREATE INDEX compactions_by_age ON compactions (created_at);
