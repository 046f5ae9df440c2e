"""Mixtures: several weighted sources per stream, proportional in tokens, exact on resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import F, assert_resumes_identically, drain, next_row, write_parquet_corpus

from ingest import Config, SourceConfig, build_plan
from ingest.stream.kinds import Stream, open_stream

SEQ = 32


def _corpora(tmp_path, sizes=((6, 24, 8), (4, 24, 8))):
    """Two sources: short documents (a) and long ones (b)."""
    paths = []
    for name, (files, docs, rg), (lo, hi) in zip("ab", sizes, ((1, 12), (20, 60)), strict=False):
        write_parquet_corpus(tmp_path / name, files, docs, rg, seed=ord(name),
                             min_words=lo, max_words=hi)
        paths.append(str(tmp_path / name))
    return paths


def _config(paths, weights, **kw):
    fields = dict(seq_len=SEQ, global_batch_size=4, num_streams=2, unit_rows=4, seed=3,
                  num_epochs=None)
    fields.update(kw)
    return Config.from_dict({"sources": [SourceConfig(paths=(p,), weight=w)
                                         for p, w in zip(paths, weights, strict=True)],
                             **fields})


def _component_rows(config, plan, stream_id, source, n):
    """The first ``n`` rows component ``source`` of stream ``stream_id`` gives on its own."""
    s = Stream(config, plan, stream_id, source=source)
    return s.produce(n).fields


def _attribute(mixed: np.ndarray, parts: list[np.ndarray]) -> list[int]:
    """Which component each mixed row came from, checking that the mixed rows interleave the
    components' own row sequences in order, none lost or repeated."""
    at = [0] * len(parts)
    out = []
    for r in range(mixed.shape[1]):
        hits = [i for i, p in enumerate(parts)
                if at[i] < p.shape[1] and np.array_equal(mixed[:, r], p[:, at[i]])]
        assert len(hits) == 1, f"row {r} matches components {hits}, expected exactly one"
        out.append(hits[0])
        at[hits[0]] += 1
    return out


@pytest.mark.parametrize("weights", [(3.0, 1.0), (1.0, 4.0)])
def test_mixture_proportions_follow_weights_in_tokens(tmp_path, weights):
    config = _config(_corpora(tmp_path), weights, packing="first_fit", packing_bins=4)
    plan = build_plan(config)
    n = 400
    mixed = open_stream(config, plan, 1).produce(n).fields
    parts = [_component_rows(config, plan, 1, i, n) for i in range(2)]
    owner = np.array(_attribute(mixed, parts))
    tokens = np.count_nonzero(mixed[F["inputs_segmentation"]], axis=1)
    share = [tokens[owner == i].sum() / tokens.sum() for i in range(2)]
    want = [w / sum(weights) for w in weights]
    assert abs(share[0] - want[0]) < 0.01, (share, want)
    # The reported totals are the same attribution.
    state = open_stream(config, plan, 1)
    state.produce(n)
    st = state.get_state()
    assert st["tokens"] == [int(tokens[owner == i].sum()) for i in range(2)]
    assert st["rows"] == [int((owner == i).sum()) for i in range(2)]


# deal: row_groups with 2 units a group: each source's runs dealt on their own.
DEALS = [dict(deal="units"), dict(deal="row_groups", unit_rows=2)]


@pytest.mark.parametrize("deal", DEALS, ids=["units", "row_groups"])
@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_mixture_resumes_identically_at_every_row(tmp_path, packing, deal):
    config = _config(_corpora(tmp_path, ((2, 12, 4), (2, 8, 4))), (2.0, 1.0), num_epochs=1,
                     packing=packing, **deal)
    plan = build_plan(config)
    run = assert_resumes_identically(lambda: open_stream(config, plan, 0), next_row)
    assert len(run.outputs) > 10


@pytest.mark.parametrize("deal", DEALS, ids=["units", "row_groups"])
def test_finite_mixture_emits_every_component_row_once(tmp_path, deal):
    config = _config(_corpora(tmp_path, ((2, 12, 4), (2, 8, 4))), (5.0, 1.0), num_epochs=2,
                     **deal)
    plan = build_plan(config)
    for s in range(config.num_streams):
        mixed = drain(open_stream(config, plan, s), n_rows=[3, 5, 1])
        parts = [drain(Stream(config, plan, s, source=i), n_rows=7) for i in range(2)]
        owner = _attribute(mixed, parts)
        # Every row of both components, once: the heavy one ran out first, then the other
        # went on alone.
        assert [owner.count(i) for i in range(2)] == [p.shape[1] for p in parts]


def _rows_and_documents(stream, sizes):
    fields, documents = [], []
    for i in range(1000):
        chunk = stream.produce(sizes[i % len(sizes)])
        fields.append(chunk.fields)
        documents += chunk.documents.tolist()
        if chunk.exhausted:
            return np.concatenate(fields, axis=1), documents
    raise AssertionError("the stream did not end")


def test_mixture_counts_documents_of_the_component_rows_taken(tmp_path):
    # The components read ahead of the mixture; its documents must count only the component
    # rows it has taken, row by row, and survive a resume mid-chunk.
    config = _config(_corpora(tmp_path, ((2, 12, 4), (2, 8, 4))), (2.0, 1.0), num_epochs=1)
    plan = build_plan(config)
    for s in range(config.num_streams):
        mixed, documents = _rows_and_documents(open_stream(config, plan, s), [3, 5, 1])
        parts = [_rows_and_documents(Stream(config, plan, s, source=i), [7]) for i in range(2)]
        owner = _attribute(mixed, [p for p, _ in parts])
        taken = [0, 0]
        expected = []
        for i in owner:
            taken[i] += 1
            expected.append(sum(parts[j][1][taken[j] - 1] if taken[j] else 0 for j in range(2)))
        assert documents == expected
        assert documents[-1] == parts[0][1][-1] + parts[1][1][-1] > 0
        for stop in (1, 4, 9):
            first = open_stream(config, plan, s)
            first.produce(stop)
            resumed = open_stream(config, plan, s)
            resumed.set_state(json.loads(json.dumps(first.get_state())))
            assert resumed.get_state()["documents"] == expected[stop - 1]
            assert resumed.produce(2).documents.tolist() == expected[stop:stop + 2]


def test_weights_changed_on_resume_keep_every_position(tmp_path):
    paths = _corpora(tmp_path)
    before = _config(paths, (1.0, 1.0))
    after = _config(paths, (9.0, 1.0))
    plan = build_plan(before)
    assert before.fingerprint() == after.fingerprint()  # allowed on resume
    first = open_stream(before, plan, 0)
    head = first.produce(40).fields
    state = json.loads(json.dumps(first.get_state()))
    resumed = open_stream(after, plan, 0)
    resumed.set_state(state)
    tail = resumed.produce(200).fields
    mixed = np.concatenate([head, tail], axis=1)
    parts = [_component_rows(before, plan, 0, i, 240) for i in range(2)]
    owner = np.array(_attribute(mixed, parts))  # nothing repeated or skipped at the switch
    assert abs((owner[:40] == 0).mean() - 0.5) < 0.1
    tokens = np.count_nonzero(tail[F["inputs_segmentation"]], axis=1)
    assert abs(tokens[owner[40:] == 0].sum() / tokens.sum() - 0.9) < 0.02


def test_a_source_with_too_few_units_for_the_streams_is_refused(tmp_path):
    paths = _corpora(tmp_path, ((4, 24, 8), (1, 1, 1)))  # one document for two streams
    with pytest.raises(ValueError, match=r"sources\[1\] has 1 unit\(s\) of 1 row"):
        build_plan(_config(paths, (1.0, 1.0), num_streams=2))


def test_mixed_stream_refuses_a_plain_stream_state(tmp_path):
    paths = _corpora(tmp_path)
    plan = build_plan(_config(paths, (1.0, 1.0)))
    plain = Stream(_config(paths[:1], (1.0,)), build_plan(_config(paths[:1], (1.0,))), 0)
    with pytest.raises(ValueError, match="not a mixture state"):
        open_stream(_config(paths, (1.0, 1.0)), plan, 0).set_state(plain.get_state())


@pytest.mark.ray
@pytest.mark.multidevice
def test_mixture_feed_on_ray_workers_matches_local_and_reports_proportions(ray_cluster,
                                                                           tmp_path):
    import jax

    from ingest import BatchDigest
    from jax_side import HostFeed, batch_sharding

    config = _config(_corpora(tmp_path, ((2, 12, 4), (2, 8, 4))), (3.0, 1.0),
                     global_batch_size=8, num_streams=4, chunk_rows=3, unit_rows=2)
    plan = build_plan(config)
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    digests, stats = {}, {}
    for backend in ("local", "ray"):
        d = BatchDigest()
        with HostFeed(config, sharding=sharding, backend=backend, plan=plan, workers=2,
                      get_timeout_s=60) as feed:
            for _, batch in zip(range(40), feed, strict=False):
                d.update({k: np.asarray(v) for k, v in batch.items()})
            stats[backend] = feed.stats()
        digests[backend] = d.hexdigest()
    assert digests["local"] == digests["ray"]
    st = stats["ray"]
    # Counted as of the last chunk of each stream taken whole: at most a chunk per stream behind.
    lag = config.num_streams * config.runtime.chunk_rows * config.seq_len
    assert st["tokens"] - lag <= sum(st["tokens_by_source"]) <= st["tokens"]
    assert len(st["source_proportions"]) == 2 and abs(st["source_proportions"][0] - 0.75) < 0.05


def test_finite_mixture_final_state_counts_every_document_and_skip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from helpers import make_texts

    paths = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        texts = make_texts(30, seed=ord(name))
        texts[4] = None  # one bad document per source
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}),
                       tmp_path / name / "0.parquet", row_group_size=5)
        paths.append(str(tmp_path / name))
    config = _config(paths, (3.0, 1.0), num_epochs=1, on_bad_document="skip")
    plan = build_plan(config)
    documents = skipped = 0
    for s in range(config.num_streams):
        stream = open_stream(config, plan, s)
        drain(stream, n_rows=3)
        st = stream.get_state()
        documents += st["documents"]
        skipped += sum(n for per_file in st["skipped"].values() for n in per_file.values())
    assert (documents, skipped) == (58, 2)
