"""The evaluation feed: documents, log-likelihood pairs and rolling windows as sorted, padded
global batches (ingest.evaluation.requests + jax_side.eval_feed), with the real GPT-2 tokenizer.

Every request is scored exactly once (rolling windows give back every token of a text once, as
lm-eval-harness's windows do), the loss covers continuations only, padding is marked, rows are
consecutive in the global sorted order, sorting lowers the padding on a skewed length mix, and
2 JAX processes x 4 CPU devices yield the global batches of this process's 8 devices.

Run as a script (``python tests/test_eval_feed.py child ...``) this module is one JAX process
of the two-process test.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import WORDS, free_port, make_texts

from ingest import step_digest
from ingest.errors import ConfigError
from ingest.evaluation.batches import plan_batches
from ingest.evaluation.requests import (
    Document,
    EvalConfig,
    LoglikelihoodPair,
    RollingDocument,
    rolling_windows,
    sum_by_request,
    tokenize_requests,
)
from ingest.stream.chunk_format import FIELDS
from ingest.tokenize.tokenizer import load_tokenizer
from jax_side import batch_sharding
from jax_side.eval_feed import EvalFeed

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 120  # two processes importing JAX and tokenizing take 5-15 s here
HOSTS, DEVICES_PER_HOST = 2, 4
SEQ_LEN, BATCH, MULTIPLE = 64, 8, 16
CONFIG = EvalConfig(tokenizer="gpt2", seq_len=SEQ_LEN, global_batch_size=BATCH,
                    padding_multiple=MULTIPLE)
LONG_PREFIX_WORDS = 120  # far over SEQ_LEN tokens: the prefix must be cut from the left
# Meshes as (shape, axes, batch_axes, seq_axis).
MESHES = {"1d": ((8,), ("data",), "data", None),
          "2d_seq_split": ((4, 2), ("data", "model"), "data", "model")}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def mixed_requests() -> list:
    """Documents (two longer than SEQ_LEN), pairs (one with an empty prefix, one ending in a
    space, one with a prefix too long), rolling documents up to several windows; interleaved."""
    rng = random.Random(11)
    docs = [Document(t) for t in make_texts(24, seed=1, max_words=40)]
    docs += [Document(words(rng, 90)), Document(words(rng, 200))]
    pairs = [LoglikelihoodPair(t, " " + words(rng, rng.randint(1, 4)))
             for t in make_texts(16, seed=2, max_words=25)]
    pairs += [LoglikelihoodPair("", " " + words(rng, 3)),
              LoglikelihoodPair("The answer is ", "yes"),
              LoglikelihoodPair(words(rng, LONG_PREFIX_WORDS), " " + words(rng, 2))]
    rolling = [RollingDocument(words(rng, n)) for n in (1, 5, 10, 40, 63, 64, 65, 130, 260)]
    out = docs + pairs + rolling
    random.Random(5).shuffle(out)
    return out


def mesh_sharding(name: str):
    shape, axes, batch_axes, seq_axis = MESHES[name]
    return batch_sharding(jax.make_mesh(shape, axes), batch_axes, seq_axis)


def to_numpy(batch: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def gather(feed: EvalFeed) -> list[dict[str, np.ndarray]]:
    return [to_numpy(b) for b in feed]


def encode(text: str) -> list[int]:
    return [int(t) for t in load_tokenizer("gpt2").encode_batch([text])[0]]


EOS = 50256


def lm_eval_rolling(tokens: list[int], prefix: int, max_seq_len: int, context_len: int):
    """lm-eval-harness ``get_rolling_token_windows`` followed by ``make_disjoint_window``:
    (context, continuation) pairs; the model reads ``(context + continuation)[:-1]`` and scores
    the last ``len(continuation)`` positions. Written from the harness's definition."""
    if not tokens:
        return []
    pred_len = max_seq_len - context_len + 1
    first = min(max_seq_len, len(tokens))
    windows = [([prefix] + tokens[:first - 1], tokens[:first])]
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, pred_len)
        end = predicted + n
        windows.append((tokens[end - max_seq_len - 1:end - 1], tokens[end - n:end]))
        predicted += n
    return [(a[:len(a) - (len(b) - 1)], b) for a, b in windows]


def lm_eval_pair(prefix: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval-harness ``_encode_pair`` (an empty prefix is the end-of-text id)."""
    spaces = len(prefix) - len(prefix.rstrip())
    if spaces:
        prefix, continuation = prefix[:-spaces], prefix[-spaces:] + continuation
    if not prefix:
        return [EOS], encode(continuation)
    whole, ctx = encode(prefix + continuation), encode(prefix)
    return ctx, whole[len(ctx):]


def rows_of(batches: list[dict[str, np.ndarray]]):
    """Every row of every batch, in global order: (batch, dict of the row's fields)."""
    for b, batch in enumerate(batches):
        for r in range(batch["document_idx"].shape[0]):
            yield b, {k: v[r] for k, v in batch.items()}


def by_request(batches) -> dict[int, dict[int, dict[str, np.ndarray]]]:
    """document_idx -> sequence_idx -> row (fails on a duplicate)."""
    out: dict[int, dict[int, dict[str, np.ndarray]]] = collections.defaultdict(dict)
    for _, row in rows_of(batches):
        d, s = int(row["document_idx"]), int(row["sequence_idx"])
        if d < 0:
            continue
        assert s not in out[d], f"request {d} sequence {s} appears twice"
        out[d][s] = row
    return out


def scored(row) -> tuple[list[int], list[int]]:
    """A row's (inputs, targets) where the loss is taken."""
    mask = row["targets_segmentation"] > 0
    return [int(t) for t in row["inputs"][mask]], [int(t) for t in row["targets"][mask]]


def length(row) -> int:
    return int(np.count_nonzero(row["inputs_segmentation"]))


def padding_fraction(batches) -> float:
    total = sum(b["inputs_segmentation"].size for b in batches)
    return sum(int(np.count_nonzero(b["inputs_segmentation"] == 0)) for b in batches) / total


# -- one process, 8 devices ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def requests():
    return mixed_requests()


@pytest.fixture(scope="module")
def fed(requests):
    feed = EvalFeed(requests, CONFIG, sharding=mesh_sharding("1d"))
    return feed, gather(feed)


@pytest.mark.multidevice
def test_every_request_is_scored_exactly_once_and_padding_rows_are_marked(requests, fed):
    feed, batches = fed
    rows = by_request(batches)
    assert sorted(rows) == list(range(len(requests)))
    for i, req in enumerate(requests):
        if isinstance(req, Document):
            want = math.ceil(len(encode(req.text)) / SEQ_LEN)  # len(ids) + EOS - 1 pairs
        elif isinstance(req, RollingDocument):
            want = len(lm_eval_rolling(encode(req.text), EOS, SEQ_LEN, 1))
        else:
            want = 1
        assert sorted(rows[i]) == list(range(want)), f"request {i} ({type(req).__name__})"
    assert max(len(v) for v in rows.values()) >= 5  # some requests really span many rows

    n_rows = sum(len(v) for v in rows.values())
    stats = feed.stats()
    assert len(batches) == len(feed) == stats["batches"] == math.ceil(n_rows / BATCH)
    assert stats["rows"] == n_rows and stats["requests"] == len(requests)
    pad = [(b, row) for b, row in rows_of(batches) if row["document_idx"] < 0]
    assert len(pad) == stats["padding_rows"] == len(batches) * BATCH - n_rows > 0
    for b, row in pad:
        assert b == len(batches) - 1, "only the last batch is padded"
        assert row["sequence_idx"] == -1
        assert all(not row[f].any() for f in FIELDS), "an empty row is all zero"
    for _, row in rows_of(batches):
        if row["document_idx"] >= 0:
            assert length(row) >= 1 and row["targets_segmentation"].any()

    # Per-row scores map back to requests: the loss tokens of each request.
    per_row = np.concatenate([(b["targets_segmentation"] > 0).sum(axis=1) for b in batches])
    idx = np.concatenate([b["document_idx"] for b in batches])
    totals = sum_by_request(idx, per_row, len(requests))
    for i, req in enumerate(requests):
        if isinstance(req, LoglikelihoodPair):
            want = len(lm_eval_pair(req.prefix, req.continuation)[1])
        else:
            want = len(encode(req.text))
        assert totals[i] == want, f"request {i} ({type(req).__name__})"
    assert stats["loss_tokens"] == totals.sum()


@pytest.mark.multidevice
def test_rows_are_consecutive_in_the_global_sorted_order(fed):
    _, batches = fed
    keys = [(-length(row), int(row["document_idx"]), int(row["sequence_idx"]))
            for _, row in rows_of(batches) if row["document_idx"] >= 0]
    assert keys == sorted(keys), "longest first, ties by request then sequence index"
    assert len({k[0] for k in keys}) > 10  # a real spread of lengths, not one size
    for b, batch in enumerate(batches):
        width = batch["inputs"].shape[1]
        longest = int(batch["inputs_segmentation"].sum(axis=1).max())
        assert width % MULTIPLE == 0 and longest <= width < longest + MULTIPLE, (b, width)
        assert all(batch[f].shape == (BATCH, width) for f in FIELDS)
    assert batches[0]["inputs"].shape[1] == SEQ_LEN
    assert len({b["inputs"].shape[1] for b in batches}) >= 3
    for _, row in rows_of(batches):
        n = length(row)
        # One segment per row, from column 0; positions count from 0 along it.
        np.testing.assert_array_equal(row["inputs_segmentation"][:n], 1)
        np.testing.assert_array_equal(row["inputs_position"][:n], np.arange(n))
        np.testing.assert_array_equal(row["targets_position"], row["inputs_position"])
        assert not row["inputs"][n:].any() and not row["targets"][n:].any()
        assert not (row["targets_segmentation"] & ~row["inputs_segmentation"]).any()


@pytest.mark.multidevice
def test_documents_are_scored_as_training_sees_them(requests, fed):
    rows = by_request(fed[1])
    for i, req in enumerate(requests):
        if not isinstance(req, Document):
            continue
        toks = encode(req.text) + [EOS]
        inputs, targets = [], []
        for s in sorted(rows[i]):
            x, y = scored(rows[i][s])
            assert len(x) == length(rows[i][s]), "every target of a document is scored"
            inputs += x
            targets += y
        assert inputs == toks[:-1] and targets == toks[1:], f"request {i}"


@pytest.mark.multidevice
def test_rolling_windows_match_lm_eval_harness_and_predict_every_token_once(requests, fed):
    rows = by_request(fed[1])
    seen = 0
    for i, req in enumerate(requests):
        if not isinstance(req, RollingDocument):
            continue
        toks = encode(req.text)
        windows = lm_eval_rolling(toks, EOS, SEQ_LEN, 1)
        predicted = []
        for s, (context, continuation) in enumerate(windows):
            row = rows[i][s]
            n = length(row)
            assert [int(t) for t in row["inputs"][:n]] == (context + continuation)[:-1]
            _, y = scored(row)
            assert y == continuation, f"request {i} window {s}"
            predicted += y
        assert predicted == toks, f"request {i}: not every token predicted exactly once"
        seen += len(windows) > 2
    assert seen >= 2  # documents of three and more windows were checked


@pytest.mark.parametrize("context", [1, 3, 10])
def test_rolling_windows_equal_the_harness_windows(context):
    # lm-eval-harness's own test case: 34 tokens, max_seq_len=10, context_len=1.
    tokens = list(range(34))
    if context == 1:
        last_input = [23, 24, 25, 26, 27, 28, 29, 30, 31, 32]
        got = rolling_windows(np.array(tokens, np.int32), prefix_id=-100, seq_len=10)
        assert [list(map(int, w[:-1])) for w, _ in got][-1] == last_input
        assert [list(map(int, w[1 + start:])) for w, start in got][-1] == [30, 31, 32, 33]
    got = rolling_windows(np.array(tokens, np.int32), prefix_id=-100, seq_len=10,
                          context=context)
    want = lm_eval_rolling(tokens, -100, 10, context)
    assert len(got) == len(want)
    for (w, start), (ctx, cont) in zip(got, want, strict=True):
        assert list(map(int, w)) == ctx + cont and len(w) - 1 - start == len(cont)
        assert len(w) - 1 <= 10


@pytest.mark.multidevice
def test_loglikelihood_loss_covers_only_the_continuation(requests, fed):
    feed, batches = fed
    rows = by_request(batches)
    truncated = []
    for i, req in enumerate(requests):
        if not isinstance(req, LoglikelihoodPair):
            continue
        prefix, continuation = lm_eval_pair(req.prefix, req.continuation)
        row = rows[i][0]
        n = length(row)
        whole = prefix + continuation
        cut = max(0, len(whole) - (SEQ_LEN + 1))
        assert [int(t) for t in row["inputs"][:n]] == whole[cut:-1]
        x, y = scored(row)
        assert y == continuation, f"request {i}: loss must cover exactly the continuation"
        assert x == whole[-len(continuation) - 1:-1]
        loss_cols = np.flatnonzero(row["targets_segmentation"])
        np.testing.assert_array_equal(loss_cols, np.arange(n - len(continuation), n))
        if cut:
            truncated.append(cut)
            assert n == SEQ_LEN
    assert len(truncated) == 1, "only the long prefix is cut"
    stats = feed.stats()
    assert stats["truncated_prefixes"] == 1 and stats["truncated_prefix_tokens"] == truncated[0]
    # The empty prefix is the end-of-text id; the prefix's trailing space went to the
    # continuation.
    empty = next(i for i, r in enumerate(requests)
                 if isinstance(r, LoglikelihoodPair) and r.prefix == "")
    assert int(rows[empty][0]["inputs"][0]) == EOS
    answer = rows[requests.index(LoglikelihoodPair("The answer is ", "yes"))][0]
    assert scored(answer)[1] == encode(" yes")


def skewed_requests() -> list[Document]:
    """90% short documents, 10% long ones, in random order: almost every unsorted batch holds
    a long one."""
    rng = random.Random(3)
    out = [Document(words(rng, rng.randint(150, 220) if rng.random() < 0.1
                          else rng.randint(5, 40))) for _ in range(200)]
    return out


@pytest.mark.multidevice
def test_sorting_lowers_the_padding_fraction_on_a_skewed_length_mix():
    reqs = skewed_requests()
    config = EvalConfig(tokenizer="gpt2", seq_len=256, global_batch_size=8,
                        padding_multiple=8)
    feeds = {sort: EvalFeed(reqs, dataclasses.replace(config, sort_by_length=sort),
                            sharding=mesh_sharding("1d")) for sort in (True, False)}
    measured = {sort: padding_fraction(gather(f)) for sort, f in feeds.items()}
    stats = feeds[True].stats()
    print(f"\npadding fraction: sorted {measured[True]:.3f}, unsorted {measured[False]:.3f}")
    assert stats["padding_fraction"] == pytest.approx(measured[True], abs=1e-12)
    assert stats["unsorted_padding_fraction"] == pytest.approx(measured[False], abs=1e-12)
    assert feeds[False].stats()["padding_fraction"] == pytest.approx(measured[False])
    assert measured[False] > 0.5 and measured[True] < measured[False] / 3
    # The same requests are scored either way.
    assert stats["rows"] == feeds[False].stats()["rows"] and stats["padding_rows"] == 0


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    (dict(seq_len=64, padding_multiple=24),
     "padding_multiple=24 does not divide seq_len=64; choose a padding_multiple dividing 64"),
    (dict(global_batch_size=0), "global_batch_size=0 must be a positive integer"),
    (dict(seq_len=8, padding_multiple=8, rolling_context=9), "rolling_context=9 exceeds"),
])
def test_bad_config_is_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match="EvalConfig") as e:
        EvalConfig(**fields)
    assert message in str(e.value)


@pytest.mark.parametrize("reqs, error, message", [
    ([Document("fine"), Document(""), RollingDocument("")], ValueError,
     "2 request(s) cannot be scored: requests[1]: empty text (nothing to score); requests[2]"),
    ([LoglikelihoodPair("a", "")], ValueError, "requests[0]: empty continuation"),
    ([LoglikelihoodPair("a", " b" * 70)], ValueError,
     "requests[0]: 70 continuation tokens > seq_len=64"),
    ([Document("a"), "just a string"], TypeError, "requests[1] is a str"),
])
def test_requests_that_cannot_be_scored_are_refused_by_index(reqs, error, message):
    with pytest.raises(error) as e:
        tokenize_requests(reqs, CONFIG)
    assert message in str(e.value)


@pytest.mark.multidevice
def test_sharding_that_does_not_fit_the_batch_is_refused():
    with pytest.raises(ValueError, match=r"global_batch_size=6 is not divisible by the 8"):
        EvalFeed([Document("a")], EvalConfig(seq_len=64, global_batch_size=6,
                                             padding_multiple=16),
                 sharding=mesh_sharding("1d"))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"padding_multiple=2 is not divisible by the 4 shards"):
        EvalFeed([Document("a")], EvalConfig(seq_len=64, global_batch_size=8,
                                             padding_multiple=2),
                 sharding=batch_sharding(mesh, "data", "model"))


def test_plan_is_deterministic_and_stable_on_ties():
    # Equal-length requests keep their request order.
    reqs = [Document("same length text")] * 5 + [Document("a longer text than the others")]
    plan = plan_batches(tokenize_requests(reqs, CONFIG), CONFIG)
    assert [int(i) for i in plan.order] == [5, 0, 1, 2, 3, 4]
    again = plan_batches(tokenize_requests(reqs, CONFIG), CONFIG)
    np.testing.assert_array_equal(plan.order, again.order)


# -- two processes x 4 devices == one process x 8 devices --------------------------------------


def one_process_digests(mesh: str) -> list[str]:
    return [step_digest(b) for b in gather(EvalFeed(mixed_requests(), CONFIG,
                                                    sharding=mesh_sharding(mesh)))]


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.multiprocess
def test_two_processes_yield_the_one_process_global_batches(tmp_path):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_HOST}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    port = str(free_port())
    procs = []
    for i in range(HOSTS):
        with open(tmp_path / f"err{i}.txt", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "child", str(i), port, str(tmp_path / f"out{i}.json")],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err))
    want = {mesh: one_process_digests(mesh) for mesh in MESHES}  # meanwhile, here
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait()
            raise AssertionError("processes still running after "
                                 f"{CHILD_TIMEOUT_S} s:\n" + "\n".join(
                                     (tmp_path / f"err{i}.txt").read_text()[-2000:]
                                     for i in range(HOSTS))) from None
    for i, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"err{i}.txt").read_text()[-4000:]
    outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(HOSTS)]
    assert [o["rows"] for o in outs] == [[0, 4], [4, 8]]
    for mesh in MESHES:
        assert len(want[mesh]) > 5
        for i, o in enumerate(outs):
            assert o["digests"][mesh] == want[mesh], f"process {i}, mesh {mesh}"
    assert outs[0]["stats"] == outs[1]["stats"]


def _child(i: int, port: str, out: str) -> None:
    from jax_side.multihost import global_batch

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=HOSTS,
                               process_id=i)
    digests, stats, rows = {}, None, None
    for mesh in MESHES:
        feed = EvalFeed(mixed_requests(), CONFIG, sharding=mesh_sharding(mesh))
        digests[mesh] = [step_digest(global_batch(b, step)) for step, b in enumerate(feed)]
        stats, rows = feed.stats(), feed.rows
    stats.pop("prepare_s")
    stats.pop("host_rows")
    Path(out).write_text(json.dumps({"digests": digests, "stats": stats, "rows": list(rows)}))


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(int(sys.argv[2]), sys.argv[3], sys.argv[4])
