"""The deal: which units of the plan each stream reads in an epoch, and in what order.

Each epoch, units are permuted with a generator keyed by (seed, epoch) and dealt to streams so
that streams get similar byte counts (``ingest.plan.build`` cuts the units)::

    units        u0 [0,256) u1 [256,512) u2 [512,600)  u3 [600,900)  u4 [0,250) u5 [250,500)
    epoch e      permute with key (seed, epoch)       -> u3 u0 u5 u2 u4 u1
                 stable-sort by size class, largest first (classes are powers of 2 of bytes)
    deal S=2     each unit goes to the stream with the fewest bytes so far (ties: lowest id)
    read order   each stream's units, permuted with key (seed, epoch, stream)
                 s0: u2 u3 u1 ...   s1: u5 u0 u4 ...

Dealing large units first bounds the byte imbalance between streams by about the smallest
units' size (streams of a finite epoch that end early are padded, so balance is less padding);
the random order inside each size class and the final shuffle keep every epoch's assignment
and reading order random. With ``shuffle: false`` units are dealt in file order, unsorted.

``deal: row_groups`` deals runs instead of units: a row group's consecutive units (all of
them, or near-equal parts of at most ceil(units / (4 x streams)) units, so that every stream
gets work), each read by one stream in row order, so that a group is decoded once a pass
(``ingest.sources.files``)::

    runs         [u0 u1 u2]  [u3]  [u4 u5]        (each group one run here)
    epoch e      permute, sort by size class, deal by bytes, per-stream permute, as above
    read order   s0: u3 u0 u1 u2    s1: u4 u5
"""

from __future__ import annotations

import hashlib
import heapq
import json
import threading

import numpy as np

from ingest.plan.units import UnitPlan, Units

__all__ = ["deal_units", "permutation", "philox"]


def philox(*key: int) -> np.random.Generator:
    """A counter-based generator keyed by integers (seed, epoch, unit...): same key, same draws."""
    return np.random.Generator(np.random.Philox(key=_key_words(key)))


def permutation(n: int, *key: int) -> np.ndarray:
    """``philox(*key).permutation(n)``, drawn from this thread's one generator set to that
    key's start: numpy's Philox constructor draws OS entropy first, which costs several times
    what setting the state does (and more than a unit's row order itself)."""
    gen = getattr(_THREAD, "gen", None)
    if gen is None:
        gen = _THREAD.gen = np.random.Generator(np.random.Philox(key=_key_words(key)))
    zeros = np.zeros(4, dtype=np.uint64)
    gen.bit_generator.state = {"bit_generator": "Philox",
                               "state": {"counter": zeros, "key": _key_words(key)},
                               "buffer": zeros, "buffer_pos": 4, "has_uint32": 0,
                               "uinteger": 0}
    return gen.permutation(n)


_THREAD = threading.local()


def _key_words(key: tuple[int, ...]) -> np.ndarray:
    digest = hashlib.sha256(json.dumps(list(key)).encode()).digest()
    return np.frombuffer(digest[:16], dtype=np.uint64)


def deal_units(plan: UnitPlan, *, num_streams: int, seed: int, epoch: int,
               shuffle: bool, source: int | None = None,
               deal: str = "units") -> list[np.ndarray]:
    """The unit indices each stream reads in ``epoch``, in reading order (int64 arrays).

    ``source`` deals only that source's units (the streams of one mixture component); None
    deals every unit (sources pooled). ``deal="row_groups"`` deals runs of consecutive units
    of one row group (``_runs``) instead of single units, and a stream reads each run's units
    one after another in row order.
    """
    ids = np.arange(len(plan.units))
    if source is not None:
        ids = ids[plan.units.source == source]
    if deal == "row_groups":
        run_start, run_end = _runs(plan.units, ids, num_streams)
    elif deal == "units":
        run_start = np.arange(len(ids))
        run_end = run_start + 1
    else:
        raise ValueError(f"deal={deal!r} must be 'units' or 'row_groups'")
    n = len(run_start)
    nbytes = np.concatenate([[0], np.cumsum(plan.units.nbytes[ids])])
    nbytes = nbytes[run_end] - nbytes[run_start]
    # A pooled plan (no source) keeps the empty key, which fixes its batches.
    key = () if source is None else (source,)
    if shuffle:
        order = permutation(n, seed, epoch, 0x0D3A1, *key)
        size_class = np.floor(np.log2(np.maximum(nbytes[order], 1))).astype(np.int64)
        order = order[np.argsort(-size_class, kind="stable")]
    else:
        order = np.arange(n)
    # Each run in turn to the stream with the fewest bytes so far (ties: the lowest id).
    heap = [(0, s) for s in range(num_streams)]
    to_stream = np.empty(n, np.int64)
    for i, size in enumerate(nbytes[order].tolist()):
        load, s = heap[0]
        heapq.heapreplace(heap, (load + size, s))
        to_stream[i] = s
    # The runs of each stream in dealing order (a stable sort keeps it).
    by_stream = np.argsort(to_stream, kind="stable")
    bounds = np.searchsorted(to_stream[by_stream], np.arange(num_streams + 1))
    runs = [order[by_stream[bounds[s]:bounds[s + 1]]] for s in range(num_streams)]
    if shuffle:
        # Sorted first, so a stream's reading order depends only on the runs it holds, not
        # on the byte estimates that ordered the deal.
        runs = [np.sort(r)[permutation(len(r), seed, epoch, 0x0D3A2, s, *key)]
                for s, r in enumerate(runs)]
    if deal == "units":
        return [ids[r] for r in runs]
    return [ids[_expand(run_start[r], run_end[r])] for r in runs]


# In deal="row_groups", a row group is split into runs only where the corpus has fewer than
# this many runs per stream, so that every stream gets work and similar bytes.
_RUNS_PER_STREAM = 4


def _runs(units: Units, ids: np.ndarray, num_streams: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs of ``ids`` (ascending unit indices): ``[start, end)`` positions in ``ids`` of
    consecutive units of one row group. A group of ``n`` units is one run, or ``ceil(n / L)``
    near-equal runs where ``L = ceil(len(ids) / (num_streams x _RUNS_PER_STREAM))`` is
    smaller than ``n``."""
    file, group = units.file[ids], units.group[ids]
    first = np.ones(len(ids), bool)
    first[1:] = (file[1:] != file[:-1]) | (group[1:] != group[:-1])
    starts = np.flatnonzero(first)
    lengths = np.diff(np.append(starts, len(ids)))
    most = max(1, -(-len(ids) // (num_streams * _RUNS_PER_STREAM)))
    parts = -(-lengths // most)
    g = np.repeat(np.arange(len(starts)), parts)
    j = np.arange(len(g)) - np.repeat(np.cumsum(parts) - parts, parts)
    n, p = lengths[g], parts[g]
    return starts[g] + j * n // p, starts[g] + (j + 1) * n // p


def _expand(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(start, end)])``, without the loop."""
    lengths = end - start
    offsets = np.repeat(start - (np.cumsum(lengths) - lengths), lengths)
    return offsets + np.arange(int(lengths.sum()))
