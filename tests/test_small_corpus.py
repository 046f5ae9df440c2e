"""A corpus with fewer units than streams is cut into smaller units, from its metadata only;
plans that already had a unit per stream are unchanged."""

from __future__ import annotations

import hashlib
import json
import logging

import jax
import pytest
from helpers import make_config, make_texts, write_parquet, write_parquet_corpus

from ingest import Config, SourceConfig, build_plan
from ingest.plan.build import _cut_units
from jax_side import HostFeed, batch_sharding


def _default_config(*paths) -> Config:
    """Every field at its default (num_streams 8, unit_rows 256) but the sources."""
    return Config(sources=tuple(SourceConfig(paths=(str(p),)) for p in paths))


@pytest.mark.multidevice
def test_one_small_file_with_default_config_yields_all_its_documents(tmp_path, caplog):
    texts = make_texts(40, seed=5)
    path = write_parquet(tmp_path / "small.parquet", texts)  # one row group of 40 rows
    config = _default_config(path)
    assert config.num_streams == 8 and config.unit_rows == 256
    with caplog.at_level(logging.WARNING, logger="ingest.plan.build"):
        plan = build_plan(config)
    assert len(plan.units) >= config.num_streams
    assert max(plan.units.num_rows) <= 5  # 40 rows over 8 streams
    assert "units of at most 5 rows" in caplog.text and "num_streams=8" in caplog.text
    # Every row of the file is in exactly one unit.
    rows = sorted(r for u in plan.units for r in range(u.row_start, u.row_end))
    assert rows == list(range(40))
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    with HostFeed(config, sharding=batch_sharding(mesh, "data"), backend="local") as feed:
        steps = sum(1 for _ in feed)
        stats = feed.stats()
    assert steps >= 1
    assert stats["documents"] == len(texts)


def test_the_smaller_units_are_the_same_on_every_planning(tmp_path):
    write_parquet(tmp_path / "a.parquet", make_texts(30, seed=1), row_group_size=20)
    write_parquet(tmp_path / "b.parquet", make_texts(9, seed=2))
    config = make_config([tmp_path], num_streams=8, global_batch_size=8, unit_rows=256)
    plans = [build_plan(config) for _ in range(3)]
    assert all(p.units == plans[0].units for p in plans)
    assert len({p.fingerprint for p in plans}) == 1
    # Row groups of 20, 10 and 9 rows: at most 6 rows a unit gives 4 + 2 + 2 units, 7 only 7.
    assert len(plans[0].units) == 8 and max(plans[0].units.num_rows) <= 6
    # The cut is part of the fingerprint: the same files planned with that unit_rows differ.
    explicit = build_plan(make_config([tmp_path], num_streams=8, global_batch_size=8,
                                      unit_rows=6))
    assert explicit.units == plans[0].units
    assert explicit.fingerprint != plans[0].fingerprint


def test_a_plan_with_a_unit_per_stream_is_cut_and_fingerprinted_as_configured(tmp_path):
    write_parquet_corpus(tmp_path / "c", n_files=3, docs_per_file=20, row_group_size=7, seed=3)
    config = make_config([tmp_path / "c"], num_streams=4, global_batch_size=8, unit_rows=5)
    plan = build_plan(config)
    files = list(plan.files)
    assert plan.units == _cut_units(files, [0] * len(files), config.unit_rows)
    blob = json.dumps([[f.path, f.format, f.size, list(f.row_groups), f.content_key]
                       for f in files] + [["text"], config.unit_rows])
    assert plan.fingerprint == hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_a_mixture_source_with_few_units_is_cut_alone(tmp_path):
    write_parquet_corpus(tmp_path / "big", n_files=2, docs_per_file=24, row_group_size=4, seed=1)
    write_parquet(tmp_path / "small.parquet", make_texts(8, seed=9))
    config = Config(sources=(SourceConfig(paths=(str(tmp_path / "big"),), weight=1.0),
                             SourceConfig(paths=(str(tmp_path / "small.parquet"),), weight=1.0)),
                    num_streams=4, global_batch_size=8, unit_rows=4, seq_len=32)
    plan = build_plan(config)
    big = plan.units.source == 0
    assert list(plan.units.num_rows[big]) == [4] * 12  # as configured
    assert sorted(plan.units.num_rows[~big]) == [2, 2, 2, 2]  # 8 rows into 4 units


@pytest.mark.parametrize("docs", [1, 7])
def test_fewer_documents_than_streams_is_refused_naming_both(tmp_path, docs):
    path = write_parquet(tmp_path / "tiny.parquet", make_texts(docs, seed=4))
    with pytest.raises(ValueError, match=rf"num_streams=8: the corpus has {docs} row"):
        build_plan(_default_config(path))
