"""The feed's config: frozen dataclasses, validated as a whole, loaded from YAML.

Every violation is collected and reported together (`ConfigError`), naming the field, what
arrived and how to fix it (the checks: ``ingest.config_checks``, ``ingest.source_config``,
``ingest.config_memory``; reading YAML: ``ingest.config_yaml``).

A ``Config`` is what defines the batches, and every field of it but ``runtime`` (and the
sources' weights) is fingerprinted into every checkpoint. ``runtime``
(``ingest.runtime.RuntimeOptions``: workers, chunk sizing, prefetch, autoscale...) may change
between runs; its automatic values are chosen where they are used
(``ingest.runtime.resolve_runtime``). In YAML, and in ``from_dict``, ``load_config`` and
``Config.replace``, the runtime fields sit flat beside the others (``workers: 4``); a nested
``runtime:`` mapping is read too.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
from typing import Any

from ingest.batch_schedule import BatchSchedule
from ingest.config_checks import check_fields, unknown_fields
from ingest.config_memory import check_memory, machine_memory
from ingest.config_yaml import read_yaml_fields, resolve_path, resolve_tokenizer
from ingest.errors import ConfigError
from ingest.runtime import RUNTIME_OPTION_NAMES, RuntimeOptions
from ingest.source_config import SourceConfig

__all__ = ["Config", "ConfigError", "RuntimeOptions", "SourceConfig", "check_memory",
           "config_keys", "load_config", "machine_memory", "to_dict", "with_overrides"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """What to feed: every field defines the batches, but ``runtime``, how to run the feed.

    ``Config(sources=..., seq_len=..., runtime=RuntimeOptions(workers=4))``; ``replace``
    and ``from_dict`` also take the runtime options by name (``replace(workers=4)``).

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
      runtime: how to run the feed (``ingest.runtime.RuntimeOptions``: workers, chunk sizing,
        prefetch, autoscale, the tokenizer's library...); never changes a batch, never
        fingerprinted. Its fields are written flat in YAML.
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
    batch_rampup: dict[int, float] | None = None
    unit_rows: int = 256
    deal: str = "units"
    on_bad_document: str = "error"
    on_bad_file: str = "error"
    runtime: RuntimeOptions = RuntimeOptions()

    def __post_init__(self):
        problems, rampup = check_fields(self)
        if problems:
            raise ConfigError(problems)
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "batch_rampup", rampup)

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
        """The fields that determine the batches, as JSON: every field but ``runtime``.

        Source weights are left out: a mixture may change them on resume (the streams keep
        their positions; see ``ingest.stream.mixture``)."""
        d = _batch_fields(self)
        for s in d["sources"]:
            s.pop("weight", None)
        return {k: v for k, v in d.items()
                if not (k in _OMITTED_AT_DEFAULT and v == _OMITTED_AT_DEFAULT[k]
                        and type(v) is type(_OMITTED_AT_DEFAULT[k]))}

    def fingerprint(self) -> str:
        blob = json.dumps(self.output_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes``: fields of the config, and runtime options given flat as in
        YAML (``config.replace(workers=4)``) or as ``runtime=RuntimeOptions(...)`` (flat ones
        then change that).

        Raises:
          ConfigError: a changed field or option is invalid.
        """
        flat = {k: changes.pop(k) for k in list(changes) if k in RUNTIME_OPTION_NAMES}
        if flat:
            changes["runtime"] = dataclasses.replace(changes.get("runtime", self.runtime), **flat)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, base_dir: str | None = None) -> Config:
        """Builds a config from plain data (parsed YAML, ``to_dict``'s output), reporting every
        problem at once.

        The runtime options are read flat beside the other fields (``workers: 4``), or from a
        ``runtime`` mapping. ``sources`` holds mappings (or ``SourceConfig`` objects). Relative
        local source paths resolve against ``base_dir`` (the YAML file's folder).
        """
        if not isinstance(raw, dict):
            raise ConfigError([f"the config must be a mapping of fields, got {type(raw).__name__}"])
        fields = {f.name for f in dataclasses.fields(cls)}
        problems = unknown_fields(raw, fields | RUNTIME_OPTION_NAMES)
        sources = []
        for i, s in enumerate(raw.get("sources") or []):
            if isinstance(s, SourceConfig):
                sources.append(s)
                continue
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
        runtime, runtime_problems = _runtime_of(raw)
        kwargs = {k: v for k, v in raw.items() if k in fields and k not in ("sources", "runtime")}
        if "tokenizer" in kwargs and isinstance(kwargs["tokenizer"], str):
            kwargs["tokenizer"] = resolve_tokenizer(kwargs["tokenizer"], base_dir)
        try:
            cfg = cls(sources=tuple(sources), runtime=runtime or RuntimeOptions(), **kwargs)
        except ConfigError as e:
            problems += e.problems
            cfg = None
        problems += runtime_problems
        if problems:
            raise ConfigError(problems)
        return cfg


def _runtime_of(raw: dict[str, Any]) -> tuple[RuntimeOptions | None, list[str]]:
    """The runtime options of a config's plain data: its flat runtime fields and those of its
    ``runtime`` mapping (or ``RuntimeOptions``), with their problems (None where any)."""
    nested = raw.get("runtime") or {}
    if isinstance(nested, RuntimeOptions):
        nested = _runtime_fields(nested)
    if not isinstance(nested, dict):
        return None, [f"runtime={nested!r} must be a mapping of runtime options (workers: 4, "
                      f"...) or be left out; they may also be written flat"]
    problems = unknown_fields(nested, RUNTIME_OPTION_NAMES, "runtime")
    flat = {k: v for k, v in raw.items() if k in RUNTIME_OPTION_NAMES}
    problems += [f"{k} is given both flat ({k}: {flat[k]!r}) and in runtime ({k}: "
                 f"{nested[k]!r}); give it once" for k in flat if k in nested]
    try:
        options = RuntimeOptions(**{k: v for k, v in nested.items() if k in RUNTIME_OPTION_NAMES},
                                 **{k: v for k, v in flat.items() if k not in nested})
    except ConfigError as e:
        return None, problems + e.problems
    return (None, problems) if problems else (options, [])


# Output fields added after checkpoints existed enter the fingerprint only when set, so a
# checkpoint saved before they existed still restores under their defaults.
_OMITTED_AT_DEFAULT = {"drop_remainder": False, "batch_rampup": None, "deal": "units",
                       "bos": None}


def _runtime_fields(options: RuntimeOptions) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _batch_fields(cfg: Config) -> dict[str, Any]:
    """Every field of ``cfg`` but ``runtime`` as plain data; an in-memory table stands as its
    row count and hash."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
         if f.name not in ("sources", "runtime")}
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


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data, flat as YAML writes it (the runtime options beside the
    other fields); ``Config.from_dict`` reads it back. An in-memory table stands as its row
    count and hash."""
    return {**_batch_fields(cfg), **_runtime_fields(cfg.runtime)}


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A config's plain data with ``overrides`` replacing its fields; a runtime option that
    the data holds in a nested ``runtime`` mapping is replaced there."""
    out = dict(raw)
    nested = out.get("runtime")
    for key, value in overrides.items():
        if isinstance(nested, dict) and key in RUNTIME_OPTION_NAMES and key in nested:
            nested = out["runtime"] = {**nested, key: value}
        else:
            out[key] = value
    return out


def config_keys() -> frozenset[str]:
    """The keys a config's plain data may hold: every field, and the runtime options flat."""
    return frozenset(f.name for f in dataclasses.fields(Config)) | RUNTIME_OPTION_NAMES


def load_config(path: str, **overrides: Any) -> Config:
    """Reads a YAML config file; ``overrides`` (non-None values) replace its fields.

    Raises:
      ConfigError: invalid YAML, a key given twice in one mapping (naming both lines), a file
        that is not a mapping of fields, or invalid fields (every problem at once).
    """
    raw = with_overrides(read_yaml_fields(path),
                         {k: v for k, v in overrides.items() if v is not None})
    try:
        return Config.from_dict(raw, base_dir=os.path.dirname(os.path.abspath(path)))
    except ConfigError as e:
        raise ConfigError(e.problems, where=path) from None
