"""A tiny language model trained on the feed, with model and feed checkpointed together.

    python examples/train.py --steps 30 --checkpoint-dir /tmp/ckpt [--backend local] [--config C]

Every ``--checkpoint-every`` steps one ``ocp.CheckpointManager`` saves the parameters and the
feed state into the same step directory (``ckpt/10/params``, ``ckpt/10/feed``). Run the command
again with more ``--steps`` and it resumes from the latest checkpoint: the model continues from
its saved parameters on exactly the batches an unbroken run would have seen next, so the losses
match the unbroken run's step for step.

The model (tied embedding, one residual tanh layer, no attention) only shows the wiring; it
trains with plain SGD on ``jax.grad`` and takes the loss where ``targets_segmentation != 0``.
The data is the corpus of ``--config`` (a corpus.yaml), by default the built-in demo corpus (the
Python standard library's source). In a Ray job (cluster/rayjob-train-gpu.yaml) it joins the
job's cluster (``RAY_ADDRESS``).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from ingest.config import load_config
from ingest.demo import demo_config
from ingest.tokenize.tokenizer import load_tokenizer
from jax_side import HostFeed, batch_sharding, checkpoint


def init_params(key: jax.Array, vocab_size: int, dim: int) -> dict[str, jax.Array]:
    k_embed, k_hidden = jax.random.split(key)
    return {
        "embed": jax.random.normal(k_embed, (vocab_size, dim)) * 0.02,
        "hidden": jax.random.normal(k_hidden, (dim, dim)) / np.sqrt(dim),
    }


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross entropy over the targets that carry a loss."""
    h = params["embed"][batch["inputs"]]  # [B, L, dim]
    h = h + jnp.tanh(h @ params["hidden"])
    logits = h @ params["embed"].T  # tied output projection: [B, L, vocab]
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
    mask = (batch["targets_segmentation"] != 0).astype(nll.dtype)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@jax.jit
def train_step(params, batch, learning_rate):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    return params, loss


def checksum(params: dict[str, jax.Array]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(np.asarray(params[name]).tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="train until this step (in total)")
    p.add_argument("--checkpoint-dir", required=True, help="orbax directory for model + feed")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--backend", choices=("ray", "local"), default="ray")
    p.add_argument("--address", help="Ray cluster address (default: start one on 127.0.0.1)")
    p.add_argument("--learning-rate", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--config", help="corpus config (corpus.yaml); default: the demo corpus")
    args = p.parse_args(argv)

    # Small rows and batches so that a step takes well under a second on CPU.
    config = (load_config(args.config) if args.config else
              demo_config(seq_len=64, global_batch_size=8, num_streams=4, workers=2))
    if args.backend == "ray":
        from jax_side.run import start_ray

        start_ray(args.address)
    # Auto axes: XLA propagates the batch sharding through the model, so the model code needs
    # no sharding annotations (jax.make_mesh's default, Explicit, would ask for them).
    mesh = jax.make_mesh((len(jax.devices()),), ("data",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    feed = HostFeed(config, sharding=batch_sharding(mesh, "data"), backend=args.backend)
    # Parameters replicated on the mesh; a restore puts them back with this same sharding.
    params = jax.device_put(
        init_params(jax.random.key(0), load_tokenizer(config.tokenizer).vocab_size, args.dim),
        NamedSharding(mesh, PartitionSpec()))

    manager = checkpoint.open_manager(args.checkpoint_dir, max_to_keep=3)
    step = 0
    feed_state = checkpoint.restore_latest_feed(manager)
    if feed_state is not None:
        # The feed's step is the training step here (one batch per step), so the parameters
        # come from the very step directory the feed state came from.
        step = feed_state["step"]
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract)))
        params = restored["params"]
        feed.set_state(feed_state)
        print(f"resumed at step {step} from {args.checkpoint_dir}", file=sys.stderr)

    with feed:
        while step < args.steps:
            batch = next(feed, None)
            if batch is None:
                print(f"the data ended after step {step}", file=sys.stderr)
                break
            params, loss = train_step(params, batch, args.learning_rate)
            step += 1
            print(f"step {step:4d}  loss {float(loss):.4f}")
            if step % args.checkpoint_every == 0 or step == args.steps:
                manager.save(step, args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params),
                    feed=checkpoint.FeedSave(feed.get_state())))
    manager.wait_until_finished()
    manager.close()
    print(f"finished at step {step}; params {checksum(params)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
