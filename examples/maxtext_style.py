"""A MaxText-style input loop: per-host numpy batches, global arrays formed by the loop.

    python examples/maxtext_style.py --steps 20 --checkpoint-dir /tmp/ckpt-maxtext --backend local

MaxText's input pipeline hands each host its own rows and turns them into global arrays on the
training mesh with ``jax.make_array_from_process_local_data``; its checkpoints save the host's
grain iterator with grain's handler. ``FeedIterator(..., host_local=True)`` is such an iterator:
each ``next`` gives this host's rows of the step (``[rows, seq_len]`` numpy per field, the rows
its devices hold under ``sharding``), and its state is the feed's. Run the command again with
more ``--steps`` and it resumes from the latest checkpoint on exactly the batches an unbroken run
would have seen next.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from ingest import step_digest
from ingest.config import Config
from ingest.demo import demo_config
from jax_side import FeedIterator, batch_sharding


def global_batch(local: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding,
                 global_rows: int) -> dict[str, jax.Array]:
    """What the stack's own data loader does with a host's rows: one global array per field."""
    return {name: jax.make_array_from_process_local_data(
                sharding, rows, (global_rows, rows.shape[1]))
            for name, rows in local.items()}


def run(config: Config, *, steps: int, checkpoint_dir: str, checkpoint_every: int = 5,
        backend: str = "local") -> dict[str, Any]:
    """Trains (a stand-in step) until ``steps``, resuming from ``checkpoint_dir``'s latest step.

    Returns:
      ``first_step`` (where this run began), ``step`` (where it ended) and ``digests`` (one
      ``ingest.step_digest`` per global batch of this run).
    """
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    sharding = batch_sharding(mesh, "data")
    it = FeedIterator(config, sharding=sharding, backend=backend, host_local=True)
    manager = ocp.CheckpointManager(os.path.abspath(checkpoint_dir))
    step = 0
    if manager.latest_step() is not None:
        step = manager.latest_step()
        manager.restore(step, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(it)))
    first_step, digests = step, []
    try:
        while step < steps:
            local = next(it, None)
            if local is None:
                break
            batch = global_batch(local, sharding, config.batch_size_at(step))
            digests.append(step_digest({k: np.asarray(v) for k, v in batch.items()}))
            step += 1
            if step % checkpoint_every == 0 or step == steps:
                manager.save(step, args=ocp.args.Composite(
                    data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
    finally:
        manager.close()
        it.close()
    return {"first_step": first_step, "step": step, "digests": digests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--backend", choices=("ray", "local"), default="ray")
    args = p.parse_args(argv)
    if args.backend == "ray":
        from actors.ray_cluster import start_ray

        start_ray(None)
    config = demo_config(seq_len=64, global_batch_size=8, num_streams=4, workers=2)
    out = run(config, steps=args.steps, checkpoint_dir=args.checkpoint_dir,
              checkpoint_every=args.checkpoint_every, backend=args.backend)
    print(f"steps {out['first_step']}..{out['step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
