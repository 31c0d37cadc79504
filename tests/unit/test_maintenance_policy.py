"""The maintenance cycle's arithmetic: which UTC days need a partition, which partitions are past
the retention (to the instant: a partition goes when its upper bound, the next midnight, is at or
before now - retention), and the partition names it reads and writes."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone

import pytest
from context_engine.adapters.postgres.maintenance import (
    Policy,
    create_partition_sql,
    partition_day,
    partition_name,
)


def test_today_through_the_ahead_window_in_utc():
    policy = Policy(ahead_days=2)
    # 23:30 on the 31st in UTC-05:00 is already the 1st in UTC
    now = datetime(2026, 12, 31, 23, 30, tzinfo=timezone(timedelta(hours=-5)))
    assert policy.wanted(now) == [date(2027, 1, 1), date(2027, 1, 2), date(2027, 1, 3)]


@pytest.mark.parametrize(("now", "expired"), [
    (datetime(2026, 12, 31, 0, 0, tzinfo=UTC) - timedelta(microseconds=1), False),
    (datetime(2026, 12, 31, 0, 0, tzinfo=UTC), True),  # every row is older than 30 days
])
def test_a_partition_expires_when_its_last_instant_passes_the_retention(now, expired):
    # the partition of 1 December holds [1 Dec, 2 Dec): with 29 days of retention its last
    # instant is past the retention from 31 Dec 00:00 (2 Dec + 29 days)
    policy = Policy(retention_days=29)
    assert policy.expired(date(2026, 12, 1), now) is expired


def test_a_partition_with_a_row_inside_the_retention_is_kept():
    policy = Policy(retention_days=30)
    day = date(2026, 11, 1)
    last_row = datetime(2026, 11, 1, 23, 59, tzinfo=UTC)
    assert not policy.expired(day, last_row + timedelta(days=30) - timedelta(seconds=1))
    assert policy.expired(day, datetime(2026, 12, 2, tzinfo=UTC))


def test_names_round_trip_and_others_are_left_alone():
    assert partition_name(date(2026, 12, 1)) == "context_events_p20261201"
    assert partition_day("context_events_p20261201") == date(2026, 12, 1)
    for other in ("context_events_p20261301", "context_events_old", "context_events_p2026120"):
        assert partition_day(other) is None
    assert create_partition_sql(date(2026, 12, 31)).endswith(
        "FOR VALUES FROM ('2026-12-31 00:00:00+00') TO ('2027-01-01 00:00:00+00')")


@pytest.mark.parametrize("bad", [{"retention_days": 0}, {"ahead_days": 0}, {"batch_size": 0},
                                 {"key_ttl": timedelta(0)}, {"uncounted_after": timedelta(0)}])
def test_a_policy_refuses_what_it_cannot_honour(bad):
    with pytest.raises(ValueError):
        Policy(**bad)
