-- The epochs not yet counted in the metrics (plans.counted, migration 0008), oldest first: the
-- maintenance cycle claims and counts those older than its bound (an epoch whose writer's
-- claim failed, or whose COMMIT answer was lost, and that no Plan or retried Rotate key read
-- after), reading this index rather than every plan. It holds an epoch from its write until
-- its count is claimed, as a rule a moment later: a handful of entries. (Being in an index's
-- predicate, the claim of `counted` is no heap-only update any more: it adds an entry to the
-- primary key's index too, once per epoch.)
CREATE INDEX plans_uncounted ON plans (created_at) WHERE NOT counted;
