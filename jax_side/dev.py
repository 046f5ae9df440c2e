"""``ingest-dev``: the ``ingest`` command with the development and simulation flags of ``run``.

They are for the tests, the benchmarks and trying things, not for a user's job, so the
``ingest`` command does not take them:

- ``--step-time SECONDS``: a simulated training step after each batch (the summary then
  reports the stall behind it);
- ``--kill-worker-every SECONDS``: fault injection, SIGKILL a random Ray worker this often (the
  batches must not change);
- ``--hosts N [--devices-per-host D]``: N local JAX processes on 127.0.0.1 running the same
  command, with one summary (``jax_side.local_hosts``).

Everything else is ``ingest``'s: ``ingest-dev run CONFIG --step-time 0.01 --json`` (or
``python -m jax_side.dev run ...``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Lab", "main"]


class Lab:
    """What ``ingest-dev run`` adds to a run's loop: the simulated training step and the
    worker killer.

    Args:
      step_time_s: seconds to sleep after each batch (0: none).
      kill_worker_every_s: SIGKILL a random Ray worker this often (None: never).
    """

    def __init__(self, *, step_time_s: float = 0.0, kill_worker_every_s: float | None = None):
        self._step_time = step_time_s
        self._kill_every = kill_worker_every_s
        self._killer: Any = None

    def start(self, feed: Any) -> None:
        """Before the first batch of ``feed`` (a ``HostFeed``)."""
        if self._kill_every:
            from actors.faults import WorkerKiller  # noqa: PLC0415 (imports Ray)

            self._killer = WorkerKiller(self._kill_every)

    def after_batch(self) -> None:
        if self._step_time:
            time.sleep(self._step_time)  # the simulated training step

    def stop(self) -> None:
        if self._killer is not None:
            self._killer.stop()

    def stats(self) -> dict[str, Any]:
        """The summary's entries: ``workers_killed`` with ``--kill-worker-every``."""
        return {} if self._killer is None else {"workers_killed": self._killer.killed}


def main(argv: list[str] | None = None) -> int:
    """The ``ingest-dev`` console script."""
    from jax_side.run import main as run_main  # noqa: PLC0415

    return run_main(argv, dev=True, make_lab=Lab)


if __name__ == "__main__":
    sys.exit(main())
