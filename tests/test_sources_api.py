"""Pre-tokenized sources (``tokens_column``) and in-memory sources (a pyarrow Table or a dict of
arrays through the Python API): same batches as the text files they stand for."""

from __future__ import annotations

import json

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import assert_resumes_identically, drain, make_texts, next_row, write_parquet

from ingest import BatchDigest, Config, RuntimeOptions, SourceConfig, build_plan
from ingest.errors import BadInputError, ConfigError
from ingest.stream.kinds import open_stream
from ingest.tokenize.tokenizer import load_tokenizer
from jax_side import HostFeed, batch_sharding

FIELDS = dict(seq_len=24, global_batch_size=4, num_streams=2, unit_rows=5, seed=11,
              num_epochs=1)


def _config(source: SourceConfig, **kw) -> Config:
    return Config.from_dict({"sources": [source], **FIELDS, **kw})


def _ids(texts):
    return [list(map(int, e)) for e in load_tokenizer("gpt2").encode_batch(list(texts))]


def _streams(config):
    plan = build_plan(config)
    return [drain(open_stream(config, plan, s), n_rows=3) for s in range(config.num_streams)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def texts():
    return make_texts(40, seed=5, max_words=40)


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_pretokenized_parquet_gives_the_batches_of_its_text(tmp_path, texts, packing):
    text_file = write_parquet(tmp_path / "text.parquet", texts, row_group_size=10)
    tok_file = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"ids": pa.array(_ids(texts), pa.list_(pa.int32()))}), tok_file,
                   row_group_size=10)
    from_text = _streams(_config(SourceConfig(paths=(text_file,)), packing=packing))
    from_ids = _streams(_config(SourceConfig(paths=(str(tok_file),), tokens_column="ids"),
                                packing=packing))
    _assert_same(from_text, from_ids)


def test_pretokenized_jsonl_gives_the_batches_of_its_text(tmp_path, texts):
    text_file = write_parquet(tmp_path / "text.parquet", texts, row_group_size=40)
    jsonl = tmp_path / "tokens.jsonl"
    jsonl.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in _ids(texts)))
    _assert_same(_streams(_config(SourceConfig(paths=(text_file,)))),
                 _streams(_config(SourceConfig(paths=(str(jsonl),), tokens_column="ids"))))


def test_bad_token_ids_error_names_the_row_or_are_skipped_and_counted(tmp_path, texts):
    ids = _ids(texts)
    ids[7] = ids[7][:2] + [50_257] + ids[7][2:]  # GPT-2 has ids 0..50256
    ids[12] = None
    ids[20] = []
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"ids": pa.array(ids, pa.list_(pa.int64()))}), path,
                   row_group_size=40)
    source = SourceConfig(paths=(str(path),), tokens_column="ids")
    with pytest.raises(BadInputError, match=r"row \d+ .*'ids'.*invalid token id") as e:
        _streams(_config(source, shuffle=False, num_streams=1, global_batch_size=2))
    assert e.value.row == 7
    config = _config(source, on_bad_document="skip")
    plan = build_plan(config)
    skipped: dict[str, int] = {}
    for s in range(config.num_streams):
        stream = open_stream(config, plan, s)
        drain(stream, n_rows=4)
        for reason, per_file in stream.get_state()["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + sum(per_file.values())
    assert skipped == {"invalid_token_id": 1, "null_text": 1, "empty_text": 1}


def test_a_text_column_given_as_tokens_column_is_refused(tmp_path, texts):
    path = write_parquet(tmp_path / "text.parquet", texts)
    with pytest.raises(BadInputError, match="tokens_column='text' has type string"):
        build_plan(_config(SourceConfig(paths=(path,), tokens_column="text")))


@pytest.mark.parametrize("as_dict", [False, True])
def test_in_memory_table_gives_the_batches_of_the_same_file(tmp_path, texts, as_dict):
    path = write_parquet(tmp_path / "text.parquet", texts, row_group_size=40)
    table = {"text": texts} if as_dict else pa.table({"text": texts})
    _assert_same(_streams(_config(SourceConfig(paths=(path,)))),
                 _streams(_config(SourceConfig(table=table))))


def test_in_memory_tokens_table_resumes_identically(texts):
    config = _config(SourceConfig(table={"ids": _ids(texts)}, tokens_column="ids"),
                     packing="best_fit")
    plan = build_plan(config)
    run = assert_resumes_identically(lambda: open_stream(config, plan, 1), next_row)
    assert len(run.outputs) > 5


def test_in_memory_table_content_is_in_the_fingerprint(texts):
    a = _config(SourceConfig(table={"text": texts}))
    b = _config(SourceConfig(table={"text": texts[:-1] + ["changed"]}))
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == _config(SourceConfig(table={"text": list(texts)})).fingerprint()
    assert build_plan(a).fingerprint != build_plan(b).fingerprint


def test_in_memory_source_refuses_paths_too_and_bad_tables(tmp_path):
    with pytest.raises(ConfigError, match=r"sources\[0\] has both a table and paths"):
        _config(SourceConfig(paths=("x.parquet",), table={"text": ["a"]}))
    with pytest.raises(ConfigError, match=r"sources\[0\].table must be a pyarrow.Table"):
        _config(SourceConfig(table=[1, 2]))


@pytest.mark.ray
@pytest.mark.multidevice
def test_in_memory_mixture_feeds_a_mesh_on_ray_workers_like_local(ray_cluster, texts):
    other = make_texts(30, seed=9, max_words=60)
    config = Config(sources=(SourceConfig(table={"text": texts}, weight=2.0),
                             SourceConfig(table={"ids": _ids(other)}, tokens_column="ids")),
                    **dict(FIELDS, global_batch_size=8), runtime=RuntimeOptions(chunk_rows=2))
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    digests = {}
    for backend in ("local", "ray"):
        d = BatchDigest()
        with HostFeed(config, sharding=sharding, backend=backend, workers=2,
                      get_timeout_s=60) as feed:
            steps = 0
            for batch in feed:
                d.update({k: np.asarray(v) for k, v in batch.items()})
                steps += 1
        assert steps > 3
        digests[backend] = d.hexdigest()
    assert digests["local"] == digests["ray"]
