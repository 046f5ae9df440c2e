"""Epochs through the feed: a new shuffle each epoch, packed rows across epoch boundaries,
nothing lost; ``drop_remainder``, ``reset_after_epoch``, ``dataset_size`` and
``iterator_length``.

Runs use the local backend on the 8 forced CPU devices (B=8 rows, S=4 streams of k=2 rows).
A stream's token sequence is read back from the global batches (rows ``[s*k, (s+1)*k)`` of
every step) and cut into documents at each end-of-document id; the unit deal of each epoch
says how many documents of each stream belong to which epoch.
"""

from __future__ import annotations

import itertools
from collections import Counter

import jax
import numpy as np
import pytest
from helpers import drain_feed as drain
from helpers import (
    make_config,
    make_texts,
    split_documents,
    stream_tokens,
    tokenize,
    write_parquet,
    write_parquet_corpus,
)

from ingest import FIELDS, ConfigError, build_plan, step_digest
from ingest.plan.deal import deal_units
from ingest.tokenize.tokenizer import load_tokenizer
from jax_side import HostFeed, batch_sharding
from jax_side.multihost import EndAgreement

SEQ_LEN = 32
FEED = dict(seq_len=SEQ_LEN, global_batch_size=8, num_streams=4, unit_rows=5, chunk_rows=3,
            seed=2)
K = 2
EPOCHS = 3


def stream_block(batches, s: int) -> np.ndarray:
    """Stream s's rows, in order, as ``[6, n, L]`` (padding rows included)."""
    return np.concatenate([np.stack([b[f][s * K:(s + 1) * K] for f in FIELDS])
                           for b in batches], axis=1)


def all_padding(batch) -> np.ndarray:
    return ~batch["inputs_segmentation"].any(axis=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """2 files x 20 documents (row groups of 10, units of 5: 8 units for 4 streams)."""
    d = tmp_path_factory.mktemp("epoch_corpus")
    per_file = write_parquet_corpus(d, n_files=2, docs_per_file=20, row_group_size=10, seed=6)
    return d, [t for texts in per_file for t in texts]


@pytest.fixture(scope="module")
def sharding():
    return batch_sharding(jax.make_mesh((8,), ("data",)), "data")


@pytest.fixture(scope="module")
def three_epochs(corpus, sharding):
    directory, texts = corpus
    config = make_config([directory], num_epochs=EPOCHS, **FEED)
    plan = build_plan(config)
    with HostFeed(config, sharding=sharding, backend="local", plan=plan) as feed:
        estimate = feed.iterator_length
        batches = drain(feed)
        stats = feed.stats()
    return config, plan, texts, batches, stats, estimate


def test_every_epoch_holds_every_document_once_in_a_new_order(three_epochs):
    config, plan, texts, batches, stats, _ = three_epochs
    eos = load_tokenizer(config.tokenizer).eos_id
    want = Counter(map(tuple, tokenize(texts)))
    per_epoch: list[list[tuple[int, ...]]] = [[] for _ in range(EPOCHS)]
    straddling = 0
    for s in range(config.num_streams):
        rows = stream_block(batches, s)
        docs = [tuple(d) for d in split_documents(stream_tokens(rows), eos)]
        counts = [sum(plan.units[u].num_rows for u in deal_units(
            plan, num_streams=config.num_streams, seed=config.seed, epoch=e, shuffle=True)[s])
            for e in range(EPOCHS)]
        assert len(docs) == sum(counts), f"stream {s}: documents lost or added"
        at = 0
        for e, n in enumerate(counts):
            per_epoch[e] += docs[at:at + n]
            at += n
            if e < EPOCHS - 1:
                # The epoch ends inside a full row: packing carried over the boundary.
                end = sum(len(d) for d in docs[:at])
                row = rows[FIELDS.index("inputs_segmentation"), end // SEQ_LEN]
                if end % SEQ_LEN:
                    assert row.all(), f"stream {s}: the row across epoch {e}'s end is padded"
                    straddling += 1
    assert straddling >= 2, "no packed row holds the end of one epoch and the next's start"
    for e, docs in enumerate(per_epoch):
        assert Counter(docs) == want, f"epoch {e} does not hold every document exactly once"
    orders = [tuple(docs) for docs in per_epoch]
    assert len(set(orders)) == EPOCHS, "two epochs read the documents in the same order"
    assert stats["documents"] == EPOCHS * len(texts)


def test_padding_appears_only_after_a_stream_has_ended(three_epochs):
    config, _, _, batches, stats, _ = three_epochs
    for s in range(config.num_streams):
        seg = stream_block(batches, s)[FIELDS.index("inputs_segmentation")]
        real = seg.any(axis=1)
        last = int(np.flatnonzero(real)[-1])
        assert real[:last + 1].all(), f"stream {s} has a padding row before its end"
        assert seg[:last].all(), f"stream {s} has a partial row before its last"
    assert stats["padding_rows"] == sum(int(all_padding(b).sum()) for b in batches)


def test_dataset_size_is_exact_and_iterator_length_is_labelled(three_epochs, corpus, sharding):
    config, plan, texts, batches, stats, estimate = three_epochs
    assert stats["dataset_size"] == len(texts) == plan.total_rows
    # Concat packing needs tokenizing to count rows: an estimate, said so, of the right size.
    assert not estimate.exact and estimate.basis.startswith("estimate: "), estimate
    assert 0.5 * len(batches) <= estimate.steps <= 2 * len(batches), (estimate, len(batches))
    assert stats["iterator_length"] == {"steps": len(batches), "exact": True,
                                        "basis": "this pass has ended"}
    # Mid-run, the estimate uses the rows per byte seen so far.
    with HostFeed(config, sharding=sharding, backend="local", plan=plan) as feed:
        drain(feed, max_steps=len(batches) // 2)
        mid = feed.iterator_length
    assert not mid.exact and "seen in" in mid.basis, mid
    assert abs(mid.steps - len(batches)) <= 0.25 * len(batches), (mid, len(batches))
    endless = config.replace(num_epochs=None)
    with HostFeed(endless, sharding=sharding, backend="local", plan=plan) as feed:
        assert feed.iterator_length.steps is None and feed.iterator_length.exact
        assert feed.dataset_size == len(texts)


def test_iterator_length_is_exact_for_one_row_per_document(corpus, sharding):
    directory, _ = corpus
    config = make_config([directory], num_epochs=2, packing="none", long_documents="truncate",
                         **FEED)
    with HostFeed(config, sharding=sharding, backend="local") as feed:
        before = feed.iterator_length
        batches = drain(feed)
    assert before.exact and before.steps == len(batches), (before, len(batches))


@pytest.fixture(scope="module")
def uneven_corpus(tmp_path_factory):
    """20 documents, the first unit's 5 about ten times longer: its stream runs on for
    several steps after the others end."""
    d = tmp_path_factory.mktemp("uneven_corpus")
    texts = (make_texts(5, seed=11, min_words=150, max_words=200)
             + make_texts(15, seed=12, max_words=20))
    write_parquet(d / "part-0.parquet", texts, row_group_size=10)
    return d, texts


@pytest.mark.parametrize("num_streams, which", [(4, "corpus"), (4, "uneven_corpus"),
                                                (1, "corpus")])
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_drop_remainder_ends_before_the_first_partial_step_and_counts_every_row_left(
        request, sharding, num_streams, which, backend):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    directory, _ = request.getfixturevalue(which)
    config = make_config([directory], num_epochs=2, **dict(FEED, num_streams=num_streams))
    with HostFeed(config, sharding=sharding, backend="local") as feed:
        full = drain(feed)
        everything = feed.stats()
    with HostFeed(config.replace(drop_remainder=True), sharding=sharding,
                  backend=backend) as feed:
        length = feed.iterator_length
        dropped = drain(feed)
        stats = feed.stats()
    partial = [t for t, b in enumerate(full) if all_padding(b).any()
               or not b["inputs_segmentation"].all()]
    first = min(t for t, b in enumerate(full) if all_padding(b).any())
    if num_streams == 1:
        # One stream: only the last step is partial, and it alone is dropped.
        assert first == len(full) - 1 and partial == [first]
    elif which == "uneven_corpus":
        # Steps after the first partial one hold rows too.
        assert len(full) - first > 2, (len(full), first)
    assert [step_digest(b) for b in dropped] == [step_digest(b) for b in full[:first]]
    assert stats["padding_rows"] == 0 and stats["steps"] == first
    # Every real row and token of the streams is delivered or counted as dropped.
    real_rows = [int((~all_padding(b)).sum()) for b in full]
    tokens = [int(np.count_nonzero(b["inputs_segmentation"])) for b in full]
    assert stats["dropped_rows"] == sum(real_rows[first:]) > 0
    assert stats["dropped_tokens"] == sum(tokens[first:])
    delivered_rows = stats["steps"] * config.global_batch_size - stats["padding_rows"]
    assert delivered_rows + stats["dropped_rows"] == sum(real_rows)
    assert stats["tokens"] + stats["dropped_tokens"] == everything["tokens"] == sum(tokens)
    # The streams were read to their end: their documents are all counted.
    assert stats["documents"] == everything["documents"] > 0
    assert not length.exact and "estimate" in length.basis


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_reset_after_epoch_gives_the_same_batches_on_every_pass(request, corpus, sharding,
                                                                  backend):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    directory, _ = corpus
    config = make_config([directory], num_epochs=1, reset_after_epoch=True, **FEED)
    assert "reset_after_epoch" not in config.output_fields()  # batches of a pass unchanged
    with HostFeed(config, sharding=sharding, backend=backend, workers=2) as feed:
        first = [step_digest(b) for b in drain(feed)]
        pool = feed._intake.source
        assert feed.get_state()["step"] == len(first)
        second = [step_digest(b) for b in drain(feed)]
        # A pass broken off mid-way restarts too.
        assert [step_digest(b) for b in drain(feed, max_steps=2)] == first[:2]
        third = [step_digest(b) for b in drain(feed)]
        assert feed.stats()["passes"] == 4
        assert feed.stats()["steps"] == 3 * len(first) + 2
        if backend == "ray":
            assert feed._intake.source is pool, "a new pass should reuse the running workers"
            assert pool.stats().restarts == 0
    assert first == second == third and len(first) > 2
    # Without it, the ended feed stays ended.
    with HostFeed(config.replace(reset_after_epoch=False), sharding=sharding,
                  backend="local") as feed:
        assert [step_digest(b) for b in drain(feed)] == first
        assert drain(feed) == []


def test_reset_after_epoch_needs_one_epoch_and_drop_remainder_a_bool():
    with pytest.raises(ConfigError) as e:
        make_config(["x"], num_epochs=2, reset_after_epoch=True, drop_remainder="yes", **FEED)
    assert any(p.startswith("reset_after_epoch=true") and "num_epochs=1" in p
               for p in e.value.problems), e.value.problems
    assert any(p.startswith("drop_remainder='yes'") for p in e.value.problems)


def test_one_process_agreement_with_drop_remainder_stops_at_the_smallest_claim():
    end = EndAgreement(drop_remainder=True)
    assert end.continues(1, 3) and end.syncs == 1
    assert end.continues(3, 3) and end.syncs == 1  # covered by the claim
    assert not end.continues(4, 3) and end.syncs == 2


# -- two JAX processes agree on the step to drop -------------------------------------------------

CHILD_TIMEOUT_S = 120


def _two_host_config(corpus_dir):
    # B=8 over 2 hosts x 4 devices, S=4: host 0 owns streams 0, 1 and host 1 streams 2, 3.
    return make_config([corpus_dir], num_epochs=1, drop_remainder=True, **FEED)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_hosts_drop_the_same_partial_step_as_one_process(corpus, sharding, tmp_path):
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    directory, _ = corpus
    # In this corpus the first step with padding (step 3, 0-based) pads one row of host 1's
    # half only: host 0 is full there and must still drop it.
    with HostFeed(_two_host_config(directory), sharding=sharding, backend="local") as feed:
        want = [step_digest(b) for b in drain(feed)]
        want_dropped = feed.stats()["dropped_rows"]
    assert want and want_dropped > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]))
    procs = [subprocess.Popen([sys.executable, __file__, "child", str(i), str(port),
                               str(directory), str(tmp_path / f"out{i}.json")], cwd=root,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    errs = []
    for p in procs:
        try:
            errs.append(p.communicate(timeout=CHILD_TIMEOUT_S)[1])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a host did not finish within {CHILD_TIMEOUT_S} s")
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{errs[i][-3000:]}"
    outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    for o in outs:
        assert o["digests"] == want
        assert o["padding_rows"] == 0
        assert 1 <= o["syncs"] < len(want) + 1
    assert sum(o["dropped_rows"] for o in outs) == want_dropped


def _child(pid: str, port: str, corpus_dir: str, out: str) -> None:
    import json

    from jax.experimental import multihost_utils

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=int(pid), initialization_timeout=CHILD_TIMEOUT_S)
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    with HostFeed(_two_host_config(corpus_dir), sharding=sharding, backend="local") as feed:
        digests = [step_digest(multihost_utils.process_allgather(b, tiled=True))
                   for b in itertools.islice(feed, 1000)]
        stats = feed.stats()
        syncs = feed._end.syncs  # the agreement's allgathers (no public counter)
    with open(out, "w") as f:
        json.dump({"digests": digests, "dropped_rows": stats["dropped_rows"],
                   "padding_rows": stats["padding_rows"], "syncs": syncs}, f)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["child"]:
        _child(*sys.argv[2:])
