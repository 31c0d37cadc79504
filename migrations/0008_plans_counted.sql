-- Whether the epoch has been counted in the metrics (context_engine_epochs_total, and
-- context_engine_sessions_opened_total for an epoch 1). A replica writes an epoch uncounted and,
-- once its COMMIT has answered, claims the count in a statement of its own (false to true): the
-- one that turns it true counts it. A COMMIT whose answer was lost (the connection dropped
-- during it) leaves the epoch written and uncounted, and the first Plan, or retried Rotate key,
-- that reads it, on any replica, claims it then: each epoch is counted once, not never.
-- Epochs written before this column existed were counted by their writers: true. So is an epoch
-- a replica of the release before writes during a rolling deploy (it counts its own).
ALTER TABLE plans ADD COLUMN counted boolean NOT NULL DEFAULT true;
