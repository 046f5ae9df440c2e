"""The plan's units: ``Unit`` (a fixed slice of one row group of one file), ``Units`` (all of
them as numpy arrays) and ``UnitPlan`` (the units with the files they come from).

``ingest.plan.build`` builds them and ``ingest.plan.deal`` deals them; streams, replay and checkpoints
only read them.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import operator
from collections.abc import Iterable, Iterator
from typing import Any, overload

import numpy as np

from ingest.sources.files import FileInfo

__all__ = ["UNIT_FIELDS", "Unit", "UnitPlan", "Units"]


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


UNIT_FIELDS = ("source", "file", "group", "row_start", "row_end", "nbytes")
_NARROW = ("source", "file", "group")  # int32; row bounds and bytes are int64


class Units(collections.abc.Sequence):
    """The plan's units, stored as one numpy array per field of ``Unit``.

    ``units[i]`` is a ``Unit``; the arrays (``units.nbytes``, ``units.source`` ...) serve
    vectorized work. They take a fraction of the memory of as many ``Unit`` objects, and
    pickle as six buffers, which Ray hands to every worker of a node from its
    object store without a copy.
    """

    __slots__ = UNIT_FIELDS
    source: np.ndarray
    file: np.ndarray
    group: np.ndarray
    row_start: np.ndarray
    row_end: np.ndarray
    nbytes: np.ndarray

    def __init__(self, source: Any, file: Any, group: Any, row_start: Any, row_end: Any,
                 nbytes: Any) -> None:
        n = None
        for name, values in zip(UNIT_FIELDS, (source, file, group, row_start, row_end, nbytes),
                                strict=True):
            arr = np.asarray(values, dtype=np.int32 if name in _NARROW else np.int64)
            if arr.ndim != 1 or (n is not None and len(arr) != n):
                raise ValueError(f"Units: {name} must be one-dimensional like the other fields")
            n = len(arr)
            if arr.flags.writeable:
                arr = arr.copy() if arr is values else arr
                arr.flags.writeable = False
            object.__setattr__(self, name, arr)

    @classmethod
    def of(cls, units: Iterable[Unit]) -> Units:
        """``Units`` holding these units, in order."""
        units = list(units)
        return cls(*([getattr(u, name) for u in units] for name in UNIT_FIELDS))

    @property
    def num_rows(self) -> np.ndarray:
        return self.row_end - self.row_start

    def __len__(self) -> int:
        return len(self.nbytes)

    @overload
    def __getitem__(self, i: int) -> Unit: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Unit, ...]: ...
    def __getitem__(self, i: int | slice) -> Unit | tuple[Unit, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        i = operator.index(i)
        return Unit(int(self.source[i]), int(self.file[i]), int(self.group[i]),
                    int(self.row_start[i]), int(self.row_end[i]), int(self.nbytes[i]))

    def __iter__(self) -> Iterator[Unit]:
        for fields in zip(*(getattr(self, name).tolist() for name in UNIT_FIELDS), strict=True):
            yield Unit(*fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Units):
            return NotImplemented
        return all(np.array_equal(getattr(self, n), getattr(other, n)) for n in UNIT_FIELDS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n).tobytes() for n in UNIT_FIELDS))

    def __repr__(self) -> str:
        return f"Units(<{len(self)} units>)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Units, tuple(getattr(self, n) for n in UNIT_FIELDS))


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """All units of the corpus.

    Attributes:
      files: every usable file, in source then path order.
      text_columns: per source.
      units: every unit, in file order (``Units``: indexing gives a ``Unit``).
      skipped_files: (path, reason, message) for files skipped under ``on_bad_file: skip``.
      fingerprint: hash of the files and their metadata.
      pretokenized: per source, whether its column holds token ids (``tokens_column``).
      content_fingerprint: the same hash with each file's path relative to the folder its
        source's files share, so that a corpus moved elsewhere (another bucket, a local
        mirror) keeps it; empty where not computed (a materialized plan).
    """

    files: tuple[FileInfo, ...]
    text_columns: tuple[str, ...]
    units: Units
    skipped_files: tuple[tuple[str, str, str], ...]
    fingerprint: str
    pretokenized: tuple[bool, ...] = ()
    content_fingerprint: str = ""

    @property
    def total_rows(self) -> int:
        return int(self.units.num_rows.sum())
