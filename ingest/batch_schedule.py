"""The batch schedule: how many rows each global step takes, with a batch ramp-up.

A ramp-up ``{step: factor}`` multiplies ``global_batch_size`` from that 0-based step on. Every
stream gives ``k_t = B_t / S`` rows to step ``t``; the rows themselves never depend on the
schedule, only how they are batched::

    global_batch_size=8, num_streams=4, batch_rampup={0: 0.5, 2: 1.0}

    step t          0    1    2    3    4
    B_t             4    4    8    8    8
    k_t             1    1    2    2    2
    rows_before(t)  0    1    2    4    6      (rows one stream gave to steps 0..t-1)

    steps_covering(5)            = 4   (1 + 1 + 2 + 1 of 2)
    steps_covering(5, full=True) = 3   (the steps the 5 rows fill completely)

One object owns this arithmetic, so that the feed, the iterator length and the checks of a
saved state count rows the same way.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BatchSchedule"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSchedule:
    """Rows per global step, over all hosts.

    Attributes:
      global_batch_size: B, the rows of a step after the ramp-up.
      num_streams: S, which divides every step's rows.
      rampup: ``(step, factor)`` pairs sorted by step (a validated ``batch_rampup``); empty
        without a ramp-up.
    """

    global_batch_size: int
    num_streams: int
    rampup: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        steps = [s for s, _ in self.rampup]
        if steps != sorted(set(steps)):
            raise ValueError(f"rampup={self.rampup!r} must be sorted by step, each step once; "
                             f"build it from a validated Config (Config.schedule)")
        for size in self.sizes():
            if size <= 0 or size % self.num_streams:
                raise ValueError(f"a step of {size} rows is not a positive multiple of "
                                 f"num_streams={self.num_streams}; check batch_rampup")

    def factor_at(self, step: int) -> float:
        """The ramp-up factor of step ``step``: that of the largest key <= step, else 1."""
        factor = 1.0
        for at, f in self.rampup:
            if at > step:
                break
            factor = f
        return factor

    def size_at(self, step: int) -> int:
        """B_t: rows of global step ``step`` (0-based)."""
        return round(self.global_batch_size * self.factor_at(step))

    def rows_per_stream_at(self, step: int) -> int:
        """k_t = B_t / S: rows each stream gives to step ``step``."""
        return self.size_at(step) // self.num_streams

    def sizes(self) -> dict[int, str]:
        """Every step size the schedule uses, each with where it comes from (for errors)."""
        b = self.global_batch_size
        out = {b: f"global_batch_size={b}"}
        for at, f in self.rampup:
            out.setdefault(round(b * f), f"batch_rampup step {at}: global_batch_size={b} x "
                                         f"{f:g} = {round(b * f)} rows")
        return out

    def rows_before(self, step: int) -> int:
        """Rows one stream gives to steps ``0..step-1``."""
        total = t = 0
        for end in [*(k for k, _ in self.rampup if 0 < k < step), step]:
            total += (end - t) * self.rows_per_stream_at(t)
            t = end
        return total

    def steps_covering(self, rows: int, *, start: int = 0, full: bool = False) -> int:
        """Steps from ``start`` on that ``rows`` rows of one stream reach: the steps holding at
        least one of them, or with ``full`` the steps they fill completely."""
        if rows <= 0:
            return 0
        n, t, left = 0, start, rows
        for end in [*(k for k, _ in self.rampup if k > start), None]:
            k = self.rows_per_stream_at(t)
            need = left // k if full else -(-left // k)
            if end is None or need < end - t or (not full and need == end - t):
                return n + need
            n, left, t = n + end - t, left - (end - t) * k, end
            if left <= 0:
                return n
        raise AssertionError("unreachable: the last ramp-up segment is endless")
