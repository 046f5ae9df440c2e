"""Placement of streams on workers: the groups, and the warning where shares are unequal."""

from __future__ import annotations

import collections

import pytest

from actors.placement import group_streams, idle_workers, place_groups, uneven_share
from ingest.runtime import streams_per_call_for


def _place(streams: int, workers: int) -> dict[int, str]:
    per_call = streams_per_call_for(streams, workers)
    return place_groups(list(range(streams)), per_call, [f"w{i}" for i in range(workers)])


@pytest.mark.parametrize("streams,workers", [(16, 1), (16, 2), (16, 8), (16, 16), (12, 3),
                                             (12, 4)])
def test_even_shares_give_no_warning(streams, workers):
    placement = _place(streams, workers)
    assert len(set(collections.Counter(placement.values()).values())) == 1
    assert uneven_share(placement, workers) is None


@pytest.mark.parametrize("streams,workers", [(16, 15), (16, 6), (16, 3), (12, 5), (10, 4)])
def test_uneven_shares_name_the_pace_of_the_busiest_worker_and_the_even_choices(streams,
                                                                                 workers):
    placement = _place(streams, workers)
    counts = collections.Counter(placement.values())
    pace, why = uneven_share(placement, workers)
    assert pace == pytest.approx(streams / max(counts.values()))
    assert pace < workers
    assert f"{streams} streams on {workers} workers" in why
    assert f"holds {max(counts.values())} streams and the lightest {min(counts.values())}" in why
    even = [d for d in range(1, streams + 1) if streams % d == 0]
    below = max(d for d in even if d <= workers)
    above = min(d for d in even if d > workers)
    assert f"{below} or {above} workers" in why


def test_fifteen_workers_on_sixteen_streams_make_what_eight_make():
    pace, why = uneven_share(_place(16, 15), 15)
    assert pace == 8.0
    assert "8 or 16 workers" in why


def test_grouped_calls_count_in_the_share():
    # 16 streams on 6 workers, two streams a call: 8 groups dealt in turn, so two workers hold
    # two groups (4 streams) and four hold one (2 streams).
    groups = group_streams(list(range(16)), 2)
    assert groups[0] == (0, 1) and groups[15] == (14, 15)
    placement = place_groups(list(range(16)), 2, [f"w{i}" for i in range(6)])
    pace, why = uneven_share(placement, 6)
    assert pace == 4.0
    assert "holds 4 streams and the lightest 2" in why


def test_a_worker_without_streams_counts_as_the_lightest():
    placement = {0: "w0", 1: "w0", 2: "w1", 3: "w1"}
    pace, why = uneven_share(placement, 3)
    assert pace == 2.0 and "the lightest 0" in why


def test_more_workers_than_streams_say_how_many_start_and_what_lets_all_work():
    assert idle_workers(8, 8, 8) is None and idle_workers(4, 8, 8) is None
    why = idle_workers(16, 8, 8)
    assert "workers=16 on 8 streams: 8 workers start" in why
    assert "a multiple of 16" in why
    # A host that owns part of the streams says so.
    assert "8 streams (this host's, of 32)" in idle_workers(12, 8, 32)
