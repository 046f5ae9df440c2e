"""The feed's config: frozen dataclasses, validated as a whole, loaded from YAML.

Every violation is collected and reported together (`ConfigError`), naming the field, what
arrived and how to fix it (the checks: ``ingest.config_checks``, ``ingest.source_config``,
``ingest.config_memory``; reading YAML: ``ingest.config_yaml``). Fields that change the
batches (`output_fields`) are fingerprinted into every checkpoint; the rest (workers,
chunk_rows, prefetch) may change between runs.

The runtime knobs ``chunk_rows``, ``streams_per_call`` and ``prefetch`` default to null, which
resolves them from ``seq_len``, ``num_streams``, ``workers`` and ``object_store_budget_mb``
(``Config.runtime_choices``); a value given explicitly is kept as given.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import os
from typing import Any

from ingest.batch_schedule import BatchSchedule
from ingest.chunk_format import chunk_token_bytes
from ingest.config_checks import AUTO_FIELDS, check_fields, unknown_fields
from ingest.config_memory import check_memory, machine_memory
from ingest.config_yaml import read_yaml_fields, resolve_path, resolve_tokenizer
from ingest.errors import ConfigError
from ingest.source_config import SourceConfig

__all__ = ["AUTO_FIELDS", "Config", "ConfigError", "SourceConfig", "check_memory",
           "load_config", "machine_memory", "streams_per_call_for", "to_dict"]

log = logging.getLogger("ingest.config")

# The rule for runtime knobs left null. One actor call makes about CALL_TOKENS tokens, split
# over the streams it serves (``streams_per_call``), and each chunk at least CHUNK_TOKENS (128
# rows of 1024): a worker, Ray's raylet and the host spend a fixed cost per call and per chunk,
# which larger ones spread over more tokens, while a worker's first call, which the first batch
# waits for, stays as long whatever the number of workers. AUTO_PREFETCH requests in flight per
# stream keep a consumer from waiting at the step where every stream finishes its chunk.
# Without object_store_budget_mb, chunks are sized to keep num_streams x (prefetch + 1) chunks
# within AUTO_BUDGET_MB.
CALL_TOKENS = 1 << 20
CHUNK_TOKENS = 1 << 17
AUTO_PREFETCH = 2
AUTO_BUDGET_MB = 1024
_LOGGED: set[str] = set()  # runtime choices already logged by this process

# Fields that may differ between a checkpoint and the config it is restored into.
RUNTIME_FIELDS = frozenset({"workers", "chunk_rows", "streams_per_call", "prefetch",
                            "object_store_budget_mb",
                            "reset_after_epoch",
                            "autoscale", "min_workers", "max_workers", "autoscale_window_s",
                            "pin_workers", "prefault_object_store", "tokenizer_backend"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """What to feed and how.

    Attributes:
      sources: the datasets (at least one).
      tokenizer: ``gpt2``, ``cl100k``, a path to a HF ``tokenizer.json``, to a local Hugging
        Face model folder holding one, or to a ``.tiktoken`` file.
      bos: a beginning-of-document id before every document (Llama-style pretraining):
        null (default: as the tokenizer's own configuration says, as HF tokenizers does:
        a model folder's ``add_bos_token``, else its ``tokenizer.json``'s post-processor;
        none for tiktoken vocabularies), ``false`` (none), ``true`` (the tokenizer's own BOS
        token) or an id.
      seq_len: tokens per row.
      global_batch_size: rows per step (B), over all hosts.
      num_streams: S, the number of deterministic streams; must divide B. Fixed for a run:
        it never depends on how many workers run.
      packing: ``concat`` (default), ``first_fit``, ``best_fit`` or ``none``.
      packing_bins: bins a first_fit/best_fit packer fills before emitting them (grain's
        ``num_packing_bins``).
      long_documents: for first_fit/best_fit/none, a document longer than a row is ``split``
        into row-sized pieces or ``truncate``d (truncated tokens are counted).
      shift: ``left`` (targets are the next token of the stream) or ``right`` (inputs are the
        targets shifted right with the end-of-document id first).
      predict_across_documents: if false, no loss on a target that crosses into the next document.
      seed: seeds every shuffle.
      shuffle: shuffle units per epoch and documents inside units.
      num_epochs: passes over the corpus; null means forever.
      drop_remainder: deliver only full batches: the feed ends before the first step in which
        any stream has run out (every host alike); that step's rows are counted as dropped.
      reset_after_epoch: with ``num_epochs: 1``, iterating the feed again (a new ``for`` loop)
        after it delivered a batch restarts it from the beginning (validation feeds). It does
        not change the batches of a pass: runtime only.
      batch_rampup: ``{step: factor}``; global batch ``t`` (0-based: the first batch is step 0)
        has ``global_batch_size x factor`` rows, the factor of the largest key <= t (1.0 before
        the first key; factors are not accumulated). Every such size must be a whole multiple
        of ``num_streams``. YAML keys may be ints or strings of ints.
      unit_rows: at most this many documents per unit (units are row groups or parts of them).
      deal: ``units`` (default): each epoch, units are permuted and dealt one by one.
        ``row_groups``: the units of a row group stay together and are read in row order by
        one stream (groups are permuted and dealt, split into runs only where the corpus has
        too few); each Parquet group (or JSONL file) is then decoded once an epoch, as it
        is read, for corpora larger than the memory and disk caches of decoded groups.
      on_bad_document: ``error`` or ``skip`` (counted) for null, empty or non-UTF-8 texts.
      on_bad_file: ``error`` or ``skip`` (counted) for unreadable or corrupt files.
      tokenizer_backend: the library that runs the tokenizer: ``auto`` (the fastest one
        proven to give the reference's ids for this vocabulary, else the reference),
        ``tiktoken`` (the reference: tiktoken, or HF tokenizers for a ``tokenizer.json``),
        ``toktok``, ``rs_bpe`` or ``bpe_openai`` (cl100k only), ``tuetoken`` (gpt2 and the
        ``tokenizer.json`` files of proven families) or ``riptoken`` (gpt2 only; see
        ``ingest.bpe_backend``). The ids, and
        so the batches, are the same with every backend. Runtime only.
      workers: Ray worker actors (one CPU each). Runtime only.
      chunk_rows: rows per stream per actor call. Null (default): about 1M tokens a call
        over its ``streams_per_call`` streams, at least 128k tokens a chunk
        (``max(131072, 1048576 // streams_per_call) // seq_len`` rows, at least 1), fewer where
        ``num_streams x (prefetch + 1)`` chunks would exceed ``object_store_budget_mb`` (1024
        MB without one). Where this process makes the chunks itself (the local backend), an
        automatic value keeps to 128k tokens (``in_process_chunk_rows``). Runtime only.
      streams_per_call: streams of one worker whose next chunks one actor call makes and
        returns as one object (fewer calls and objects; the chunks are the same). Null
        (default): a worker's share of the host's streams. Runtime only.
      prefetch: chunk requests in flight per stream. Null (default): 2. Runtime only.
      object_store_budget_mb: the most object-store memory a host's chunks may hold (requests in
        flight plus the chunk being read, per owned stream); lowers the requests in flight to
        fit. Null: ``prefetch`` alone bounds it. Runtime only.
      autoscale: grow the pool while the host waits for chunks and shrink it while chunks sit
        unused, within ``min_workers``/``max_workers`` (``workers`` is the start). Runtime only.
      min_workers, max_workers: autoscale bounds; null max means one worker per owned stream.
      autoscale_window_s: seconds between autoscale decisions.
      pin_workers: each worker binds itself to a CPU that no other ingest worker on its node
        holds (none free: it floats). Runtime only.
      prefault_object_store: each worker maps the first pages of Ray's object store (1.25 x
        the feed's bound on chunk bytes, at most 1 GiB and half the store) into its page
        tables when it starts, so that storing chunks there takes no page faults. Runtime
        only.
    """

    sources: tuple[SourceConfig, ...]
    tokenizer: str = "gpt2"
    bos: bool | int | None = None
    seq_len: int = 1024
    global_batch_size: int = 32
    num_streams: int = 8
    packing: str = "concat"
    packing_bins: int = 16
    long_documents: str = "split"
    shift: str = "left"
    predict_across_documents: bool = False
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = 1
    drop_remainder: bool = False
    reset_after_epoch: bool = False
    batch_rampup: dict[int, float] | None = None
    unit_rows: int = 256
    deal: str = "units"
    on_bad_document: str = "error"
    on_bad_file: str = "error"
    tokenizer_backend: str = "auto"
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

    def __post_init__(self):
        problems, rampup = check_fields(self)
        if problems:
            raise ConfigError(problems)
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "batch_rampup", rampup)
        self._resolve_runtime()

    def _resolve_runtime(self) -> None:
        """Fills the runtime knobs left null by the rule in the class docstring; records why."""
        auto: dict[str, str] = {}
        if self.prefetch is None:
            object.__setattr__(self, "prefetch", AUTO_PREFETCH)
            auto["prefetch"] = "auto: two requests in flight per stream"
        # The streams one call serves: the value given (capped at a worker's share) or the
        # share itself, which is also the automatic streams_per_call.
        share = streams_per_call_for(self.num_streams, self.workers, self.streams_per_call)
        if self.chunk_rows is None:
            tokens = max(CHUNK_TOKENS, CALL_TOKENS // share)
            target = max(1, tokens // self.seq_len)
            budget = (self.object_store_budget_mb if self.object_store_budget_mb is not None
                      else AUTO_BUDGET_MB)
            row_bytes = chunk_token_bytes(self.seq_len) * self.seq_len
            fit = int(budget * 2**20 // (self.num_streams * (self.prefetch + 1) * row_bytes))
            rows = max(1, min(target, fit))
            why = (f"{CALL_TOKENS} tokens a call // streams_per_call {share} // seq_len "
                   f"{self.seq_len}" if tokens > CHUNK_TOKENS
                   else f"{CHUNK_TOKENS} tokens // seq_len {self.seq_len}")
            if fit < target:
                why = (f"{budget:g} MB budget / (num_streams {self.num_streams} x "
                       f"(prefetch {self.prefetch} + 1) x {row_bytes} bytes a row)")
            object.__setattr__(self, "chunk_rows", rows)
            auto["chunk_rows"] = f"auto: {why}"
        if self.streams_per_call is None:
            object.__setattr__(self, "streams_per_call", share)
            auto["streams_per_call"] = (f"auto: a worker's share of the streams, num_streams "
                                        f"{self.num_streams} // workers {self.workers}; the pool "
                                        f"takes the share of the streams its host owns")
        object.__setattr__(self, "_auto", auto)

    def is_auto(self, name: str) -> bool:
        """Whether runtime knob ``name`` was left null and resolved by the rule."""
        return name in self._auto

    def runtime_choices(self) -> str:
        """The runtime knobs as resolved, each auto one with its reason (one line)."""
        return ", ".join(f"{n}={getattr(self, n)}"
                         + (f" ({self._auto[n]})" if n in self._auto else " (explicit)")
                         for n in AUTO_FIELDS)

    def log_runtime_choices(self) -> None:
        """Logs ``runtime_choices`` at INFO, once per process for each distinct line."""
        line = self.runtime_choices()
        if line not in _LOGGED:
            _LOGGED.add(line)
            log.info("runtime knobs: %s", line)

    def streams_per_call_on(self, owned_streams: int, workers: int) -> int:
        """The ``streams_per_call`` a pool of ``workers`` uses for ``owned_streams`` streams:
        ``streams_per_call_for`` with the value given, or none where it was left null."""
        given = None if self.is_auto("streams_per_call") else self.streams_per_call
        return streams_per_call_for(owned_streams, workers, given)

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
        ``ingest.chunk_format.chunk_token_bytes`` each."""
        return chunk_token_bytes(self.seq_len) * self.chunk_rows * self.seq_len

    def requests_in_flight(self, owned_streams: int) -> int:
        """Chunk requests each stream may have in flight under ``object_store_budget_mb``.

        Raises:
          ValueError: the budget holds less than two chunks per owned stream.
        """
        if self.object_store_budget_mb is None:
            return self.prefetch
        budget = self.object_store_budget_mb * 2**20
        # One chunk per stream is being read by the host; the rest of the budget is in flight.
        depth = int(budget // (owned_streams * self.chunk_bytes)) - 1
        if depth < 1:
            need = 2 * owned_streams * self.chunk_bytes / 2**20
            raise ValueError(
                f"object_store_budget_mb={self.object_store_budget_mb} is below the "
                f"{need:.1f} MB that {owned_streams} streams need (one chunk being read and one "
                f"in flight each, chunk_rows={self.chunk_rows} x seq_len={self.seq_len} x "
                f"{chunk_token_bytes(self.seq_len)} bytes a token); raise it or lower "
                f"chunk_rows")
        return min(self.prefetch, depth)

    @functools.cached_property
    def schedule(self) -> BatchSchedule:
        """The rows of every global step, ``batch_rampup`` included (``ingest.batch_schedule``)."""
        return BatchSchedule(global_batch_size=self.global_batch_size,
                             num_streams=self.num_streams,
                             rampup=tuple((self.batch_rampup or {}).items()))

    def batch_size_at(self, step: int) -> int:
        """Rows of global batch ``step`` (0-based: the first batch is step 0), over all hosts."""
        return self.schedule.size_at(step)

    def batch_sizes(self) -> dict[int, str]:
        """Every global batch size a run may use, each with where it comes from (for errors)."""
        return self.schedule.sizes()

    @property
    def rows_per_stream(self) -> int:
        """k = B / S: rows each stream contributes to every step."""
        return self.global_batch_size // self.num_streams

    def output_fields(self) -> dict[str, Any]:
        """The fields that determine the batches (everything but runtime fields), as JSON.

        Source weights are left out: a mixture may change them on resume (the streams keep
        their positions; see ``ingest.mixture``)."""
        d = to_dict(self)
        for s in d["sources"]:
            s.pop("weight", None)
        return {k: v for k, v in d.items() if k not in RUNTIME_FIELDS
                and not (k in _OMITTED_AT_DEFAULT and v == _OMITTED_AT_DEFAULT[k]
                         and type(v) is type(_OMITTED_AT_DEFAULT[k]))}

    def fingerprint(self) -> str:
        blob = json.dumps(self.output_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes``; runtime knobs resolved by the rule are resolved again
        (from the new fields) unless ``changes`` sets them."""
        auto = {n: None for n in self._auto if n not in changes}
        return dataclasses.replace(self, **auto, **changes)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, base_dir: str | None = None) -> Config:
        """Builds a config from plain data (parsed YAML), reporting every problem at once.

        Relative local source paths resolve against ``base_dir`` (the YAML file's folder).
        """
        if not isinstance(raw, dict):
            raise ConfigError([f"the config must be a mapping of fields, got {type(raw).__name__}"])
        known = {f.name for f in dataclasses.fields(cls)}
        problems = unknown_fields(raw, known)
        sources = []
        for i, s in enumerate(raw.get("sources") or []):
            if not isinstance(s, dict):
                problems.append(f"sources[{i}] must be a mapping with paths, text_column, weight")
                continue
            sknown = {f.name for f in dataclasses.fields(SourceConfig)}
            problems += unknown_fields(s, sknown, f"sources[{i}]")
            paths = s.get("paths", ())
            if isinstance(paths, str):
                paths = [paths]
            if isinstance(paths, list):
                paths = tuple(resolve_path(p, base_dir) for p in paths)
            kw = {k: v for k, v in s.items() if k in sknown and k != "paths"}
            sources.append(SourceConfig(paths=paths, **kw))
        kwargs = {k: v for k, v in raw.items() if k in known and k != "sources"}
        if "tokenizer" in kwargs and isinstance(kwargs["tokenizer"], str):
            kwargs["tokenizer"] = resolve_tokenizer(kwargs["tokenizer"], base_dir)
        try:
            cfg = cls(sources=tuple(sources), **kwargs)
        except ConfigError as e:
            problems += e.problems
            cfg = None
        if problems:
            raise ConfigError(problems)
        return cfg


def streams_per_call_for(streams: int, workers: int, given: int | None = None) -> int:
    """Streams whose next chunks one actor call makes: a worker's share of ``streams`` on
    ``workers`` workers (``streams // workers``, at least 1), or ``given`` where that is
    smaller, so that every worker gets a group. The config's automatic value and the pool's
    grouping both come from here."""
    share = max(1, streams // max(1, workers))
    return share if given is None else min(given, share)


# Output fields added after checkpoints existed enter the fingerprint only when set, so a
# checkpoint saved before they existed still restores under their defaults.
_OMITTED_AT_DEFAULT = {"drop_remainder": False, "batch_rampup": None, "deal": "units",
                       "bos": None}


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data; an in-memory table stands as its row count and hash."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "sources"}
    d = copy.deepcopy(d)
    sources = []
    for s in cfg.sources:
        sd = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "table"}
        sd["paths"] = list(s.paths)
        if s.table is not None:
            sd["table"] = {"rows": s.table.num_rows, "content": s.table_key()}
        sources.append(sd)
    d["sources"] = sources
    if d.get("batch_rampup") is not None:
        # JSON object keys are strings: the same form before and after a checkpoint round trip.
        d["batch_rampup"] = {str(k): v for k, v in d["batch_rampup"].items()}
    return d


def load_config(path: str, **overrides: Any) -> Config:
    """Reads a YAML config file; ``overrides`` (non-None values) replace its fields.

    Raises:
      ConfigError: invalid YAML, a key given twice in one mapping (naming both lines), a file
        that is not a mapping of fields, or invalid fields (every problem at once).
    """
    raw = read_yaml_fields(path)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Config.from_dict(raw, base_dir=os.path.dirname(os.path.abspath(path)))
    except ConfigError as e:
        raise ConfigError(e.problems, where=path) from None
