"""The unit plan: which slices of which files exist, and which stream reads which, per epoch.

A *unit* is a fixed slice of one row group of one file. The plan is a pure function of the
sources' file lists, their metadata and ``unit_rows``; its fingerprint goes into every
checkpoint. Each epoch, units are permuted with a generator keyed by (seed, epoch) and dealt
to streams so that streams get similar byte counts::

    row groups   f0:[0..600) f0:[600..900)  f1:[0..500)
    units        u0 [0,256) u1 [256,512) u2 [512,600)  u3 [600,900)  u4 [0,250) u5 [250,500)
                 (unit_rows=256: a row group of n rows splits into ceil(n/256) near-equal parts)
    epoch e      permute with key (seed, epoch)       -> u3 u0 u5 u2 u4 u1
                 stable-sort by size class, largest first (classes are powers of 2 of bytes)
    deal S=2     each unit goes to the stream with the fewest bytes so far (ties: lowest id)
    read order   each stream's units, permuted with key (seed, epoch, stream)
                 s0: u2 u3 u1 ...   s1: u5 u0 u4 ...

Dealing large units first bounds the byte imbalance between streams by about the smallest
units' size (streams of a finite epoch that end early are padded, so balance is less padding);
the random order inside each size class and the final shuffle keep every epoch's assignment
and reading order random. With ``shuffle: false`` units are dealt in file order, unsorted.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import heapq
import json
import logging
import time

import numpy as np

from ingest import spill
from ingest.config import Config
from ingest.errors import BadInputError
from ingest.sources import LARGE_GROUP_BYTES, FileInfo, describe_file, describe_table, list_files

__all__ = ["Unit", "UnitPlan", "build_plan", "deal_units", "philox"]

log = logging.getLogger("ingest.plan")


@dataclasses.dataclass(frozen=True)
class Unit:
    """Rows ``[row_start, row_end)`` of row group ``group`` of file ``file`` (indices into the
    plan's files); ``nbytes`` estimates its text bytes."""

    source: int
    file: int
    group: int
    row_start: int
    row_end: int
    nbytes: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """All units of the corpus.

    Attributes:
      files: every usable file, in source then path order.
      text_columns: per source.
      units: every unit, in file order.
      skipped_files: (path, reason, message) for files skipped under ``on_bad_file: skip``.
      fingerprint: hash of the files and their metadata.
      pretokenized: per source, whether its column holds token ids (``tokens_column``).
    """

    files: tuple[FileInfo, ...]
    text_columns: tuple[str, ...]
    units: tuple[Unit, ...]
    skipped_files: tuple[tuple[str, str, str], ...]
    fingerprint: str
    pretokenized: tuple[bool, ...] = ()

    @property
    def total_rows(self) -> int:
        return sum(u.num_rows for u in self.units)


def philox(*key: int) -> np.random.Generator:
    """A counter-based generator keyed by integers (seed, epoch, unit...): same key, same draws."""
    digest = hashlib.sha256(json.dumps(list(key)).encode()).digest()
    words = np.frombuffer(digest[:16], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=words))


def build_plan(config: Config) -> UnitPlan:
    """Lists and inspects every file of every source and cuts it into units.

    Raises:
      FileNotFoundError: any source path matches nothing (all listed).
      BadInputError: a file is unreadable or lacks a usable text column, unless
        ``on_bad_file: skip`` (then it is recorded in ``skipped_files``).
      ValueError: the corpus has no rows, or fewer units than ``num_streams``.

    A ``materialized`` source gets ``ingest.replay.build_replay_plan``'s plan instead.
    """
    if any(s.kind == "materialized" for s in config.sources):
        from ingest.replay import build_replay_plan  # noqa: PLC0415 (replay imports this module)

        return build_replay_plan(config)
    files: list[FileInfo] = []
    file_source: list[int] = []
    skipped: list[tuple[str, str, str]] = []
    missing: list[str] = []
    jobs: list[tuple[int, str | FileInfo]] = []  # (source, path or an in-memory table's info)
    for si, src in enumerate(config.sources):
        if src.table is not None:
            jobs.append((si, describe_table(f"memory:sources[{si}]", src.table, src.column,
                                            src.table_key(),
                                            tokens=src.tokens_column is not None)))
            continue
        try:
            jobs.extend((si, p) for p in list_files(src.paths, src.format))
        except FileNotFoundError as e:
            missing.append(f"sources[{si}]: {e}")
    if missing:
        raise FileNotFoundError("\n".join(missing))
    # _describe_all stops at the first error raised here, so it may be the shorter.
    for (si, p), info in zip(jobs, _describe_all(config, jobs), strict=False):
        if isinstance(info, BadInputError):
            # A missing or mistyped column is a config mistake, never skipped silently.
            if config.on_bad_file == "skip" and info.reason == "corrupt_file":
                skipped.append((p, info.reason, str(info)))
                continue
            raise info
        files.append(info)
        file_source.append(si)

    units: list[Unit] = []
    for fi, info in enumerate(files):
        for g, (rows, nbytes) in enumerate(zip(info.row_groups, info.group_bytes, strict=True)):
            if rows == 0:
                continue
            parts = -(-rows // config.unit_rows)
            bounds = np.linspace(0, rows, parts + 1).round().astype(int)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                units.append(Unit(source=file_source[fi], file=fi, group=g, row_start=int(a),
                                  row_end=int(b), nbytes=max(1, nbytes * int(b - a) // rows)))
    if not units:
        srcs = ", ".join(str(list(s.paths)) for s in config.sources)
        raise ValueError(f"the corpus is empty: sources {srcs} hold no rows"
                         + (f" ({len(skipped)} file(s) skipped as bad)" if skipped else "")
                         + "; point sources[].paths at files with data")
    if len(config.sources) > 1:
        # A mixture deals each source's units to every stream: each needs num_streams units.
        short = [(si, n) for si in range(len(config.sources))
                 if (n := sum(u.source == si for u in units)) < config.num_streams]
        if short:
            raise ValueError(
                "in a mixture every source's units are dealt to all num_streams="
                f"{config.num_streams} streams, but " + ", ".join(
                    f"sources[{si}] has {n} unit(s)" for si, n in short)
                + f"; lower unit_rows (now {config.unit_rows}) or num_streams, or add data")
    if len(units) < config.num_streams:
        raise ValueError(
            f"the plan has {len(units)} unit(s) for num_streams={config.num_streams}: some streams "
            f"would get no data. Lower unit_rows (now {config.unit_rows}; the corpus has "
            f"{sum(u.num_rows for u in units)} rows) or num_streams, or add data.")
    _report_large_groups(files, config.unit_rows)
    blob = json.dumps([[f.path, f.format, f.size, list(f.row_groups), f.content_key]
                       for f in files]
                      + [[s.text_column for s in config.sources]]
                      + [config.unit_rows]
                      + ([[s.tokens_column for s in config.sources]]
                         if any(s.tokens_column for s in config.sources) else []))
    return UnitPlan(files=tuple(files),
                    text_columns=tuple(s.column for s in config.sources),
                    units=tuple(units), skipped_files=tuple(skipped),
                    fingerprint=hashlib.sha256(blob.encode()).hexdigest()[:16],
                    pretokenized=tuple(s.tokens_column is not None for s in config.sources))


_DESCRIBE_THREADS = 16
_PROGRESS_EVERY_S = 10.0


def _describe_all(config: Config, jobs: list[tuple[int, str | FileInfo]]
                  ) -> list[FileInfo | BadInputError]:
    """Each job's FileInfo (or its BadInputError), in order, up to the first error that is
    not skipped. Files are read by a pool of threads, since each costs round trips on object
    stores (Parquet and IPC footers) or a whole read (JSONL). Logs progress on long plans.
    """
    def describe(job: tuple[int, str | FileInfo]) -> FileInfo | BadInputError:
        si, p = job
        if isinstance(p, FileInfo):
            return p
        src = config.sources[si]
        try:
            return describe_file(p, src.format, src.column, tokens=src.tokens_column is not None)
        except BadInputError as e:
            return e

    out: list[FileInfo | BadInputError] = []
    start = last = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(_DESCRIBE_THREADS, len(jobs))),
                                               thread_name_prefix="ingest-plan") as pool:
        for future in [pool.submit(describe, job) for job in jobs]:
            out.append(info := future.result())
            if isinstance(info, BadInputError) and not (config.on_bad_file == "skip"
                                                        and info.reason == "corrupt_file"):
                pool.shutdown(cancel_futures=True)  # this error ends the plan
                break
            if time.monotonic() - last > _PROGRESS_EVERY_S:
                last = time.monotonic()
                log.info("planning: read the metadata of %d of %d files (%.0f s)", len(out),
                         len(jobs), last - start)
    if last > start:
        log.info("planning: read the metadata of %d files in %.1f s", len(jobs),
                 time.monotonic() - start)
    return out


def _report_large_groups(files: list[FileInfo], unit_rows: int) -> None:
    """Logs the Parquet row groups (and JSONL files, each one group) that units split and that
    are too large to keep decoded in memory: each is decoded once per machine and kept on disk
    (``ingest.spill``); past the disk budget, once per unit of it, which is slow, so that is a
    warning."""
    large = [(nbytes, info.path, g, rows) for info in files if info.format in ("parquet", "jsonl")
             for g, (rows, nbytes) in enumerate(zip(info.row_groups, info.group_bytes,
                                                    strict=True))
             if nbytes > LARGE_GROUP_BYTES and rows > unit_rows]
    if not large:
        return
    budget = spill.budget_bytes()  # raises on a malformed setting, here rather than in a worker
    total = sum(n for n, _, _, _ in large)
    nbytes, path, g, rows = max(large)
    what = (f"{len(large)} Parquet row group(s) or JSONL file(s) hold over "
            f"{LARGE_GROUP_BYTES >> 20} MiB of text each ({total / 2**30:.2f} GiB in all; the "
            f"largest {nbytes / 2**20:.0f} MiB, {rows} rows: {path}, row group {g}) and are read "
            f"in units of unit_rows={unit_rows}")
    fix = ("Writing Parquet files with smaller row groups (pyarrow.parquet.write_table(..., "
           "row_group_size=1024)) avoids it")
    if total > budget:
        log.warning("%s; decoded row groups are kept on disk only up to "
                    "INGEST_ROW_GROUP_CACHE_GB=%.1f GiB, and those past it are decoded again "
                    "for each unit of them, which is slow. %s, or raise the budget.",
                    what, budget / 2**30, fix)
    else:
        log.info("%s; each is decoded once per machine and kept under %s. %s.", what,
                 spill.folder(), fix)


def deal_units(plan: UnitPlan, *, num_streams: int, seed: int, epoch: int,
               shuffle: bool, source: int | None = None) -> list[list[int]]:
    """The unit indices each stream reads in ``epoch``, in reading order.

    ``source`` deals only that source's units (the streams of one mixture component); None
    deals every unit (sources pooled).
    """
    ids = np.arange(len(plan.units))
    if source is not None:
        ids = ids[np.fromiter((u.source == source for u in plan.units), dtype=bool,
                              count=len(plan.units))]
    n = len(ids)
    nbytes = np.fromiter((plan.units[i].nbytes for i in ids.tolist()), dtype=np.int64, count=n)
    # Keys of pooled plans stay as they were, so their batches do not change.
    key = () if source is None else (source,)
    if shuffle:
        order = philox(seed, epoch, 0x0D3A1, *key).permutation(n)
        size_class = np.floor(np.log2(np.maximum(nbytes[order], 1))).astype(np.int64)
        order = order[np.argsort(-size_class, kind="stable")]
    else:
        order = np.arange(n)
    heap = [(0, s) for s in range(num_streams)]
    dealt: list[list[int]] = [[] for _ in range(num_streams)]
    for u in order.tolist():
        load, s = heapq.heappop(heap)
        dealt[s].append(int(ids[u]))
        heapq.heappush(heap, (load + int(nbytes[u]), s))
    if shuffle:
        # Sorted first, so a stream's reading order depends only on the units it holds, not
        # on the byte estimates that ordered the deal.
        dealt = [[units[i] for i in philox(seed, epoch, 0x0D3A2, s, *key).permutation(len(units))]
                 for s, units in enumerate(sorted(d) for d in dealt)]
    return dealt
