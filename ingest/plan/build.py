"""The unit plan: which slices of which files exist (the units), cut from the sources' files.

A *unit* is a fixed slice of one row group of one file. The plan is a pure function of the
sources' file lists, their metadata and ``unit_rows``; its fingerprint goes into every
checkpoint. ``ingest.plan.deal`` deals the units to streams, each epoch::

    row groups   f0:[0..600) f0:[600..900)  f1:[0..500)
    units        u0 [0,256) u1 [256,512) u2 [512,600)  u3 [600,900)  u4 [0,250) u5 [250,500)
                 (unit_rows=256: a row group of n rows splits into ceil(n/256) near-equal parts)
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import itertools
import json
import logging
import os
import time
from typing import Any

import numpy as np

from ingest.cache import read_entries, write_entries
from ingest.config import Config
from ingest.errors import BadInputError
from ingest.materialize.replay import build_replay_plan
from ingest.plan.units import UNIT_FIELDS as _UNIT_FIELDS
from ingest.plan.units import Unit, UnitPlan, Units
from ingest.sources import spill
from ingest.sources.files import LARGE_GROUP_BYTES, FileInfo, describe_file, describe_table
from ingest.sources.jsonl import GROUP_BYTES
from ingest.sources.paths import FileStamp, list_files, local_stamp

__all__ = ["Unit", "UnitPlan", "Units", "build_plan"]

log = logging.getLogger("ingest.plan.build")


def build_plan(config: Config) -> UnitPlan:
    """Lists and inspects every file of every source and cuts it into units.

    Raises:
      FileNotFoundError: any source path matches nothing (all listed).
      BadInputError: a file is unreadable or lacks a usable text column, unless
        ``on_bad_file: skip`` (then it is recorded in ``skipped_files``).
      ValueError: the corpus has no rows, or fewer units than ``num_streams``.

    A ``materialized`` source gets ``ingest.materialize.replay.build_replay_plan``'s plan instead.
    """
    if any(s.kind == "materialized" for s in config.sources):
        return build_replay_plan(config)
    files, file_source, skipped = _described_files(config)
    cut = _unit_rows_for_streams(files, file_source, config)
    units = _cut_units(files, file_source, cut)
    _check_units_fill_streams(config, units, skipped)
    _report_large_groups(files, min(cut.values(), default=config.unit_rows), config.deal)
    cut_rows: Any = config.unit_rows
    if any(r != config.unit_rows for r in cut.values()):
        cut_rows = [config.unit_rows, [cut.get(si) for si in range(len(config.sources))]]
    rest = ([[s.text_column for s in config.sources]] + [cut_rows]
            + ([[s.tokens_column for s in config.sources]]
               if any(s.tokens_column for s in config.sources) else []))

    described = [(f.format, f.size, list(f.row_groups), f.content_key) for f in files]

    def digest(paths: list[str]) -> str:
        blob = json.dumps([[p, *d] for p, d in zip(paths, described, strict=True)] + rest)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    return UnitPlan(files=tuple(files),
                    text_columns=tuple(s.column for s in config.sources),
                    units=units, skipped_files=tuple(skipped),
                    fingerprint=digest([f.path for f in files]),
                    pretokenized=tuple(s.tokens_column is not None for s in config.sources),
                    content_fingerprint=digest(_relative_paths(files, file_source)))


def _described_files(config: Config
                     ) -> tuple[list[FileInfo], list[int], list[tuple[str, str, str]]]:
    """Every source's files, described (in parallel), with the source of each, and the files
    skipped as bad (``on_bad_file: skip``) as (path, reason, message)."""
    files: list[FileInfo] = []
    file_source: list[int] = []
    skipped: list[tuple[str, str, str]] = []
    missing: list[str] = []
    jobs: list[tuple[int, str | FileInfo]] = []  # (source, path or an in-memory table's info)
    stamps: dict[str, FileStamp] = {}  # what the listings say of remote files
    for si, src in enumerate(config.sources):
        if src.table is not None:
            jobs.append((si, describe_table(f"memory:sources[{si}]", src.table, src.column,
                                            src.table_key(),
                                            tokens=src.tokens_column is not None)))
            continue
        unreadable: list[tuple[str, str]] = []
        try:
            jobs.extend((si, p) for p in list_files(src.paths, src.format, unreadable, stamps))
        except FileNotFoundError as e:
            missing.append(f"sources[{si}]: {e}")
        for path, why in unreadable:
            # A folder or link the listing cannot read is a bad file: never left out silently.
            error = BadInputError(f"sources[{si}]: {path}: {why}; fix its permissions or "
                                  f"remove it, or set on_bad_file: skip to skip it (counted)",
                                  reason="corrupt_file", path=path)
            if not _skipped(config, error):
                raise error
            skipped.append((path, error.reason, str(error)))
    if missing:
        raise FileNotFoundError("\n".join(missing))
    # _describe_all stops at the first error raised here, so it may be the shorter.
    for (si, p), info in zip(jobs, _describe_all(config, jobs, stamps), strict=False):
        if isinstance(info, BadInputError):
            if _skipped(config, info):
                skipped.append((p, info.reason, str(info)))
                continue
            raise info
        files.append(info)
        file_source.append(si)
    return files, file_source, skipped


def _check_units_fill_streams(config: Config, units: Units, skipped: list) -> None:
    """Refuses an empty corpus, a mixture source with fewer units than streams, and a plan
    with fewer units than streams (units are already cut down to fit where rows allow)."""
    if not len(units):
        srcs = ", ".join(str(list(s.paths)) for s in config.sources)
        raise ValueError(f"the corpus is empty: sources {srcs} hold no rows"
                         + (f" ({len(skipped)} file(s) skipped as bad)" if skipped else "")
                         + "; point sources[].paths at files with data")
    if len(config.sources) > 1:
        # A mixture deals each source's units to every stream: each needs num_streams units.
        short = [(si, n) for si in range(len(config.sources))
                 if (n := int(np.count_nonzero(units.source == si))) < config.num_streams]
        if short:
            raise ValueError(
                "in a mixture every source's units are dealt to all num_streams="
                f"{config.num_streams} streams, but " + ", ".join(
                    f"sources[{si}] has {n} unit(s) of "
                    f"{int(units.num_rows[units.source == si].sum())} row(s)" for si, n in short)
                + "; a source needs at least num_streams rows (units are cut down to one row "
                "each to fit). Lower num_streams, or add data")
    if len(units) < config.num_streams:
        raise ValueError(
            f"the plan has {len(units)} unit(s) for num_streams={config.num_streams}: the corpus "
            f"has {int(units.num_rows.sum())} row(s), fewer than the streams even in units of "
            f"one row, so some streams would get no data. Lower num_streams, or add data.")


def _relative_paths(files: list[FileInfo], file_source: list[int]) -> list[str]:
    """Each file's source index and path below the folder its source's files share."""
    roots = {}
    for si in set(file_source):
        paths = [f.path for f, s in zip(files, file_source, strict=True) if s == si]
        common = os.path.commonprefix(paths)
        roots[si] = common[:common.rfind("/") + 1]
    return [f"{si}:{f.path[len(roots[si]):]}" for f, si in zip(files, file_source, strict=True)]


def _units_per_group(rows: np.ndarray, unit_rows: int) -> int:
    """How many units row groups of ``rows`` rows give, cut into at most ``unit_rows`` each."""
    return int((-(-rows // unit_rows)).sum())


def _unit_rows_for_streams(files: list[FileInfo], file_source: list[int],
                           config: Config) -> dict[int, int]:
    """Each source's unit size: ``unit_rows``, or the largest smaller size that gives the
    streams a unit each where ``unit_rows`` gives fewer units than ``num_streams`` (every
    source of a mixture; all files of a single source). A function of the files' row counts
    only, so the plan (and every batch) stays a pure function of config and corpus::

        one file, row groups of 300 and 200 rows, unit_rows=256, num_streams=8
        unit_rows 256 -> 2 + 1 = 3 units < 8;  the largest size giving >= 8: 74 -> 5 + 3 = 8

    A source with fewer rows than ``num_streams`` keeps ``unit_rows`` (the plan then fails,
    saying so).
    """
    rows_of: dict[int, list[np.ndarray]] = {}
    for info, si in zip(files, file_source, strict=True):
        rows_of.setdefault(si, []).append(np.asarray(info.row_groups, np.int64))
    out = {}
    for si, parts in sorted(rows_of.items()):
        rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        rows = rows[rows > 0]
        size = config.unit_rows
        if (_units_per_group(rows, size) < config.num_streams
                and int(rows.sum()) >= config.num_streams):
            lo, hi = 1, size - 1  # units(1) = rows >= num_streams; find the largest size that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _units_per_group(rows, mid) >= config.num_streams:
                    lo = mid
                else:
                    hi = mid - 1
            where = "the corpus" if len(config.sources) == 1 else f"sources[{si}]"
            log.warning("%s has %d unit(s) of unit_rows=%d for num_streams=%d (%d rows): cutting "
                        "it into units of at most %d rows (%d units), so that every stream gets "
                        "data. Set unit_rows <= %d to choose this yourself.", where,
                        _units_per_group(rows, size), size, config.num_streams, int(rows.sum()),
                        lo, _units_per_group(rows, lo), lo)
            size = lo
        out[si] = size
    return out


def _cut_units(files: list[FileInfo], file_source: list[int],
               unit_rows: int | dict[int, int]) -> Units:
    """Every row group of ``n`` rows cut into ``ceil(n / unit_rows)`` near-equal units, in file
    and group order; a unit's bytes are its share of its group's, at least 1. ``unit_rows``
    may differ per source (a dict by source index)."""
    counts = np.fromiter((len(info.row_groups) for info in files), np.int64, len(files))
    if not counts.sum():
        return Units(*([] for _ in _UNIT_FIELDS))
    rows = np.fromiter(itertools.chain.from_iterable(info.row_groups for info in files),
                       np.int64, int(counts.sum()))
    group_bytes = np.fromiter(itertools.chain.from_iterable(info.group_bytes for info in files),
                              np.int64, len(rows))
    # Every row group of every file at once: its file, source and index in its file.
    file_of = np.repeat(np.arange(len(files)), counts)
    source_of = np.asarray(file_source, np.int64)[file_of]
    index_of = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    if isinstance(unit_rows, int):
        size: int | np.ndarray = unit_rows
    else:
        by_source = np.zeros(int(source_of.max()) + 1, np.int64)
        for si in np.unique(source_of).tolist():
            by_source[si] = unit_rows[si]
        size = by_source[source_of]
    parts = -(-rows // size)
    gs = np.repeat(np.arange(len(rows)), parts)
    # Part j of a group of n rows in p parts starts at round(j * n / p) (np.linspace's
    # points, rounded half to even), so the bounds are the same as cutting each group alone.
    j = np.arange(len(gs)) - np.repeat(np.cumsum(parts) - parts, parts)
    n, p = rows[gs], parts[gs]
    a = np.round(j * (n / p)).astype(np.int64)
    b = np.where(j + 1 == p, n, np.round((j + 1) * (n / p)).astype(np.int64))
    return Units(source_of[gs].astype(np.int32), file_of[gs].astype(np.int32),
                 index_of[gs].astype(np.int32), a, b,
                 np.maximum(1, group_bytes[gs] * (b - a) // np.maximum(n, 1)))


# Describing a local file is work for the CPUs (a footer parse, a JSONL scan); on an object
# store it is mostly waiting for a round trip or two, so many more requests are kept in flight
# there (each thread holds at most a file's two 64 KiB ends and its footer).
_DESCRIBE_THREADS = 16
_REMOTE_DESCRIBE_THREADS = 64
_PROGRESS_EVERY_S = 10.0
# A file's description is kept for later plans (ingest.cache) under its path and stamp
# (``FileStamp``: size, and ETag or modification time). A time identifies the content only
# once it is older than the clock's resolution (a second on S3) plus the skew between this
# machine's clock and the store's: files changed less than this before the plan are
# described again by the next one.
_SETTLE_S = 60.0
_CACHE_KIND = "plan-files"


def _cache_name(config: Config, si: int) -> str:
    """The name of source ``si``'s kept descriptions: they depend on its paths, format and
    column, and on how ``describe_file`` describes (JSONL's group size)."""
    src = config.sources[si]
    blob = json.dumps(["describe-2", GROUP_BYTES, list(src.paths), src.format, src.column,
                       src.tokens_column is not None])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _describe_all(config: Config, jobs: list[tuple[int, str | FileInfo]],
                  stamps: dict[str, FileStamp]) -> list[FileInfo | BadInputError]:
    """Each job's FileInfo (or its BadInputError), in order, up to the first error that is
    not skipped.

    A file whose stamp (from its listing, or ``local_stamp``) is what an earlier plan
    described it under gets that plan's FileInfo without a read. The others are read by a
    pool of threads, a bounded number of files ahead, since each costs round trips on object
    stores (Parquet and IPC footers) or a whole read (JSONL); their descriptions are kept for
    the next plan. Logs progress on long plans.
    """
    now = time.time()
    out: list[FileInfo | BadInputError | None] = [None] * len(jobs)
    # By source, what earlier plans kept: {path: (size, version, and FileInfo's format,
    # row_groups, group_bytes, content_key, group_offsets)}, plain values (fast to load).
    kept: dict[int, dict] = {}
    fresh: dict[int, dict] = {}  # by source: what this plan keeps
    stamp_of: dict[int, FileStamp] = {}
    unversioned: dict[int, str] = {}  # by source: a file whose store gives no version
    todo: list[int] = []
    hits = 0
    for i, (si, p) in enumerate(jobs):
        if isinstance(p, FileInfo):
            out[i] = p
            continue
        stamp = stamps.get(p) or local_stamp(p)
        if stamp is None or stamp.version is None:
            unversioned.setdefault(si, p)
        elif stamp.settled(now, _SETTLE_S):
            stamp_of[i] = stamp
            if si not in kept:
                kept[si] = read_entries(_CACHE_KIND, _cache_name(config, si))
                fresh[si] = {}
            hit = kept[si].get(p)
            if hit is not None and hit[0] == stamp.size and hit[1] == stamp.version:
                out[i] = FileInfo(path=p, format=hit[2], size=stamp.size, row_groups=hit[3],
                                  group_bytes=hit[4], content_key=hit[5], group_offsets=hit[6])
                fresh[si][p] = hit
                hits += 1
                continue
        if stamp is not None:
            stamp_of.setdefault(i, stamp)
        todo.append(i)
    for si, p in sorted(unversioned.items()):
        log.info("planning: sources[%d]: the store gives neither a modification time nor an "
                 "ETag or version for its files (e.g. %s), so nothing tells that one is "
                 "unchanged: their metadata is read by every plan, never cached", si, p)

    added: set[int] = set()  # sources with descriptions to keep that were not kept

    def describe(i: int) -> FileInfo | BadInputError:
        si, p = jobs[i]
        src = config.sources[si]
        stamp = stamp_of.get(i)
        try:
            info = describe_file(p, src.format, src.column, tokens=src.tokens_column is not None,
                                 size=None if stamp is None else stamp.size)
        except BadInputError as e:
            return e
        if si in fresh and stamp is not None and stamp.settled(now, _SETTLE_S):
            fresh[si][p] = (stamp.size, stamp.version, info.format, info.row_groups,
                            info.group_bytes, info.content_key, info.group_offsets)
            added.add(si)
        return info

    remote = any(isinstance(p, str) and "://" in p and not p.startswith("file://")
                 for _, p in jobs)
    threads = max(1, min(_REMOTE_DESCRIBE_THREADS if remote else _DESCRIBE_THREADS, len(todo)))
    start = last = time.monotonic()
    stop = len(jobs)
    read = 0
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ingest-plan") as pool:
        ahead = iter(todo)
        window = collections.deque((i, pool.submit(describe, i))
                                   for i in itertools.islice(ahead, 4 * threads))
        while window:
            i, future = window.popleft()
            out[i] = info = future.result()
            read += 1
            if isinstance(info, BadInputError) and not _skipped(config, info):
                stop = i + 1
                pool.shutdown(cancel_futures=True)  # this error ends the plan
                break
            if (j := next(ahead, None)) is not None:
                window.append((j, pool.submit(describe, j)))
            if time.monotonic() - last > _PROGRESS_EVERY_S:
                last = time.monotonic()
                rate = read / (last - start)
                log.info("planning: read the metadata of %d of %d files (%d more from the "
                         "cache of an earlier plan), %.0f files/s, about %.0f s left", read,
                         len(todo), hits, rate, (len(todo) - read) / rate)
    for si, entries in fresh.items():
        if stop < len(jobs):
            entries = {**kept[si], **entries}  # keep what this plan did not get to
        if si in added or len(entries) != len(kept[si]):
            write_entries(_CACHE_KIND, _cache_name(config, si), entries)
    if last > start or hits:
        log.info("planning: read the metadata of %d files in %.1f s: %d from the files, %d "
                 "from the cache of an earlier plan (size and version unchanged)", len(jobs),
                 time.monotonic() - start, read, hits)
    return out[:stop]


def _skipped(config: Config, error: BadInputError) -> bool:
    """Whether the plan skips the file of ``error``: only unreadable files, and only under
    ``on_bad_file: skip``; a missing or mistyped column is a config mistake, never skipped."""
    return config.on_bad_file == "skip" and error.reason == "corrupt_file"


def _report_large_groups(files: list[FileInfo], unit_rows: int, deal: str = "units") -> None:
    """Logs the Parquet row groups (and JSONL files, each one group) that units split and that
    are too large to keep decoded in memory: each is decoded once per machine and kept on disk
    (``ingest.sources.spill``); past the disk budget, once per unit of it, which is slow, so that is a
    warning that names ``deal: row_groups``, which decodes each group once a pass as it is
    read (and keeps no disk copies: nothing to report then). Also says when the smaller split
    groups together exceed what a worker keeps decoded (``4 x LARGE_GROUP_BYTES``): then most
    units of them decode their group again under ``deal: units``."""
    if deal == "row_groups":
        return
    split = [nbytes for info in files if info.format in ("parquet", "jsonl")
             for rows, nbytes in zip(info.row_groups, info.group_bytes, strict=True)
             if nbytes <= LARGE_GROUP_BYTES and rows > unit_rows]
    if sum(split) > 4 * LARGE_GROUP_BYTES:
        log.info("%d row group(s) split into units of unit_rows=%d hold %.2f GiB of text, more "
                 "than a worker keeps decoded (%d MiB): with deal: units a group's units are "
                 "read at different times, and most decode their group again. deal: row_groups "
                 "decodes each group once a pass, as its units are read in order.", len(split),
                 unit_rows, sum(split) / 2**30, 4 * LARGE_GROUP_BYTES >> 20)
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
                    "for each unit of them, which is slow. Set deal: row_groups (each group "
                    "is then decoded once a pass, as its units are read in order), or raise "
                    "the budget. %s too.", what, budget / 2**30, fix)
    else:
        log.info("%s; each is decoded once per machine and kept under %s. %s.", what,
                 spill.folder(), fix)
