"""The autoscale policy: grow the pool while the host waits for chunks, shrink it while chunks
sit ready and unused.

Evaluated every ``window_s`` on what the host saw in that window::

    host waited > 10% of the window for chunks      -> one worker more (up to max_workers)
    host waited < 1% and >= 90% of requests ready   -> one worker fewer (down to min_workers)
    otherwise, or in the window after a change      -> no change

The output never depends on it: streams move between workers without loss.
"""

from __future__ import annotations

import dataclasses

__all__ = ["AutoscalePolicy"]


@dataclasses.dataclass
class AutoscalePolicy:
    """Attributes:
      min_workers, max_workers: the bounds.
      window_s: seconds between decisions.
      grow_wait: wait fraction above which a worker is added.
      shrink_wait, shrink_ready: below this wait fraction, with at least this fraction of
        queued requests finished, a worker is removed.
    """

    min_workers: int
    max_workers: int
    window_s: float = 2.0
    grow_wait: float = 0.10
    shrink_wait: float = 0.01
    shrink_ready: float = 0.90
    _cooldown: bool = dataclasses.field(default=False, repr=False)

    def decide(self, *, workers: int, wait_fraction: float, ready_fraction: float) -> int:
        """The worker count for the next window."""
        if self._cooldown:
            self._cooldown = False
            return workers
        target = workers
        if wait_fraction > self.grow_wait and workers < self.max_workers:
            target = workers + 1
        elif (wait_fraction < self.shrink_wait and ready_fraction >= self.shrink_ready
              and workers > self.min_workers):
            target = workers - 1
        target = max(self.min_workers, min(self.max_workers, target))
        self._cooldown = target != workers
        return target
