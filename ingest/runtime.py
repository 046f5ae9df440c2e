"""How the feed runs, apart from what it feeds: the runtime options and their resolution.

``RuntimeOptions`` (``Config.runtime``) holds what may change between two runs of one config
without changing a batch: the worker count, chunk sizing, requests in flight, the object-store
budget, autoscale, worker pinning and prefaulting, the library that runs the tokenizer, and
whether a finished pass restarts. It never enters the config's fingerprint, so a checkpoint
restores under other runtime options. In YAML these fields sit flat beside the others.

``chunk_rows``, ``streams_per_call`` and ``prefetch`` default to null (automatic).
``resolve_runtime(config)`` chooses them from ``seq_len``, ``num_streams``, ``workers`` and
``object_store_budget_mb`` by the rule below and says why; the pool, the host feed, the local
source and the memory check call it where they need the values. A value given is kept::

    chunk_rows       = max(1, min(max(CHUNK_TOKENS, CALL_TOKENS // streams_per_call) // seq_len,
                                  budget // (num_streams x (prefetch + 1) x bytes a row)))
    streams_per_call = num_streams // workers            (a worker's share, at least 1)
    prefetch         = AUTO_PREFETCH
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from ingest.errors import ConfigError
from ingest.stream.chunk_format import chunk_token_bytes

__all__ = ["AUTO_FIELDS", "TOKENIZER_BACKENDS", "ResolvedRuntime", "RuntimeOptions",
           "resolve_runtime", "streams_per_call_for"]

log = logging.getLogger("ingest.runtime")

# The rule for options left null. One actor call makes about CALL_TOKENS tokens, split over
# the streams it serves (``streams_per_call``), and each chunk at least CHUNK_TOKENS (128 rows
# of 1024): a worker, Ray's raylet and the host spend a fixed cost per call and per chunk,
# which larger ones spread over more tokens, while a worker's first call, which the first batch
# waits for, stays as long whatever the number of workers. AUTO_PREFETCH requests in flight per
# stream keep a consumer from waiting at the step where every stream finishes its chunk.
# Without object_store_budget_mb, chunks are sized to keep num_streams x (prefetch + 1) chunks
# within AUTO_BUDGET_MB.
CALL_TOKENS = 1 << 20
CHUNK_TOKENS = 1 << 17
AUTO_PREFETCH = 2
AUTO_BUDGET_MB = 1024
AUTO_FIELDS = ("chunk_rows", "streams_per_call", "prefetch")

# The names ``tokenizer_backend`` takes, fastest backend first after the reference. The
# backends themselves (``ingest.tokenize.bpe_backend``) are loaded when the tokenizer is built, which
# also checks that the one named is installed and proven on the vocabulary.
TOKENIZER_BACKENDS = ("auto", "tiktoken", "toktok", "tuetoken", "rs_bpe", "bpe_openai",
                      "riptoken")

_LOGGED: set[str] = set()  # resolved choices already logged by this process


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """How to run the feed; none of it changes a batch (``Config.runtime``).

    Null means automatic: ``resolve_runtime`` chooses the value where it is used.

    Attributes:
      workers: Ray worker actors (one CPU each).
      chunk_rows: rows per stream per actor call. Null (default): about 1M tokens a call
        over its ``streams_per_call`` streams, at least 128k tokens a chunk
        (``max(131072, 1048576 // streams_per_call) // seq_len`` rows, at least 1), fewer where
        ``num_streams x (prefetch + 1)`` chunks would exceed ``object_store_budget_mb`` (1024
        MB without one). Where this process makes the chunks itself (the local backend), an
        automatic value keeps to 128k tokens (``ResolvedRuntime.in_process_chunk_rows``).
      streams_per_call: streams of one worker whose next chunks one actor call makes and
        returns as one object (fewer calls and objects; the chunks are the same). Null
        (default): a worker's share of the host's streams.
      prefetch: chunk requests in flight per stream. Null (default): 2.
      object_store_budget_mb: the most object-store memory a host's chunks may hold (requests in
        flight plus the chunk being read, per owned stream); lowers the requests in flight to
        fit. Null: ``prefetch`` alone bounds it.
      autoscale: grow the pool while the host waits for chunks and shrink it while chunks sit
        unused, within ``min_workers``/``max_workers`` (``workers`` is the start).
      min_workers, max_workers: autoscale bounds; null max means one worker per owned stream.
      autoscale_window_s: seconds between autoscale decisions.
      pin_workers: each worker binds itself to a CPU that no other ingest worker on its node
        holds (none free: it floats).
      prefault_object_store: each worker maps the first pages of Ray's object store (1.25 x
        the feed's bound on chunk bytes, at most 1 GiB and half the store) into its page
        tables when it starts, so that storing chunks there takes no page faults.
      tokenizer_backend: the library that runs the tokenizer: ``auto`` (the fastest one
        proven to give the reference's ids for this vocabulary, else the reference),
        ``tiktoken`` (the reference: tiktoken, or HF tokenizers for a ``tokenizer.json``),
        ``toktok``, ``rs_bpe`` or ``bpe_openai`` (cl100k only), ``tuetoken`` (gpt2 and the
        ``tokenizer.json`` files of proven families) or ``riptoken`` (gpt2 only; see
        ``ingest.tokenize.bpe_backend``). The ids are the same with every backend.
      reset_after_epoch: with ``num_epochs: 1``, iterating the feed again (a new ``for`` loop)
        after it delivered a batch restarts it from the beginning (validation feeds). The
        batches of a pass are the same either way.
    """

    workers: int = 2
    chunk_rows: int | None = None
    streams_per_call: int | None = None
    prefetch: int | None = None
    object_store_budget_mb: float | None = None
    autoscale: bool = False
    min_workers: int = 1
    max_workers: int | None = None
    autoscale_window_s: float = 2.0
    pin_workers: bool = True
    prefault_object_store: bool = True
    tokenizer_backend: str = "auto"
    reset_after_epoch: bool = False

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    def problems(self) -> list[str]:
        """Every problem of these fields, each naming the field as YAML writes it."""
        problems = [p for p in (_positive_int("workers", self.workers),
                                *(_positive_int(n, getattr(self, n), allow_none=True)
                                  for n in AUTO_FIELDS)) if p]
        if self.tokenizer_backend not in TOKENIZER_BACKENDS:
            problems.append(f"tokenizer_backend={self.tokenizer_backend!r} must be one of "
                            f"{list(TOKENIZER_BACKENDS)}")
        low = _positive_int("min_workers", self.min_workers)
        high = _positive_int("max_workers", self.max_workers, allow_none=True)
        problems += [p for p in (low, high) if p]
        if not low and not high and self.max_workers is not None and (
                self.max_workers < self.min_workers):
            problems.append(f"max_workers={self.max_workers} is below "
                            f"min_workers={self.min_workers}")
        for name in ("autoscale", "pin_workers", "prefault_object_store", "reset_after_epoch"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        w = self.autoscale_window_s
        if isinstance(w, bool) or not isinstance(w, int | float) or w <= 0:
            problems.append(f"autoscale_window_s={w!r} must be a number of seconds > 0")
        b = self.object_store_budget_mb
        if b is not None and (isinstance(b, bool) or not isinstance(b, int | float) or b <= 0):
            problems.append(f"object_store_budget_mb={b!r} must be a number > 0 or null")
        return problems


def _positive_int(name: str, value: Any, allow_none: bool = False) -> str | None:
    """The problem of a field that must be a positive integer (or null), or None."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return f"{name}={value!r} must be a positive integer" + (" or null" if allow_none
                                                                 else "")
    return None


RUNTIME_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(RuntimeOptions))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedRuntime:
    """One config's runtime options with every automatic value chosen (``resolve_runtime``).

    Attributes:
      options: the options as given (``Config.runtime``).
      seq_len: the config's, which sizes a chunk in bytes.
      num_streams: the config's.
      chunk_rows: rows per stream per actor call.
      streams_per_call: as given, or streams one call makes chunks of for ``num_streams``
        streams on ``options.workers`` workers (a pool takes its host's share:
        ``streams_per_call_on``).
      prefetch: chunk requests in flight per stream, before ``object_store_budget_mb``
        lowers them (``requests_in_flight``).
      reasons: for each of ``AUTO_FIELDS`` left null, why it has its value.
    """

    options: RuntimeOptions
    seq_len: int
    num_streams: int
    chunk_rows: int
    streams_per_call: int
    prefetch: int
    reasons: Mapping[str, str]

    def is_auto(self, name: str) -> bool:
        """Whether ``name`` (one of ``AUTO_FIELDS``) was left null and chosen by the rule."""
        return name in self.reasons

    def choices(self) -> str:
        """The resolved values, each automatic one with its reason (one line)."""
        return ", ".join(f"{n}={getattr(self, n)}"
                         + (f" ({self.reasons[n]})" if n in self.reasons else " (explicit)")
                         for n in AUTO_FIELDS)

    def log_choices(self) -> None:
        """Logs ``choices`` at INFO, once per process for each distinct line."""
        line = self.choices()
        if line not in _LOGGED:
            _LOGGED.add(line)
            log.info("runtime knobs: %s", line)

    def streams_per_call_on(self, owned_streams: int, workers: int) -> int:
        """The ``streams_per_call`` a pool of ``workers`` uses for ``owned_streams`` streams:
        ``streams_per_call_for`` with the value given, or none where it was left null."""
        return streams_per_call_for(owned_streams, workers, self.options.streams_per_call)

    @property
    def in_process_chunk_rows(self) -> int:
        """Rows per chunk where this process makes a stream's chunks itself (the local
        backend): there is no call to spread a cost over, and the first batch waits for every
        stream's first chunk, so an automatic ``chunk_rows`` keeps to about 128k tokens. An
        explicit one is kept as given."""
        if not self.is_auto("chunk_rows"):
            return self.chunk_rows
        return min(self.chunk_rows, max(1, CHUNK_TOKENS // self.seq_len))

    @property
    def chunk_bytes(self) -> int:
        """Object-store bytes of one chunk: ``chunk_rows x seq_len`` tokens of
        ``ingest.stream.chunk_format.chunk_token_bytes`` each."""
        return chunk_token_bytes(self.seq_len) * self.chunk_rows * self.seq_len

    def requests_in_flight(self, owned_streams: int) -> int:
        """Chunk requests each stream may have in flight under ``object_store_budget_mb``.

        Raises:
          ValueError: the budget holds less than two chunks per owned stream.
        """
        budget_mb = self.options.object_store_budget_mb
        if budget_mb is None:
            return self.prefetch
        # One chunk per stream is being read by the host; the rest of the budget is in flight.
        depth = int(budget_mb * 2**20 // (owned_streams * self.chunk_bytes)) - 1
        if depth < 1:
            need = 2 * owned_streams * self.chunk_bytes / 2**20
            raise ValueError(
                f"object_store_budget_mb={budget_mb} is below the "
                f"{need:.1f} MB that {owned_streams} streams need (one chunk being read and one "
                f"in flight each, chunk_rows={self.chunk_rows} x seq_len={self.seq_len} x "
                f"{chunk_token_bytes(self.seq_len)} bytes a token); raise it or lower "
                f"chunk_rows")
        return min(self.prefetch, depth)


class _RunConfig(Protocol):
    """What resolving reads of an ``ingest.config.Config`` (which imports this module)."""

    runtime: RuntimeOptions
    seq_len: int
    num_streams: int


def resolve_runtime(config: _RunConfig) -> ResolvedRuntime:
    """``config.runtime`` with ``chunk_rows``, ``streams_per_call`` and ``prefetch`` chosen
    by the rule of this module where they were left null, each with its reason."""
    opts, seq_len, streams = config.runtime, config.seq_len, config.num_streams
    reasons: dict[str, str] = {}
    prefetch = opts.prefetch
    if prefetch is None:
        prefetch = AUTO_PREFETCH
        reasons["prefetch"] = "auto: two requests in flight per stream"
    # The streams one call serves: the value given (capped at a worker's share) or the
    # share itself, which is also the automatic streams_per_call.
    share = streams_per_call_for(streams, opts.workers, opts.streams_per_call)
    chunk_rows = opts.chunk_rows
    if chunk_rows is None:
        tokens = max(CHUNK_TOKENS, CALL_TOKENS // share)
        target = max(1, tokens // seq_len)
        budget = (opts.object_store_budget_mb if opts.object_store_budget_mb is not None
                  else AUTO_BUDGET_MB)
        row_bytes = chunk_token_bytes(seq_len) * seq_len
        fit = int(budget * 2**20 // (streams * (prefetch + 1) * row_bytes))
        chunk_rows = max(1, min(target, fit))
        why = (f"{CALL_TOKENS} tokens a call // streams_per_call {share} // seq_len {seq_len}"
               if tokens > CHUNK_TOKENS else f"{CHUNK_TOKENS} tokens // seq_len {seq_len}")
        if fit < target:
            why = (f"{budget:g} MB budget / (num_streams {streams} x (prefetch {prefetch} + 1) "
                   f"x {row_bytes} bytes a row)")
        reasons["chunk_rows"] = f"auto: {why}"
    if opts.streams_per_call is None:
        reasons["streams_per_call"] = (f"auto: a worker's share of the streams, num_streams "
                                       f"{streams} // workers {opts.workers}; the pool takes "
                                       f"the share of the streams its host owns")
    return ResolvedRuntime(options=opts, seq_len=seq_len, num_streams=streams,
                           chunk_rows=chunk_rows, streams_per_call=opts.streams_per_call or share,
                           prefetch=prefetch, reasons=reasons)


def streams_per_call_for(streams: int, workers: int, given: int | None = None) -> int:
    """Streams whose next chunks one actor call makes: a worker's share of ``streams`` on
    ``workers`` workers (``streams // workers``, at least 1), or ``given`` where that is
    smaller, so that every worker gets a group. The automatic value and the pool's grouping
    both come from here."""
    share = max(1, streams // max(1, workers))
    return share if given is None else min(given, share)
