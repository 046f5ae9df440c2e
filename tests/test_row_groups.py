"""``deal: row_groups``: the units of a row group stay together, and a stream reads them in row
order, each Parquet group decoded once a pass through a cursor (``ingest.sources.files``)."""

from __future__ import annotations

import itertools
import logging
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    all_streams,
    assert_resumes_identically,
    drain,
    forget_decoded,
    make_config,
    split_documents,
    stream_tokens,
    tokenize,
    write_parquet,
    write_parquet_corpus,
)

from ingest import Stream, build_plan
from ingest.config import ConfigError
from ingest.errors import BadInputError
from ingest.plan.deal import deal_units
from ingest.sources import files as sources

EOS = 50256


def _runs_of(plan, units) -> list[tuple[tuple[int, int], list[int]]]:
    """A stream's reading order as (file, group) runs of consecutive units."""
    return [(g, list(us)) for g, us in itertools.groupby(
        units.tolist(), key=lambda u: (plan.units[u].file, plan.units[u].group))]


def test_each_group_is_read_whole_by_one_stream_in_row_order(tmp_path):
    # 12 row groups of 10 rows, 4 units each; 3 streams get 4 groups each.
    write_parquet_corpus(tmp_path, n_files=3, docs_per_file=40, row_group_size=10, seed=2)
    config = make_config([tmp_path], num_streams=3, global_batch_size=3, unit_rows=3)
    plan = build_plan(config)
    assert len(plan.units) == 48
    nbytes = plan.units.nbytes
    deals = []
    for epoch in range(3):
        dealt = deal_units(plan, num_streams=3, seed=config.seed, epoch=epoch, shuffle=True,
                           deal="row_groups")
        assert sorted(np.concatenate(dealt).tolist()) == list(range(48))
        runs = [_runs_of(plan, d) for d in dealt]
        groups = [g for per_stream in runs for g, _ in per_stream]
        assert len(groups) == len(set(groups)) == 12, "a group was split or read twice"
        for per_stream in runs:
            for _, us in per_stream:
                assert us == list(range(us[0], us[0] + 4)), "not the whole group in row order"
        loads = [int(nbytes[d].sum()) for d in dealt]
        assert max(loads) - min(loads) <= 4 * nbytes.max(), loads
        assert [d.tolist() for d in dealt] == [d.tolist() for d in deal_units(
            plan, num_streams=3, seed=config.seed, epoch=epoch, shuffle=True,
            deal="row_groups")]
        deals.append([d.tolist() for d in dealt])
    assert deals[0] != deals[1] != deals[2]
    unshuffled = deal_units(plan, num_streams=3, seed=0, epoch=0, shuffle=False,
                            deal="row_groups")
    assert all(d.tolist() == sorted(d.tolist()) for d in unshuffled)


def test_groups_are_split_into_runs_when_streams_would_go_without(tmp_path):
    write_parquet(tmp_path / "one.parquet", [f"doc {i}" for i in range(40)])  # one group
    config = make_config([tmp_path], num_streams=4, global_batch_size=4, unit_rows=2)
    plan = build_plan(config)
    dealt = deal_units(plan, num_streams=4, seed=0, epoch=0, shuffle=True, deal="row_groups")
    assert all(len(d) for d in dealt), "a stream got no unit"
    for d in dealt:
        # 20 units in runs of 20 / (4 streams x 4 runs) -> 2 units, each read in row order.
        pairs = d.reshape(-1, 2)
        assert (pairs[:, 0] % 2 == 0).all() and (pairs[:, 1] == pairs[:, 0] + 1).all(), pairs


def test_streams_read_every_document_once_an_epoch(tmp_path):
    texts = [t for f in write_parquet_corpus(tmp_path, n_files=3, docs_per_file=30,
                                             row_group_size=12, seed=5, max_words=40)
             for t in f]
    config = make_config([tmp_path], num_streams=3, global_batch_size=3, unit_rows=4,
                         num_epochs=2, deal="row_groups")
    docs = [d for fields in all_streams(config) for d in split_documents(
        stream_tokens(fields), EOS)]
    want = Counter(map(tuple, tokenize(texts)))
    assert Counter(map(tuple, docs)) == want + want


def test_reads_through_a_cursor_give_the_rows_of_whole_group_reads(tmp_path):
    write_parquet(tmp_path / "a.parquet", [f"row {i} " + "x" * (i % 7) for i in range(5000)],
                  row_group_size=2500)
    config = make_config([tmp_path], num_streams=2, global_batch_size=2, unit_rows=300)
    plan = build_plan(config)
    info = plan.files[0]
    forget_decoded()
    for u in plan.units:  # in row order: each read continues the cursor of the one before
        got, _ = sources.read_texts(info, u.group, u.row_start, u.row_end, "text",
                                    sequential=True)
        assert not sources._row_groups, "a cursor read filled the cache of whole groups"
        whole, _ = sources.read_texts(info, u.group, u.row_start, u.row_end, "text")
        forget_decoded()
        assert got.equals(whole), (u.group, u.row_start)
    # Starting mid-group (a resume) skips to the row; a group's last unit closes its cursor.
    u = plan.units[5]
    got, _ = sources.read_texts(info, u.group, u.row_start, u.row_end, "text", sequential=True)
    assert got.to_pylist() == [f"row {i} " + "x" * (i % 7) for i in range(u.row_start,
                                                                            u.row_end)]
    assert list(sources._cursors) == [(info.path, info.size, info.content_key, u.group, "text",
                                       u.row_end)]
    for u in plan.units[6:9]:
        sources.read_texts(info, u.group, u.row_start, u.row_end, "text", sequential=True)
    assert not sources._cursors
    forget_decoded()


def test_each_group_is_decoded_once_a_pass(tmp_path, monkeypatch):
    write_parquet_corpus(tmp_path, n_files=2, docs_per_file=40, row_group_size=10, seed=1)
    opened = []

    class Counted(sources._Cursor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(1)

    monkeypatch.setattr(sources, "_Cursor", Counted)
    forget_decoded()
    config = make_config([tmp_path], num_streams=1, global_batch_size=1, unit_rows=3,
                         num_epochs=2, seq_len=16, deal="row_groups")
    plan = build_plan(config)
    assert len(plan.units) == 32
    drain(Stream(config, plan, 0), n_rows=4)
    assert len(opened) == 8 * 2, "8 groups, 2 epochs"
    forget_decoded()


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_resume_at_every_row_matches_unbroken_stream(tmp_path, packing):
    write_parquet_corpus(tmp_path, n_files=2, docs_per_file=12, row_group_size=6, seed=3,
                         max_words=40)
    config = make_config([tmp_path], num_streams=2, global_batch_size=2, unit_rows=2,
                         seq_len=16, packing=packing, packing_bins=3, num_epochs=2,
                         deal="row_groups")
    plan = build_plan(config)
    run = assert_resumes_identically(lambda: Stream(config, plan, 1))
    assert any(s["epoch"] == 1 for s in run.states[:-1])


@pytest.mark.parametrize("rows", [7, 13])
def test_a_group_that_changed_after_planning_is_an_error(tmp_path, rows):
    path = tmp_path / "a.parquet"
    write_parquet(path, [f"doc {i}" for i in range(10)])
    config = make_config([tmp_path], num_streams=1, global_batch_size=1, unit_rows=3,
                         deal="row_groups")
    plan = build_plan(config)
    pq.write_table(pa.table({"text": [f"new {i}" for i in range(rows)]}), path)
    forget_decoded()
    with pytest.raises(BadInputError, match="changed since") as e:
        for u in plan.units:
            sources.read_texts(plan.files[0], u.group, u.row_start, u.row_end, "text",
                               sequential=True)
    assert e.value.reason == "corrupt_file"
    forget_decoded()


def test_the_plan_suggests_the_row_group_deal_when_split_groups_exceed_a_workers_cache(
        tmp_path, monkeypatch, caplog):
    from ingest.plan import build as plan_module

    write_parquet_corpus(tmp_path, n_files=2, docs_per_file=40, row_group_size=10, seed=4)
    monkeypatch.setattr(plan_module, "LARGE_GROUP_BYTES", 2000)  # a worker keeps 8,000 bytes
    for deal, unit_rows, hinted in (("units", 3, True), ("units", 10, False),
                                    ("row_groups", 3, False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ingest.plan.build"):
            build_plan(make_config([tmp_path], unit_rows=unit_rows, deal=deal))
        assert any("deal: row_groups decodes each group once" in r.getMessage()
                   for r in caplog.records) == hinted, (deal, unit_rows)


def test_config_names_the_deals_and_keeps_old_fingerprints(tmp_path):
    with pytest.raises(ConfigError, match=r"deal='groups' must be one of \['units', "
                                          r"'row_groups'\]"):
        make_config([tmp_path], deal="groups")
    default = make_config([tmp_path])
    assert "deal" not in default.output_fields()  # checkpoints saved before it still match
    assert make_config([tmp_path], deal="row_groups").fingerprint() != default.fingerprint()
