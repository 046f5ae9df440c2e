"""A Levanter-style loop: global batches in, the train state and the feed state checkpointed
under one step number, and a restart that resumes from a step number.

    python examples/levanter_style.py --steps 20 --checkpoint-dir /tmp/ckpt-levanter --backend local

Levanter's trainer takes a loader of global, sharded batches and, on restart, asks for the
batches from the step of its latest checkpoint. ``HostFeed`` yields global ``jax.Array``s on the
loop's sharding; the feed's position is not a function of the step number alone (how many rows a
document gives depends on the tokenizer and packing), so the feed state is saved in the same
checkpoint step (``jax_side.checkpoint.FeedSave``), and ``feed_from_step`` is the loader's
"from step N": the feed as saved at checkpoint step N, or, for a step without a saved state, the
last saved state before it read forward to step N.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ingest import step_digest
from ingest.config import Config
from ingest.demo import demo_config
from jax_side import HostFeed, batch_sharding, checkpoint
from jax_side.host_local import fast_forward


def feed_from_step(config: Config, sharding: jax.sharding.NamedSharding,
                   manager: ocp.CheckpointManager, step: int, backend: str) -> HostFeed:
    """The feed positioned after global step ``step``: the feed state saved at checkpoint step
    ``step`` (every process's file merged, so the job may restart on another number of hosts);
    for a step without one, the latest saved state before it read forward to ``step``
    (``host_local.fast_forward``: exact, at the cost of reading the steps in between)."""
    saved = [s for s in manager.all_steps() if s <= step]
    state = checkpoint.restore_feed(manager, max(saved)) if saved else None
    if state is not None and state["step"] != max(saved):
        raise ValueError(f"checkpoint step {max(saved)} holds the feed state of step "
                         f"{state['step']}; save the feed at the step it serves")
    if step and (state is None or state["step"] < step):
        state = fast_forward(config, sharding=sharding, step=step, backend=backend, state=state)
    feed = HostFeed(config, sharding=sharding, backend=backend)
    if state is not None:
        feed.set_state(state)
    return feed


def run(config: Config, *, steps: int, checkpoint_dir: str, checkpoint_every: int = 5,
        backend: str = "local") -> dict[str, Any]:
    """Trains (a stand-in step: tokens seen) until ``steps``, resuming from the latest step.

    Returns:
      ``first_step``, ``step`` (where this run began and ended), ``tokens_seen`` (over the whole
      run, restored with the train state) and ``digests`` (one per batch of this run).
    """
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    sharding = batch_sharding(mesh, "data")
    manager = checkpoint.open_manager(checkpoint_dir)
    train_state = {"tokens_seen": np.zeros((), np.int64)}
    step = manager.latest_step() or 0
    if step:
        train_state = manager.restore(step, args=ocp.args.Composite(
            train_state=ocp.args.StandardRestore(train_state)))["train_state"]
    first_step, digests = step, []
    with feed_from_step(config, sharding, manager, step, backend) as feed:
        for batch in feed:
            if step == steps:
                break
            digests.append(step_digest({k: np.asarray(v) for k, v in batch.items()}))
            tokens = int(jax.numpy.count_nonzero(batch["inputs_segmentation"]))
            train_state = {"tokens_seen": train_state["tokens_seen"] + tokens}
            step += 1
            if step % checkpoint_every == 0 or step == steps:
                manager.save(step, args=ocp.args.Composite(
                    train_state=ocp.args.StandardSave(train_state),
                    feed=checkpoint.FeedSave(feed.get_state())))
    manager.wait_until_finished()
    manager.close()
    return {"first_step": first_step, "step": step, "digests": digests,
            "tokens_seen": int(train_state["tokens_seen"])}


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
    print(f"steps {out['first_step']}..{out['step']}; tokens seen {out['tokens_seen']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
