"""Large row groups and JSONL files: decoded once per machine, kept on disk, each unit
reads its rows."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random

import numpy as np
import pyarrow as pa
import pytest

from ingest import Stream, build_plan
from ingest.sources import jsonl, spill
from ingest.sources.files import LARGE_GROUP_BYTES, read_texts
from tests.helpers import (
    WORDS,
    drain,
    forget_decoded,
    make_config,
    write_jsonl,
    write_parquet,
)

DOC_CHARS = 4096


def _large_texts(seed: int) -> list[str]:
    """Distinct documents of ``DOC_CHARS`` characters, just over LARGE_GROUP_BYTES in all."""
    rng = random.Random(seed)
    base = " ".join(rng.choice(WORDS) for _ in range(4 * DOC_CHARS))
    n = LARGE_GROUP_BYTES // DOC_CHARS + 200
    return [f"{seed}:{i:06d} " + base[(i * 37) % DOC_CHARS:][:DOC_CHARS] for i in range(n)]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("INGEST_ROW_GROUP_CACHE_GB", raising=False)
    forget_decoded()
    yield tmp_path / "cache" / "row-groups"
    forget_decoded()


@pytest.fixture(scope="module")
def large_file(tmp_path_factory):
    texts = _large_texts(0)
    path = tmp_path_factory.mktemp("large") / "one_group.parquet"
    write_parquet(path, texts, row_group_size=len(texts))
    return str(path), texts


def test_a_large_group_is_decoded_once_and_then_read_from_disk(large_file, cache_dir, tmp_path,
                                                                 caplog):
    path, texts = large_file
    config = make_config([path], unit_rows=256)
    with caplog.at_level(logging.INFO, logger="ingest.plan.build"):
        plan = build_plan(config)
    info = plan.files[0]
    assert info.row_groups == (len(texts),) and info.group_bytes[0] > LARGE_GROUP_BYTES
    assert any("decoded once per machine" in r.getMessage() and path in r.getMessage()
               for r in caplog.records), "the plan names the large row group"
    units = [u for u in plan.units if u.group == 0]
    assert len(units) > 10
    first = units[3]
    arr, _ = read_texts(info, 0, first.row_start, first.row_end, "text")
    assert arr.to_pylist() == texts[first.row_start:first.row_end]
    files = os.listdir(cache_dir)
    assert len(files) == 1 and files[0].endswith(".arrow"), files
    assert os.path.getsize(cache_dir / files[0]) >= LARGE_GROUP_BYTES

    _read_with_the_file_moved_away(info, units, texts, tmp_path)
    assert len(os.listdir(cache_dir)) == 1


def _read_with_the_file_moved_away(info, units, texts, tmp_path) -> None:
    """A fresh process reads every unit from the disk copy: the source file is not opened."""
    forget_decoded()
    moved = str(tmp_path / ("moved" + os.path.splitext(info.path)[1]))
    os.rename(info.path, moved)
    try:
        for u in units:
            arr, _ = read_texts(info, 0, u.row_start, u.row_end, "text")
            assert arr.to_pylist() == texts[u.row_start:u.row_end], (u.row_start, u.row_end)
    finally:
        os.rename(moved, info.path)


def test_streams_give_the_same_rows_with_the_disk_copy_and_without(large_file, cache_dir,
                                                                     monkeypatch):
    path, _ = large_file
    config = make_config([path], unit_rows=512, num_streams=2, global_batch_size=2,
                         seq_len=256)
    plan = build_plan(config)
    with_disk = [drain(Stream(config, plan, s), n_rows=64) for s in range(2)]
    assert len(os.listdir(cache_dir)) == 1

    forget_decoded()
    monkeypatch.setenv("INGEST_ROW_GROUP_CACHE_GB", "0")  # off: decoded for every unit
    without = [drain(Stream(config, plan, s), n_rows=64) for s in range(2)]
    for a, b in zip(with_disk, without, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sum(x.shape[1] for x in without) > 100


def _column(i: int, n: int = 200) -> pa.Table:
    return pa.table({"v": [f"c{i}-{j}" * 8 for j in range(n)]})


def test_the_disk_copies_stay_within_the_budget_least_recently_used_first(cache_dir,
                                                                          monkeypatch):
    size = _column(0).nbytes
    # Room for three columns' files (each a little over its column's bytes), not four.
    monkeypatch.setenv("INGEST_ROW_GROUP_CACHE_GB", str(3.6 * size / 2**30))
    for i in range(3):
        assert spill.spill(("k", i), _column(i)) is not None
        os.utime(spill._path(("k", i)), (1_000 + i, 1_000 + i))  # written in order i
    assert spill.load_spilled(("k", 0), 200) is not None  # used now: the most recent
    assert spill.spill(("k", 3), _column(3)).to_pylist() == _column(3).to_pylist()
    kept = {i for i in range(4) if os.path.exists(spill._path(("k", i)))}
    assert kept == {0, 2, 3}, "the least recently used file (1) goes first"
    total = sum(os.path.getsize(cache_dir / f) for f in os.listdir(cache_dir))
    assert total <= spill.budget_bytes()
    # A column over half the budget is never written.
    assert spill.spill(("big",), _column(9, n=2_000)) is None
    assert not os.path.exists(spill._path(("big",)))


def test_a_damaged_or_mismatched_copy_is_removed_and_the_group_decoded(cache_dir, caplog):
    col = _column(1)
    assert spill.spill(("d",), col) is not None
    path = spill._path(("d",))
    assert spill.load_spilled(("d",), 199) is None, "another row count: not this group's copy"
    assert not os.path.exists(path)
    assert spill.spill(("d",), col) is not None
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with caplog.at_level(logging.WARNING, logger="ingest.sources.spill"):
        assert spill.load_spilled(("d",), 200) is None
    assert not os.path.exists(path)
    assert any("damaged row-group cache file" in r.getMessage() for r in caplog.records)


def test_an_unwritable_cache_folder_falls_back_to_decoding(large_file, tmp_path, monkeypatch,
                                                           caplog):
    path, texts = large_file
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("INGEST_CACHE_DIR", str(blocker))
    forget_decoded()
    try:
        plan = build_plan(make_config([path], unit_rows=256))
        u = plan.units[5]
        with caplog.at_level(logging.WARNING, logger="ingest.sources.spill"):
            arr, _ = read_texts(plan.files[0], 0, u.row_start, u.row_end, "text")
        assert arr.to_pylist() == texts[u.row_start:u.row_end]
        assert any("cannot keep decoded row groups" in r.getMessage() and "INGEST_CACHE_DIR"
                   in r.getMessage() for r in caplog.records)
    finally:
        spill._warned.clear()
        forget_decoded()


def test_a_malformed_budget_is_an_error_at_plan_time(large_file, cache_dir, monkeypatch):
    monkeypatch.setenv("INGEST_ROW_GROUP_CACHE_GB", "lots")
    with pytest.raises(ValueError, match=r"INGEST_ROW_GROUP_CACHE_GB='lots'.*GiB"):
        build_plan(make_config([large_file[0]], unit_rows=256))


def test_a_large_group_past_the_budget_is_a_warning(large_file, cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("INGEST_ROW_GROUP_CACHE_GB", "0.001")
    with caplog.at_level(logging.WARNING, logger="ingest.plan.build"):
        build_plan(make_config([large_file[0]], unit_rows=256))
    assert any("decoded again for each unit" in r.getMessage() and "row_group_size" in
               r.getMessage() and "deal: row_groups" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ingest.plan.build"):  # no disk copies to speak of
        build_plan(make_config([large_file[0]], unit_rows=256, deal="row_groups"))
    assert not any("hold over" in r.getMessage() for r in caplog.records)


def test_a_large_jsonl_group_is_parsed_once_and_then_read_from_disk(cache_dir, tmp_path, caplog,
                                                                    monkeypatch):
    # A JSONL group this large: a file whose lines are longer than jsonl.GROUP_BYTES.
    monkeypatch.setattr(jsonl, "GROUP_BYTES", 1 << 40)
    texts = _large_texts(1)
    path = write_jsonl(tmp_path / "big.jsonl", texts)
    with caplog.at_level(logging.INFO, logger="ingest.plan.build"):
        plan = build_plan(make_config([path], unit_rows=256))
    assert any("JSONL" in r.getMessage() and path in r.getMessage() for r in caplog.records)
    info, units = plan.files[0], plan.units
    arr, bad = read_texts(info, 0, units[2].row_start, units[2].row_end, "text")
    assert arr.to_pylist() == texts[units[2].row_start:units[2].row_end] and bad is None
    assert len(os.listdir(cache_dir)) == 1
    _read_with_the_file_moved_away(info, units, texts, tmp_path)


def _read_in_a_fresh_process(info, start, stop, barrier, out) -> None:
    """A worker process's first read of a unit (spawned: nothing decoded yet)."""
    parsed = []
    real = jsonl.read_table
    jsonl.read_table = lambda *a, **k: parsed.append(1) or real(*a, **k)
    barrier.wait(timeout=60)
    arr, _ = read_texts(info, 0, start, stop, "text")
    out.put((len(parsed), arr.to_pylist()))


def test_processes_that_start_on_one_large_file_at_once_parse_it_once(cache_dir, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(jsonl, "GROUP_BYTES", 1 << 40)  # one JSONL group over the cache limit
    texts = _large_texts(2)
    path = write_jsonl(tmp_path / "big.jsonl", texts)
    plan = build_plan(make_config([path], unit_rows=256))
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    units = plan.units[:2]
    procs = [ctx.Process(target=_read_in_a_fresh_process,
                         args=(plan.files[0], u.row_start, u.row_end, barrier, out))
             for u in units]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=60)  # both read at once
        results = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert sum(n for n, _ in results) == 1, "one process parsed; the other mapped its copy"
    assert sorted(r for _, r in results) == sorted(texts[u.row_start:u.row_end] for u in units)
    assert [f for f in os.listdir(cache_dir) if f.endswith(".arrow")] and len(
        os.listdir(cache_dir)) == 1
