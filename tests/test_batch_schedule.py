"""The batch schedule against a step-by-step count of the rows each stream gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.batch_schedule import BatchSchedule


@st.composite
def schedules(draw):
    streams = draw(st.integers(1, 4))
    b = streams * draw(st.integers(1, 6))
    keys = sorted(draw(st.sets(st.integers(0, 12), max_size=4)))
    rampup = tuple((k, streams * draw(st.integers(1, 8)) / b) for k in keys)
    return BatchSchedule(global_batch_size=b, num_streams=streams, rampup=rampup)


def _per_step(schedule: BatchSchedule, steps: int) -> list[int]:
    return [schedule.size_at(t) // schedule.num_streams for t in range(steps)]


@settings(max_examples=200, deadline=None)
@given(schedules(), st.integers(0, 30), st.integers(0, 60))
def test_schedule_counts_match_a_step_by_step_count(schedule, start, rows):
    k = _per_step(schedule, start + rows + 2)
    assert schedule.rows_before(start) == sum(k[:start])
    # steps_covering: the first n whose steps from `start` hold all the rows (or are full).
    total, reach, full = 0, None, 0
    for n, kt in enumerate(k[start:], 1):
        if total < rows:
            full = n if total + kt <= rows else full
        total += kt
        if reach is None and total >= rows:
            reach = n
    assert schedule.steps_covering(rows, start=start) == (0 if rows == 0 else reach)
    assert schedule.steps_covering(rows, start=start, full=True) == (0 if rows == 0 else full)


def test_the_factor_is_kept_after_the_last_key_and_never_accumulated():
    s = BatchSchedule(global_batch_size=8, num_streams=4, rampup=((0, 0.5), (2, 1.5)))
    assert [s.size_at(t) for t in range(4)] == [4, 4, 12, 12]
    assert s.size_at(10**9) == 12
    assert s.sizes() == {8: "global_batch_size=8",
                         4: "batch_rampup step 0: global_batch_size=8 x 0.5 = 4 rows",
                         12: "batch_rampup step 2: global_batch_size=8 x 1.5 = 12 rows"}


def test_a_step_size_not_divisible_by_the_streams_is_refused():
    with pytest.raises(ValueError, match="num_streams=4"):
        BatchSchedule(global_batch_size=8, num_streams=4, rampup=((3, 0.75),))
    with pytest.raises(ValueError, match="sorted by step"):
        BatchSchedule(global_batch_size=8, num_streams=4, rampup=((3, 1.0), (1, 0.5)))
