"""The feed's config: frozen dataclasses, validated as a whole, loaded from YAML.

Every violation is collected and reported together (`ConfigError`), naming the field, what
arrived and how to fix it. Fields that change the batches (`output_fields`) are fingerprinted
into every checkpoint; the rest (workers, chunk_rows, prefetch) may change between runs.

The runtime knobs ``chunk_rows``, ``streams_per_call`` and ``prefetch`` default to null, which
resolves them from ``seq_len``, ``num_streams``, ``workers`` and ``object_store_budget_mb``
(``Config.runtime_choices``); a value given explicitly is kept as given.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import logging
import math
import os
from typing import Any

from ingest.errors import ConfigError

__all__ = ["Config", "SourceConfig", "check_memory", "load_config", "streams_per_call_for"]

log = logging.getLogger("ingest.config")

PACKINGS = ("concat", "first_fit", "best_fit", "none")
SHIFTS = ("left", "right")
DEALS = ("units", "row_groups")
LONG_DOCUMENT_POLICIES = ("split", "truncate")
BAD_INPUT_POLICIES = ("error", "skip")
FORMATS = ("parquet", "arrow", "jsonl")
SOURCE_KINDS = ("files", "materialized")
TOKENIZER_NAMES = ("gpt2", "cl100k", "cl100k_base")
TOKENIZER_BACKENDS = ("auto", "tiktoken", "rs_bpe", "bpe_openai")

# The rule for runtime knobs left null. A chunk holds about CHUNK_TOKENS tokens (128 rows of
# 1024): Ray's raylet and the host spend a fixed cost per chunk, which larger chunks spread over
# more tokens. AUTO_PREFETCH requests in flight per stream keep a consumer from waiting at the
# step where every stream finishes its chunk. Without object_store_budget_mb, chunks are sized
# to keep num_streams x (prefetch + 1) chunks within AUTO_BUDGET_MB.
CHUNK_TOKENS = 1 << 17
AUTO_PREFETCH = 2
AUTO_BUDGET_MB = 1024
AUTO_FIELDS = ("chunk_rows", "streams_per_call", "prefetch")
_LOGGED: set[str] = set()  # runtime choices already logged by this process

# Fields that may differ between a checkpoint and the config it is restored into.
RUNTIME_FIELDS = frozenset({"workers", "chunk_rows", "streams_per_call", "prefetch",
                            "object_store_budget_mb",
                            "reset_after_epoch",
                            "autoscale", "min_workers", "max_workers", "autoscale_window_s",
                            "pin_workers", "prefault_object_store", "tokenizer_backend"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """One dataset.

    Attributes:
      paths: files, directories (searched recursively) and globs; local paths or any URI
        pyarrow's filesystems accept (``s3://``, ``gs://``, ``file://``).
      text_column: the string column holding one document per row.
      tokens_column: instead of ``text_column``, a ``list<int>`` column of token ids per
        document (pre-tokenized, without the end-of-document id, which the feed appends):
        tokenizing is skipped and the rows are packed like text's. Ids must be below the
        tokenizer's ``vocab_size``.
      table: Python API only: a ``pyarrow.Table`` (or a dict of arrays) to read instead of
        files, for notebooks and tests; ``paths`` stays empty. Its content hash stands for it
        in fingerprints, so checkpoints notice a different table.
      weight: mixing weight (> 0): with several sources, each stream takes rows from each
        source in proportion to ``weight`` in tokens (``ingest.mixture``); to pool files
        without weights, list them in one source.
      format: ``parquet``, ``arrow`` (IPC file / Feather v2, or IPC stream: told apart by the
        file's first bytes) or ``jsonl``; None picks by suffix.
      kind: ``files`` (text documents) or ``materialized`` (one directory written by
        ``ingest materialize``, replayed row for row by ``ingest.replay``; alone, never mixed).
    """

    paths: tuple[str, ...] = ()
    text_column: str = "text"
    tokens_column: str | None = None
    weight: float = 1.0
    format: str | None = None
    kind: str = "files"
    table: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.table, dict):
            import pyarrow as pa  # noqa: PLC0415 (only for in-memory sources)

            object.__setattr__(self, "table", pa.table(self.table))

    @property
    def column(self) -> str:
        """The column read: ``tokens_column`` if set, else ``text_column``."""
        return self.tokens_column if self.tokens_column is not None else self.text_column

    def table_key(self) -> str | None:
        """A hash of the in-memory table's content (None without one)."""
        if self.table is None:
            return None
        key = getattr(self, "_table_key", None)
        if key is None:
            import pyarrow as pa  # noqa: PLC0415

            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, self.table.schema) as w:
                w.write_table(self.table)
            key = hashlib.sha256(sink.getvalue()).hexdigest()[:16]
            object.__setattr__(self, "_table_key", key)
        return key

    def problems(self, where: str) -> list[str]:
        out = []
        if self.table is not None:
            if type(self.table).__name__ != "Table":
                out.append(f"{where}.table must be a pyarrow.Table or a dict of arrays, got "
                           f"{type(self.table).__name__}")
            if self.paths:
                out.append(f"{where} has both a table and paths {list(self.paths)!r}; give one")
        elif isinstance(self.paths, str) or not isinstance(self.paths, tuple | list):
            out.append(f"{where}.paths={self.paths!r} must be a list of paths, dirs or globs")
        elif not self.paths:
            out.append(f"{where}.paths is empty; give at least one file, directory or glob")
        elif not all(isinstance(p, str) and p for p in self.paths):
            out.append(f"{where}.paths={list(self.paths)!r} must hold non-empty strings")
        else:
            for p in self.paths:
                if "://" in p and "@" in p.split("://", 1)[1].split("/", 1)[0]:
                    # Never repeat the secret: name the scheme and bucket only.
                    out.append(f"{where}.paths: a {p.split('://')[0]}:// URI embeds credentials; "
                               f"remove them and use the standard environment variables "
                               f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                               f"GOOGLE_APPLICATION_CREDENTIALS) or the node's role")
        if not isinstance(self.text_column, str) or not self.text_column:
            out.append(f"{where}.text_column={self.text_column!r} must be a column name")
        if self.tokens_column is not None and (not isinstance(self.tokens_column, str)
                                               or not self.tokens_column):
            out.append(f"{where}.tokens_column={self.tokens_column!r} must be a column name "
                       f"or null")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float) or not (
            self.weight > 0
        ):
            out.append(f"{where}.weight={self.weight!r} must be a number > 0")
        if self.format is not None and self.format not in FORMATS:
            out.append(f"{where}.format={self.format!r} must be one of {FORMATS} or null (auto)")
        if self.kind not in SOURCE_KINDS:
            out.append(f"{where}.kind={self.kind!r} must be one of {list(SOURCE_KINDS)}")
        elif (self.kind == "materialized" and isinstance(self.paths, tuple | list)
              and len(self.paths) != 1):
            out.append(f"{where}.paths={list(self.paths)!r}: a materialized source is one "
                       f"directory written by `ingest materialize`; give exactly one path")
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """What to feed and how.

    Attributes:
      sources: the datasets (at least one).
      tokenizer: ``gpt2``, ``cl100k``, a path to a HF ``tokenizer.json``, to a local Hugging
        Face model folder holding one, or to a ``.tiktoken`` file.
      bos: a beginning-of-document id before every document (Llama-style pretraining):
        ``false`` (none), ``true`` (the tokenizer's own BOS token) or an id.
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
        proven to give tiktoken's ids for this vocabulary, else tiktoken), ``tiktoken``,
        ``rs_bpe`` or ``bpe_openai`` (cl100k only; see ``ingest.bpe_backend``). The ids, and
        so the batches, are the same with every backend. Runtime only.
      workers: Ray worker actors (one CPU each). Runtime only.
      chunk_rows: rows per stream per actor call. Null (default): about 128k tokens
        (``131072 // seq_len`` rows, at least 1), fewer where ``num_streams x (prefetch + 1)``
        chunks would exceed ``object_store_budget_mb`` (1024 MB without one). Runtime only.
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
    bos: bool | int = False
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
        problems = []
        if not isinstance(self.sources, tuple | list) or not self.sources:
            problems.append("sources must be a non-empty list of {paths, text_column, weight}")
        else:
            for i, s in enumerate(self.sources):
                if not isinstance(s, SourceConfig):
                    problems.append(f"sources[{i}] must be a mapping with paths, text_column, weight")
                else:
                    problems += s.problems(f"sources[{i}]")
        if not isinstance(self.tokenizer, str) or not (
                self.tokenizer in TOKENIZER_NAMES or self.tokenizer.endswith(
                    (".json", ".tiktoken")) or os.sep in self.tokenizer
                or os.path.isdir(self.tokenizer)):
            problems.append(f"tokenizer={self.tokenizer!r} is unknown; use one of "
                            f"{list(TOKENIZER_NAMES)}, a path to a HF tokenizer.json or to a "
                            f"model folder holding one, or a path to a .tiktoken file")
        if not isinstance(self.bos, bool) and not (isinstance(self.bos, int) and self.bos >= 0):
            problems.append(f"bos={self.bos!r} must be false, true (the tokenizer's own "
                            f"beginning-of-document token) or a token id >= 0")

        def positive_int(name: str, allow_none: bool = False):
            v = getattr(self, name)
            if v is None and allow_none:
                return True
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{name}={v!r} must be a positive integer"
                                + (" or null" if allow_none else ""))
                return False
            return True

        ok = [positive_int(n) for n in ("seq_len", "global_batch_size", "num_streams",
                                        "packing_bins", "unit_rows", "workers")]
        ok += [positive_int(n, allow_none=True) for n in AUTO_FIELDS]
        if self.tokenizer_backend not in TOKENIZER_BACKENDS:
            problems.append(f"tokenizer_backend={self.tokenizer_backend!r} must be one of "
                            f"{list(TOKENIZER_BACKENDS)}")
        elif (self.tokenizer_backend not in ("auto", "tiktoken")
              and self.tokenizer not in ("cl100k", "cl100k_base")):
            problems.append(f"tokenizer_backend={self.tokenizer_backend!r} runs the cl100k "
                            f"vocabulary only (tokenizer={self.tokenizer!r}); use "
                            f"tokenizer_backend: auto (the fastest exact one) or tiktoken")
        positive_int("num_epochs", allow_none=True)
        if (positive_int("min_workers") and positive_int("max_workers", allow_none=True)
                and self.max_workers is not None and self.max_workers < self.min_workers):
            problems.append(f"max_workers={self.max_workers} is below "
                            f"min_workers={self.min_workers}")
        if ok[1] and ok[2] and self.global_batch_size % self.num_streams:
            problems.append(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"num_streams={self.num_streams}; choose num_streams in "
                f"{_nearest_divisors(self.global_batch_size, self.num_streams)}")
        for name, allowed in (("packing", PACKINGS), ("shift", SHIFTS),
                              ("long_documents", LONG_DOCUMENT_POLICIES),
                              ("on_bad_document", BAD_INPUT_POLICIES), ("deal", DEALS),
                              ("on_bad_file", BAD_INPUT_POLICIES)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} must be one of {list(allowed)}")
        for name in ("predict_across_documents", "shuffle", "autoscale", "pin_workers",
                     "prefault_object_store"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        w = self.autoscale_window_s
        if isinstance(w, bool) or not isinstance(w, int | float) or w <= 0:
            problems.append(f"autoscale_window_s={w!r} must be a number of seconds > 0")
        b = self.object_store_budget_mb
        if b is not None and (isinstance(b, bool) or not isinstance(b, int | float) or b <= 0):
            problems.append(f"object_store_budget_mb={b!r} must be a number > 0 or null")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            problems.append(f"seed={self.seed!r} must be an integer >= 0")
        for name in ("drop_remainder", "reset_after_epoch"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        if self.reset_after_epoch is True and self.num_epochs != 1:
            problems.append(f"reset_after_epoch=true restarts the feed after each pass, which needs "
                            f"num_epochs=1 (got num_epochs={self.num_epochs!r}); set num_epochs: 1 "
                            f"or reset_after_epoch: false")
        rampup, rampup_problems = _check_rampup(
            self.batch_rampup, self.global_batch_size if ok[1] else None,
            self.num_streams if ok[2] else None)
        problems += rampup_problems
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
        if self.chunk_rows is None:
            target = max(1, CHUNK_TOKENS // self.seq_len)
            budget = (self.object_store_budget_mb if self.object_store_budget_mb is not None
                      else AUTO_BUDGET_MB)
            row_bytes = 6 * 4 * self.seq_len
            fit = int(budget * 2**20 // (self.num_streams * (self.prefetch + 1) * row_bytes))
            rows = max(1, min(target, fit))
            why = f"{CHUNK_TOKENS} tokens // seq_len {self.seq_len}"
            if fit < target:
                why = (f"{budget:g} MB budget / (num_streams {self.num_streams} x "
                       f"(prefetch {self.prefetch} + 1) x {row_bytes} bytes a row)")
            object.__setattr__(self, "chunk_rows", rows)
            auto["chunk_rows"] = f"auto: {why}"
        if self.streams_per_call is None:
            share = streams_per_call_for(self.num_streams, self.workers)
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
    def chunk_bytes(self) -> int:
        """Object-store bytes of one chunk: six int32 fields of ``chunk_rows x seq_len``."""
        return 6 * 4 * self.chunk_rows * self.seq_len

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
                f"in flight each, chunk_rows={self.chunk_rows} x seq_len={self.seq_len} x 6 "
                f"fields x 4 bytes); raise it or lower chunk_rows")
        return min(self.prefetch, depth)

    def rampup_factor_at(self, step: int) -> float:
        """The ``batch_rampup`` factor of global batch ``step`` (0-based): the factor of the
        largest key <= step, 1.0 before the first key or without a ramp-up."""
        factor = 1.0
        for at, f in (self.batch_rampup or {}).items():  # sorted by step at construction
            if at > step:
                break
            factor = f
        return factor

    def batch_size_at(self, step: int) -> int:
        """Rows of global batch ``step`` (0-based: the first batch is step 0), over all hosts:
        ``global_batch_size x rampup_factor_at(step)``."""
        return round(self.global_batch_size * self.rampup_factor_at(step))

    def batch_sizes(self) -> dict[int, str]:
        """Every global batch size a run may use, each with where it comes from (for errors)."""
        sizes = {self.global_batch_size: f"global_batch_size={self.global_batch_size}"}
        for at, f in (self.batch_rampup or {}).items():
            sizes.setdefault(round(self.global_batch_size * f),
                             f"batch_rampup step {at}: global_batch_size={self.global_batch_size} "
                             f"x {f:g} = {round(self.global_batch_size * f)} rows")
        return sizes

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
        problems = [f"unknown field {k!r}{_did_you_mean(k, known)}; known fields: "
                    f"{sorted(known)}" for k in raw if k not in known]
        sources = []
        for i, s in enumerate(raw.get("sources") or []):
            if not isinstance(s, dict):
                problems.append(f"sources[{i}] must be a mapping with paths, text_column, weight")
                continue
            sknown = {f.name for f in dataclasses.fields(SourceConfig)}
            problems += [f"sources[{i}]: unknown field {k!r}{_did_you_mean(k, sknown)}; known "
                         f"fields: {sorted(sknown)}" for k in s if k not in sknown]
            paths = s.get("paths", ())
            if isinstance(paths, str):
                paths = [paths]
            if isinstance(paths, list):
                paths = tuple(_resolve(p, base_dir) for p in paths)
            kw = {k: v for k, v in s.items() if k in sknown and k != "paths"}
            sources.append(SourceConfig(paths=paths, **kw))
        kwargs = {k: v for k, v in raw.items() if k in known and k != "sources"}
        if "tokenizer" in kwargs and isinstance(kwargs["tokenizer"], str):
            kwargs["tokenizer"] = _resolve_tokenizer(kwargs["tokenizer"], base_dir)
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


# Batches a host keeps at once: one being filled, HostFeed's default device_prefetch (4)
# waiting, one in the training step.
HOST_BATCHES = 6
BYTES_PER_ROW_TOKEN = 6 * 4  # six int32 fields


def machine_memory() -> tuple[int, str]:
    """Bytes of memory this process may use, and where that figure comes from: the physical
    memory, or the cgroup's limit (a container) when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    where = "physical memory"
    for limit_file in ("/sys/fs/cgroup/memory.max",
                       "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < total:
            total, where = int(limit), f"memory limit ({limit_file})"
        break
    return total, where


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_memory(config: Config, *, streams: int | None = None,
                 host_batches: int = HOST_BATCHES, memory: tuple[int, str] | None = None) -> None:
    """Refuses batch and chunk sizes whose buffers cannot fit in this machine's memory.

    A row is ``seq_len x 6 fields x 4 bytes``. A host keeps ``host_batches`` batches of its
    rows (its ``streams``' share of the largest global batch, ``batch_rampup`` included); each
    of the streams keeps ``prefetch`` chunks in flight, one being read and one being produced
    (``chunk_rows`` rows each), on this machine with the local backend or a one-machine
    cluster.

    Args:
      config: a validated config.
      streams: the streams this host owns (default: all).
      host_batches: batches the host keeps (0: none, for a job that forms no batches).
      memory: ``(bytes, what)`` to compare with (default: ``machine_memory()``).

    Raises:
      ConfigError: naming the fields, the bytes they need and the memory there is.
    """
    total, what = memory if memory is not None else machine_memory()
    have = f"this machine's {_size(total)} of {what}"
    owned = config.num_streams if streams is None else streams
    row = config.seq_len * BYTES_PER_ROW_TOKEN
    problems = []
    rows, label = max((size, label) for size, label in config.batch_sizes().items())
    host = rows * owned // config.num_streams
    batch_need = host_batches * host * row
    if batch_need > total:
        which = "global_batch_size" if label.startswith("global_batch_size") else "that factor"
        problems.append(
            f"{label}: {host:,} rows on this host x "
            f"seq_len={config.seq_len:,} x 6 fields x 4 bytes = {_size(host * row)} per batch; "
            f"the host keeps {host_batches} (one being filled, the prefetched ones, one in "
            f"use): {_size(batch_need)}, more than {have}. Lower {which} or seq_len")
    per_stream = config.prefetch + 2
    chunk_need = owned * per_stream * config.chunk_bytes
    if chunk_need > total:
        lower = "prefetch or seq_len" if config.chunk_rows == 1 else "chunk_rows, prefetch or seq_len"
        problems.append(
            f"chunk_rows={config.chunk_rows:,}{' (automatic)' if config.is_auto('chunk_rows') else ''}"
            f" x seq_len={config.seq_len:,} x 6 fields x 4 "
            f"bytes = {_size(config.chunk_bytes)} per chunk; {owned} stream(s) keep up to "
            f"prefetch={config.prefetch} + 2 chunks each (in flight, being read, being "
            f"produced): {_size(chunk_need)}, more than {have}. Lower {lower}")
    if not problems and batch_need + chunk_need > total:
        problems.append(
            f"the batches ({_size(batch_need)}: {host_batches} x {host:,} rows x "
            f"seq_len={config.seq_len:,} x 6 fields x 4 bytes) and chunks ({_size(chunk_need)}: "
            f"{owned} stream(s) x {per_stream} x chunk_rows={config.chunk_rows:,} rows) need "
            f"{_size(batch_need + chunk_need)}, more than {have}. Lower global_batch_size, "
            f"chunk_rows or seq_len")
    if problems:
        raise ConfigError(problems)


def _did_you_mean(key: Any, known: set[str]) -> str:
    """``; did you mean 'x'?`` for the known field closest to an unknown key, or nothing."""
    near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""


def _resolve(path: str, base_dir: str | None) -> str:
    if not isinstance(path, str) or base_dir is None or "://" in path or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


# Output fields added after checkpoints existed enter the fingerprint only when set, so a
# checkpoint saved before they existed still restores under their defaults.
_OMITTED_AT_DEFAULT = {"drop_remainder": False, "batch_rampup": None, "deal": "units",
                       "bos": False}


def _check_rampup(raw: Any, batch: int | None, streams: int | None
                  ) -> tuple[dict[int, float] | None, list[str]]:
    """``batch_rampup`` normalized (int steps in order, float factors), and its problems."""
    if raw is None:
        return None, []
    if not isinstance(raw, dict) or not raw:
        return None, [f"batch_rampup={raw!r} must be a mapping {{step: factor}} (e.g. "
                      f"{{0: 0.25, 1000: 0.5, 2000: 1.0}}) or null"]
    problems, out = [], {}
    for key, f in raw.items():
        step = key
        if isinstance(key, str) and key.strip().lstrip("+").isdigit():
            step = int(key)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            problems.append(f"batch_rampup={raw!r}: step {key!r} must be an integer >= 0 (the "
                            f"0-based index of a global batch)")
            continue
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f < float("inf"):
            problems.append(f"batch_rampup={raw!r}: the factor at step {step} is {f!r}; give a "
                            f"number > 0 (it multiplies global_batch_size)")
            continue
        if step in out:
            problems.append(f"batch_rampup={raw!r}: step {step} is given twice")
        out[step] = float(f)
    if problems or batch is None or streams is None:
        return None, problems
    unit = streams / batch  # factors that fit are the multiples of this
    bad = []
    for step, f in out.items():
        rows = batch * f
        if abs(rows - round(rows)) > 1e-6 or round(rows) % streams or round(rows) == 0:
            lo, hi = math.floor(rows / streams) * unit, math.ceil(rows / streams) * unit
            near = " or ".join(f"{x:g}" for x in dict.fromkeys((lo, hi)) if x > 0)
            bad.append(f"step {step}: factor {f:g} gives {rows:g} rows (try {near})")
    if bad:
        problems.append(
            f"batch_rampup={raw!r}: global_batch_size={batch} x factor must be a whole number of "
            f"rows divisible by num_streams={streams} at every entry; not at " + "; ".join(bad)
            + f". Factors that fit are the multiples of {unit:g} (num_streams / "
            f"global_batch_size)")
        return None, problems
    return dict(sorted(out.items())), []


def _resolve_tokenizer(name: str, base_dir: str | None) -> str:
    if os.sep in name or name.endswith((".json", ".tiktoken")) or (
            base_dir is not None and os.path.isdir(os.path.join(base_dir, name))):
        return _resolve(name, base_dir)
    return name


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
    import yaml

    with open(path, encoding="utf-8") as f:
        loader = _strict_loader(yaml)(f)
        try:
            raw = loader.get_single_data()
        except yaml.YAMLError as e:
            raise ConfigError([f"{path} is not valid YAML: {e}"], where=path) from e
        finally:
            loader.dispose()
    if loader.duplicates:
        raise ConfigError([f"key {key!r} is given twice, at line {first} and line {second} (YAML "
                           f"would keep only the last); remove one"
                           for key, first, second in loader.duplicates], where=path)
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError([f"{path} must be a mapping of fields (seq_len: 1024, sources: [...], "
                           f"...), but it holds {_described(raw)}"], where=path)
    raw = dict(raw or {})
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Config.from_dict(raw, base_dir=os.path.dirname(os.path.abspath(path)))
    except ConfigError as e:
        raise ConfigError(e.problems, where=path) from None


def _described(value: Any) -> str:
    """What a YAML document holds, for an error: ``a list of 3 items``, ``the string 'x'``."""
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)" + (f", the first {value[0]!r:.60}" if value
                                                    else "")
    return f"the {type(value).__name__} {value!r:.60}"


def _strict_loader(yaml: Any) -> type:
    """A SafeLoader whose mappings record every key given twice as ``duplicates``:
    ``(key, first line, second line)``, 1-based."""

    class StrictLoader(yaml.SafeLoader):
        def __init__(self, stream: Any):
            super().__init__(stream)
            self.duplicates: list[tuple[Any, int, int]] = []

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # ``<<: *base`` then a key of base overrides it; that is no repeat
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        self.duplicates.append((key, seen[key], line))
                    else:
                        seen[key] = line
                except TypeError:
                    continue  # an unhashable key: SafeLoader's own error names it
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _nearest_divisors(n: int, near: int, count: int = 8) -> list[int] | str:
    """The divisors of ``n`` closest to ``near`` (all of them when there are few), ascending;
    found in O(sqrt(n)) steps, so a huge ``n`` is quick."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = sorted(set(small) | {n // d for d in small})
    if len(divisors) <= count:
        return divisors
    closest = sorted(sorted(divisors, key=lambda d: (abs(d - near), d))[:count])
    return f"the divisors of {n}, e.g. {closest}"
