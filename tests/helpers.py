"""Shared test helpers: small real corpora on disk, stream drivers and the resume check.

Plain functions (not fixtures) so that any test module can import them; everything writes real
files under a directory the test gives (``tmp_path``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import queue
import random
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from ingest import FIELDS, Config, SourceConfig, Stream, build_plan
from ingest.sources import files as sources
from ingest.tokenize.tokenizer import load_tokenizer

# Ordinary English words, so that the real BPE tokenizers give multi-token documents.
WORDS = (
    "the quick brown fox jumps over lazy dog while a small river runs past old stone bridge "
    "under grey morning sky people walk to market carrying bread apples cheese and fresh fish "
    "children laugh birds sing in tall green trees wind moves slowly across open field near "
    "village where farmers plant wheat corn beans every spring before heavy rain arrives again"
).split()

F = {name: i for i, name in enumerate(FIELDS)}  # field name -> index into Chunk.fields


def make_texts(n: int, seed: int, *, min_words: int = 1, max_words: int = 30,
               tag: str = "") -> list[str]:
    """``n`` distinct documents of random words; each starts with a unique ``tag{i}`` marker."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        out.append(f"Doc{tag}{seed}x{i}: " + " ".join(words) + ".")
    return out


def write_parquet(path, texts: Sequence[Any], *, row_group_size: int | None = None,
                  column: str = "text", type: pa.DataType | None = None,
                  extra_columns: dict[str, Sequence[Any]] | None = None,
                  compression: str = "snappy") -> str:
    """Writes one Parquet file whose column ``column`` holds ``texts``; returns its path."""
    data = {column: pa.array(list(texts), type=type or pa.string())}
    for name, values in (extra_columns or {}).items():
        data[name] = pa.array(list(values))
    pq.write_table(pa.table(data), str(path), row_group_size=row_group_size,
                   compression=compression)
    return str(path)


def write_arrow(path, texts: Sequence[str], *, batch_size: int | None = None,
                column: str = "text", compression: str = "uncompressed") -> str:
    """Writes an Arrow IPC file (Feather v2), one record batch per ``batch_size`` rows, its
    buffers ``compression`` (``uncompressed``, ``zstd`` or ``lz4``)."""
    table = pa.table({column: pa.array(list(texts), type=pa.string())})
    feather.write_feather(table, str(path), compression=compression,
                          chunksize=batch_size or max(1, len(texts)))
    return str(path)


def write_jsonl(path, texts: Sequence[str], *, column: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({column: t, "id": len(t)}) + "\n")
    return str(path)


def write_parquet_corpus(directory, n_files: int, docs_per_file: int, row_group_size: int,
                         seed: int, *, min_words: int = 1, max_words: int = 30
                         ) -> list[list[str]]:
    """Writes ``n_files`` Parquet files ``part-NNNNN.parquet`` into ``directory``.

    Returns:
      The texts of each file, in file (= path) order.
    """
    directory.mkdir(parents=True, exist_ok=True)
    per_file = []
    for i in range(n_files):
        texts = make_texts(docs_per_file, seed * 1000 + i, min_words=min_words,
                           max_words=max_words)
        write_parquet(directory / f"part-{i:05d}.parquet", texts, row_group_size=row_group_size)
        per_file.append(texts)
    return per_file


def forget_decoded() -> None:
    """This process's decoded groups and open files, as in a fresh worker process."""
    with sources._read_lock:
        sources._row_groups.clear()
        sources._row_group_bytes = 0
        sources._spilled.clear()
        for cursor in sources._cursors.values():
            cursor.close()
        sources._cursors.clear()
        for f, _ in sources._open_files.values():
            f.close()
        sources._open_files.clear()


def make_config(paths: Sequence[str], **overrides: Any) -> Config:
    """A small config over one source (``paths``); keyword arguments replace any field."""
    fields: dict[str, Any] = dict(seq_len=16, global_batch_size=2, num_streams=1, unit_rows=4,
                                  packing_bins=3, num_epochs=1, seed=7)
    source_kw = {k: overrides.pop(k) for k in ("text_column", "format") if k in overrides}
    fields.update(overrides)
    return Config.from_dict(
        {"sources": [SourceConfig(paths=tuple(str(p) for p in paths), **source_kw)], **fields})


def tokenize(texts: Sequence[str], tokenizer: str = "gpt2") -> list[list[int]]:
    """Each text's token ids (ordinary text) followed by the end-of-document id."""
    tok = load_tokenizer(tokenizer)
    return [list(map(int, ids)) + [tok.eos_id] for ids in tok.encode_batch(list(texts))]


# -- driving streams ----------------------------------------------------------------------


def next_row(stream: Stream) -> np.ndarray | None:
    """One row (``[6, seq_len]``) or None once the stream is exhausted."""
    chunk = stream.produce(1)
    return chunk.fields[:, 0] if chunk.num_rows else None


def drain(stream: Stream, n_rows: int | Sequence[int] = 1, max_chunks: int = 100_000
          ) -> np.ndarray:
    """All remaining rows as ``[6, n, seq_len]``, asking ``n_rows`` per call (or cycling
    through a sequence of sizes)."""
    sizes = [n_rows] if isinstance(n_rows, int) else list(n_rows)
    parts = []
    for i in range(max_chunks):
        chunk = stream.produce(sizes[i % len(sizes)])
        assert chunk.state_after == stream.get_state()
        if chunk.documents is not None and chunk.num_rows:
            assert len(chunk.documents) == chunk.num_rows
            assert chunk.documents[-1] == chunk.state_after["documents"]
        if chunk.num_rows:
            parts.append(chunk.fields)
        if chunk.exhausted or not chunk.num_rows:
            break
    else:
        raise AssertionError(f"stream did not end within {max_chunks} chunks")
    if not parts:
        return np.zeros((6, 0, stream.config.seq_len), np.int32)
    return np.concatenate(parts, axis=1)


def all_streams(config: Config, plan=None) -> list[np.ndarray]:
    """Every stream of ``config`` drained, in stream id order."""
    plan = plan or build_plan(config)
    return [drain(Stream(config, plan, s), n_rows=4) for s in range(config.num_streams)]


def stream_tokens(fields: np.ndarray) -> list[int]:
    """The token sequence a left-shifted concat stream carries: its non-padding inputs."""
    inputs = fields[F["inputs"]]
    seg = fields[F["inputs_segmentation"]]
    return [int(t) for t in inputs[seg > 0]]


def split_documents(tokens: Sequence[int], eos_id: int) -> list[list[int]]:
    """Cuts a token sequence after every EOS; each piece is one document with its EOS."""
    docs, cur = [], []
    for t in tokens:
        cur.append(int(t))
        if t == eos_id:
            docs.append(cur)
            cur = []
    assert not cur, f"token sequence ends inside a document: {cur[:10]}..."
    return docs


def segments(fields: np.ndarray, field: str = "inputs") -> list[list[int]]:
    """The tokens of every segment of every row, read from ``field`` (``inputs`` for a left
    shift, ``targets`` for a right shift, whose inputs start with EOS)."""
    out = []
    for r in range(fields.shape[1]):
        seg = fields[F["inputs_segmentation"], r]
        for sid in range(1, int(seg.max(initial=0)) + 1):
            out.append([int(t) for t in fields[F[field], r][seg == sid]])
    return out


# -- the resume check ---------------------------------------------------------------------


@dataclasses.dataclass
class ResumeRun:
    """The unbroken run an `assert_resumes_identically` call compared against.

    Attributes:
      outputs: every output, in order.
      states: ``states[i]`` is the state before ``outputs[i]`` (one more: the final state).
    """

    outputs: list[np.ndarray]
    states: list[dict[str, Any]]


def _rest(it, next_output, max_steps: int) -> list[np.ndarray]:
    out = []
    for _ in range(max_steps):
        x = next_output(it)
        if x is None:
            return out
        out.append(x)
    return out


def assert_resumes_identically(make_iterator: Callable[[], Any],
                               next_output: Callable[[Any], np.ndarray | None] = next_row,
                               *, max_steps: int = 10_000) -> ResumeRun:
    """Restores at every step and checks the rest equals the unbroken run's rest.

    Runs ``make_iterator()`` to its end (or ``max_steps`` outputs) saving ``get_state()``
    before each output. Then, for every saved state, restores it (after a JSON round trip) and
    checks that every remaining output matches. Even steps restore into a fresh iterator, odd
    steps into one reused iterator that was just moved elsewhere (so stale caches would show).

    Args:
      make_iterator: builds a fresh iterator with ``get_state()``/``set_state()``.
      next_output: the next output of an iterator, or None at its end.
      max_steps: outputs to compare at most (for endless iterators).

    Returns:
      The unbroken run, for further checks by the caller.
    """
    ref = make_iterator()
    states, outputs = [], []
    for _ in range(max_steps):
        state = ref.get_state()
        assert ref.get_state() == state, "get_state() changed the state"
        states.append(json.loads(json.dumps(state)))
        x = next_output(ref)
        if x is None:
            break
        outputs.append(np.array(x, copy=True))
    else:
        states.append(json.loads(json.dumps(ref.get_state())))
    assert outputs, "the iterator produced nothing"
    reused = make_iterator()
    for i, state in enumerate(states):
        if i % 2:
            # Restore over live caches: move the reused iterator somewhere else first.
            it = reused
            it.set_state(json.loads(json.dumps(states[(7 * i + 3) % len(states)])))
            next_output(it)
        else:
            it = make_iterator()
        it.set_state(json.loads(json.dumps(state)))
        assert it.get_state() == state, f"state restored at step {i} reads back differently"
        rest = _rest(it, next_output, max_steps - i)
        assert len(rest) == len(outputs) - i, (
            f"restored at step {i}: {len(rest)} outputs follow, unbroken run had "
            f"{len(outputs) - i}")
        for j, (got, want) in enumerate(zip(rest, outputs[i:], strict=True)):
            np.testing.assert_array_equal(
                got, want, err_msg=f"restored at step {i}: output {i + j} differs")
    return ResumeRun(outputs=outputs, states=states)


# -- driving a feed -----------------------------------------------------------------------

FEED_DEADLINE_S = 120.0  # generous for 2 CPUs; a healthy drain of a test corpus takes seconds


def drain_feed(feed, max_steps: int = 1000, *, deadline_s: float = FEED_DEADLINE_S
               ) -> list[dict[str, np.ndarray]]:
    """The first ``max_steps`` batches of a feed as numpy, iterated on a helper thread so that
    a hang fails the test with a message; an exception from the feed is re-raised here."""
    out: queue.Queue = queue.Queue()

    def consume():
        try:
            out.put([{k: np.asarray(v) for k, v in b.items()}
                     for b in itertools.islice(feed, max_steps)])
        except BaseException as e:  # noqa: BLE001 -- handed to the test thread
            out.put(e)

    threading.Thread(target=consume, daemon=True).start()
    try:
        got = out.get(timeout=deadline_s)
    except queue.Empty:
        pytest.fail(f"the feed did not finish within {deadline_s:.0f} s")
    if isinstance(got, BaseException):
        raise got
    return got


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for coordinators and clusters the tests start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_resumes_identically_in_chain(make_iterator: Callable[[], Any],
                                        resume_at: Sequence[int],
                                        next_output: Callable[[Any], Any] = next_row,
                                        *, reference: Sequence[Any] | None = None,
                                        max_steps: int = 10_000,
                                        close: Callable[[Any], None] | None = None
                                        ) -> list[Any]:
    """Stops and resumes a run several times in a row and checks every output against the
    unbroken run's.

    The run starts in ``make_iterator()``; at each step of ``resume_at`` its ``get_state()``
    goes through JSON into a fresh iterator, which carries on (so a state saved after a resume
    is resumed again, as a training job restarted twice does). Every output of the chain, to
    the end (or ``max_steps``), must equal the unbroken run's at the same step.

    Args:
      make_iterator: builds a fresh iterator with ``get_state()``/``set_state()``.
      resume_at: the steps to stop and resume at, increasing.
      next_output: the next output of an iterator, or None at its end.
      reference: the unbroken run's outputs (None: run it here).
      max_steps: outputs to compare at most (for endless iterators).
      close: releases an iterator once the chain leaves it (None: nothing to release).

    Returns:
      The unbroken run's outputs.
    """
    assert list(resume_at) == sorted(set(resume_at)), f"resume_at={resume_at} must increase"

    def run(it, n: int) -> list[Any]:
        out = []
        for _ in range(n):
            x = next_output(it)
            if x is None:
                break
            out.append(np.array(x, copy=True))
        return out

    if reference is None:
        it = make_iterator()
        reference = run(it, max_steps)
        if close is not None:
            close(it)
    reference = list(reference)
    assert reference, "the iterator produced nothing"
    got: list[Any] = []
    it = make_iterator()
    for step in resume_at:
        got += run(it, step - len(got))
        state = json.loads(json.dumps(it.get_state()))
        if close is not None:
            close(it)
        it = make_iterator()
        it.set_state(state)
        assert it.get_state() == state, f"state resumed at step {step} reads back differently"
    got += run(it, max_steps - len(got))
    if close is not None:
        close(it)
    for t, (a, b) in enumerate(zip(got, reference, strict=False)):
        np.testing.assert_array_equal(
            a, b, err_msg=f"resumed at steps {list(resume_at)}: step {t} differs")
    assert len(got) == len(reference), (
        f"resumed at steps {list(resume_at)}: {len(got)} outputs, the unbroken run had "
        f"{len(reference)}")
    return reference


# -- Workers that break on purpose (a pool's ``worker_cls``): the product worker has no fault
# hooks. Each factory makes a class of its own, which Ray ships to its workers by value.

def _first_time(flag: str | None) -> bool:
    """True the first time any process asks with ``flag`` (a file path), then never; always
    True without one."""
    import os

    if flag is None:
        return True
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def dying_worker(method: str, flag: str | None, *, name: str | None = None):
    """A worker class whose process SIGKILLs itself on entering ``method`` (``__init__``,
    ``open``, ``produce``, ...), once across all its workers (``flag``: a file path); with
    ``name``, only the worker of that name (``w0``, ``w1``, ... in the order started)."""
    import os
    import signal

    from actors.worker import StreamWorker

    def die_here(self):
        if (name is None or self._name == name) and _first_time(flag):
            os.kill(os.getpid(), signal.SIGKILL)

    class DyingWorker(StreamWorker):
        def __init__(self, config, plan, worker_name, **kw):
            super().__init__(config, plan, worker_name, **kw)
            if method == "__init__":
                die_here(self)

    def wrap(fn):
        def dying(self, *args, **kw):
            die_here(self)
            return fn(self, *args, **kw)
        return dying

    if method != "__init__":
        setattr(DyingWorker, method, wrap(getattr(StreamWorker, method)))
    return DyingWorker


def failing_worker(stream_id: int, at_row: int, flag: str | None = None):
    """A worker class whose produce call of stream ``stream_id`` that would emit row ``at_row``
    fails partway through its chunk with a RuntimeError: once across all its workers
    (``flag``: a file path), or every time (None)."""
    from actors.worker import StreamWorker

    class FailingWorker(StreamWorker):
        def produce(self, s, n_rows):
            stream = self._streams.get(s)
            if s == stream_id and stream is not None:
                done = stream.get_state()["rows_emitted"]
                if done < at_row <= done + n_rows and _first_time(flag):
                    if at_row - done > 1:
                        stream.produce(at_row - done - 1)
                    raise RuntimeError(f"injected error in stream {s} at row {at_row}")
            return super().produce(s, n_rows)

    return FailingWorker


def poisoned_worker(marker: str):
    """A worker class whose process dies (``os._exit``, as a crashing native library does)
    when it tokenizes a document containing ``marker``."""
    import os

    from actors.worker import StreamWorker

    class PoisonedTokenizer:
        def __init__(self, tokenizer):
            self._tok = tokenizer
            self.name, self.eos_id, self.vocab_size = (tokenizer.name, tokenizer.eos_id,
                                                       tokenizer.vocab_size)
            self.bos_id, self.add_bos = tokenizer.bos_id, tokenizer.add_bos
            self.specials_reason = tokenizer.specials_reason

        def encode_batch(self, texts):
            self._check(texts)
            return self._tok.encode_batch(texts)

        def encode_docs(self, texts):
            self._check(texts)
            return self._tok.encode_docs(texts)

        def _check(self, texts):
            if any(marker in t for t in texts):
                os._exit(70)

    class PoisonedWorker(StreamWorker):
        def _tokenizer(self):
            return PoisonedTokenizer(super()._tokenizer())

    return PoisonedWorker


def read_streams(source, streams: Sequence[int], *, before_chunk=None,
                 max_chunks: int = 100_000) -> dict[int, np.ndarray]:
    """Every stream of a chunk source to its end, a chunk of each in turn (as a feed takes
    them): ``{stream: fields [6, rows, seq_len]}``. ``before_chunk(i)`` runs before the i-th."""
    parts: dict[int, list[np.ndarray]] = {s: [] for s in streams}
    open_ = list(streams)
    i = 0
    while open_:
        for s in list(open_):
            if before_chunk is not None:
                before_chunk(i)
            c = source.next_chunk(s)
            parts[s].append(np.asarray(c.fields))
            if c.exhausted:
                open_.remove(s)
            i += 1
            assert i < max_chunks, "the source never ended"
    return {s: np.concatenate(p, axis=1) for s, p in parts.items()}
