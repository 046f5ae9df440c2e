"""The unit plan's columns: cutting row groups into units, dealing them, carrying them."""

import heapq
import pickle
import random
import threading

import numpy as np
import pytest

from ingest.plan.build import Unit, UnitPlan, Units, _cut_units
from ingest.plan.deal import deal_units, permutation, philox
from ingest.sources.files import FileInfo


def _info(rows, group_bytes) -> FileInfo:
    return FileInfo(path="f.parquet", format="parquet", size=1, row_groups=tuple(rows),
                    group_bytes=tuple(group_bytes), content_key="k")


def _cut_each_group(infos, sources, unit_rows) -> list[tuple[int, ...]]:
    """The units of each row group cut on its own with np.linspace (the plan's definition)."""
    out = []
    for fi, info in enumerate(infos):
        for g, (rows, nbytes) in enumerate(zip(info.row_groups, info.group_bytes, strict=True)):
            if rows == 0:
                continue
            bounds = np.linspace(0, rows, -(-rows // unit_rows) + 1).round().astype(int)
            out += [(sources[fi], fi, g, int(a), int(b), max(1, nbytes * int(b - a) // rows))
                    for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return out


def _greedy_deal(plan, num_streams, seed, epoch, shuffle, source=None) -> list[list[int]]:
    """Dealing spelled out unit by unit: permute, sort by size class, each unit to the
    lightest stream (ties: lowest id), then each stream's units sorted and permuted."""
    ids = [i for i, u in enumerate(plan.units) if source is None or u.source == source]
    nbytes = np.array([plan.units[i].nbytes for i in ids], np.int64)
    key = () if source is None else (source,)
    order = np.arange(len(ids))
    if shuffle:
        order = philox(seed, epoch, 0x0D3A1, *key).permutation(len(ids))
        size_class = np.floor(np.log2(np.maximum(nbytes[order], 1))).astype(np.int64)
        order = order[np.argsort(-size_class, kind="stable")]
    heap = [(0, s) for s in range(num_streams)]
    dealt: list[list[int]] = [[] for _ in range(num_streams)]
    for u in order.tolist():
        load, s = heapq.heappop(heap)
        dealt[s].append(ids[u])
        heapq.heappush(heap, (load + int(nbytes[u]), s))
    if shuffle:
        dealt = [[d[i] for i in philox(seed, epoch, 0x0D3A2, s, *key).permutation(len(d))]
                 for s, d in enumerate(sorted(d) for d in dealt)]
    return dealt


def test_row_groups_are_cut_as_if_each_were_cut_alone():
    rng = np.random.default_rng(0)
    for _ in range(400):
        unit_rows = int(rng.choice([1, 2, 3, 7, 256, 1000, 4096]))
        infos, sources = [], []
        for _ in range(int(rng.integers(0, 4))):
            rows = [int(rng.choice([0, 1, rng.integers(1, 5000), rng.integers(1, 300 * unit_rows)]))
                    for _ in range(int(rng.integers(0, 5)))]
            infos.append(_info(rows, [int(rng.integers(0, 10**10)) for _ in rows]))
            sources.append(int(rng.integers(0, 3)))
        units = _cut_units(infos, sources, unit_rows)
        assert [tuple(u.__dict__.values()) for u in units] == _cut_each_group(
            infos, sources, unit_rows), (unit_rows, [i.row_groups for i in infos])


@pytest.mark.parametrize("shuffle", [True, False])
def test_deal_is_the_greedy_deal_spelled_out(shuffle):
    rng = np.random.default_rng(1)
    for trial in range(60):
        n = int(rng.integers(1, 400))
        # Byte counts with many ties (a few distinct sizes) or all different.
        nbytes = (rng.choice([1, 2, 100, 4096], n) if trial % 2
                  else rng.integers(1, 10**9, n))
        units = Units(source=rng.integers(0, 3, n), file=np.arange(n), group=np.zeros(n),
                      row_start=np.zeros(n), row_end=np.ones(n), nbytes=nbytes)
        plan = UnitPlan(files=(), text_columns=("text",) * 3, units=units, skipped_files=(),
                        fingerprint="f")
        for num_streams in (1, 3, 16):
            for source in (None, 0, 2):
                got = deal_units(plan, num_streams=num_streams, seed=trial, epoch=trial % 3,
                                 shuffle=shuffle, source=source)
                assert all(d.dtype == np.int64 for d in got)
                assert [d.tolist() for d in got] == _greedy_deal(
                    plan, num_streams, trial, trial % 3, shuffle, source), (trial, num_streams)


def test_units_read_like_a_tuple_of_units_and_pickle_as_six_buffers():
    rows = [(s % 2, s // 3, s % 5, 10 * s, 10 * s + 7, 1000 + s) for s in range(50)]
    units = Units.of(Unit(*r) for r in rows)
    assert len(units) == 50 and list(units) == [Unit(*r) for r in rows]
    assert units[3] == Unit(*rows[3]) and units[-1] == Unit(*rows[-1])
    assert units[np.int64(7)] == Unit(*rows[7])
    assert units[10:13] == tuple(Unit(*r) for r in rows[10:13])
    assert all(type(v) is int for v in units[4].__dict__.values())  # JSON- and key-safe
    assert units.num_rows.tolist() == [7] * 50
    with pytest.raises(IndexError):
        units[50]
    with pytest.raises(ValueError, match="row_end"):
        Units(source=[0], file=[0], group=[0], row_start=[0], row_end=[1, 2], nbytes=[1])

    buffers = []
    blob = pickle.dumps(units, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 6 and len(blob) < 1000  # the columns travel out of band
    again = pickle.loads(blob, buffers=buffers)
    assert again == units and hash(again) == hash(units)
    assert again != Units.of(list(units)[:-1])
    # Columns are read-only: a plan is shared by every stream of a process.
    with pytest.raises(ValueError):
        units.nbytes[0] = 5
    source = np.zeros(3, np.int32)
    Units(source=source, file=[0] * 3, group=[0] * 3, row_start=[0] * 3, row_end=[1] * 3,
          nbytes=[1] * 3)
    source[0] = 1  # the caller's array is copied, not frozen


def test_permutation_is_philox_s_for_every_key_on_every_thread():
    """Units' reading orders and deals come from ``permutation``, one generator per thread set
    to each key's start: the draws of a fresh ``philox(*key)``, whatever was drawn before and
    on other threads at the same time."""
    def check(seed: int, errors: list) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            key = [rng.randrange(2 ** 40) for _ in range(rng.randint(1, 5))]
            n = rng.choice([0, 1, 2, rng.randint(3, 5000)])
            if not np.array_equal(permutation(n, *key), philox(*key).permutation(n)):
                errors.append((key, n))

    errors: list = []
    threads = [threading.Thread(target=check, args=(s, errors)) for s in range(4)]
    for t in threads:
        t.start()
    check(99, errors)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a checking thread did not finish in 60 s"
    assert not errors, errors[:3]
