"""Streams whose worker is gone and whose replacement has no CPU: where they go meanwhile
(the functions ``actors.recovery`` uses).

When a whole node is lost, its CPUs go with it: a replacement worker may wait for a CPU until
a node joins or comes back. The streams of the lost worker must not wait with it while another
worker runs, so they are reopened on the workers still running (the least loaded first), and
the replacement takes its share once it starts. Only when no worker runs at all does the pool
wait, for the first replacement to start: without a deadline (an autoscaler may take minutes
to add a node), with a warning every ``get_timeout_s`` that names the streams waiting and says
what would end it. A replacement that dies before it starts (placed on a node being lost) is
replaced in turn.

Example: 2 workers on 3 one-CPU nodes; the 2 nodes holding them are lost::

    worker a (node 1, streams 0-3) lost -> replacement a' starts on node 3
    worker b (node 2, streams 4-7) lost -> replacement b' waits for a CPU;
                                           streams 4-7 move to a' (a' holds 0-7)
    a node joins                        -> b' starts and takes streams 4-7 back
"""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["REPLACEMENT_START_S", "sort_started", "spread", "started"]

# How long a replacement may take to start before its streams go to the workers still running:
# far beyond a worker's start on a busy machine, so one not started by then waits for a CPU (a
# lost node took it).
REPLACEMENT_START_S = 10.0


def started(where: ray.ObjectRef, timeout_s: float) -> bool:
    """Whether the worker whose ``where()`` call is ``where`` starts within ``timeout_s`` (a
    worker that died starting counts as started: its next call fails and replaces it)."""
    ready, _ = ray.wait([where], num_returns=1, timeout=timeout_s)
    return bool(ready)


def sort_started(wheres: list[ray.ObjectRef], timeout_s: float) -> tuple[list[int], list[int]]:
    """Waits up to ``timeout_s`` until a pending worker starts or dies (none: returns at once).

    Args:
      wheres: the pending workers' ``where()`` refs.
      timeout_s: the longest wait for the first to start or die.

    Returns:
      The indices into ``wheres`` of the workers started, and of those that died before they
      started (placed on a node that was lost, say).
    """
    if timeout_s > 0:
        ray.wait(wheres, num_returns=1, timeout=timeout_s)
    ready, _ = ray.wait(wheres, num_returns=len(wheres), timeout=0)
    ready = set(ready)
    up, died = [], []
    for i, where in enumerate(wheres):
        if where not in ready:
            continue
        try:
            ray.get(where, timeout=0)
            up.append(i)
        except ray.exceptions.RayError:
            died.append(i)
    return up, died


def spread(streams: list[int], load: dict[Any, list[int]]) -> list[tuple[int, Any]]:
    """``(stream, worker key)`` for each of ``streams``, each onto the worker of ``load``
    (worker key -> its streams) that holds the fewest at that point; updates ``load``."""
    moves = []
    for t in streams:
        idlest = min(load, key=lambda k: len(load[k]))
        load[idlest].append(t)
        moves.append((t, idlest))
    return moves
