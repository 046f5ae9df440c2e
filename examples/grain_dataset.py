"""grain transformations on top of the feed: ``FeedDataset`` is a ``grain.IterDataset``.

    python examples/grain_dataset.py --steps 5

``map`` adds a loss mask to this host's rows (``host_local=True``: numpy per host), a thread
prefetches the mapped batches, and the state of the outermost iterator restores the feed exactly.
"""

from __future__ import annotations

import argparse
import sys

import grain
import jax
import numpy as np

from ingest.config import Config
from ingest.demo import demo_config
from jax_side import FeedDataset, batch_sharding


def add_loss_mask(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "loss_mask": (batch["targets_segmentation"] != 0).astype(np.float32)}


def pipeline(config: Config, backend: str = "local") -> grain.IterDataset:
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    ds = FeedDataset(config, sharding=batch_sharding(mesh, "data"), backend=backend,
                     host_local=True)
    return grain.experimental.ThreadPrefetchIterDataset(ds.map(add_loss_mask),
                                                        prefetch_buffer_size=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    ds = pipeline(demo_config(seq_len=64, global_batch_size=8, num_streams=4, workers=2))
    it = iter(ds)
    for _ in range(args.steps):
        batch = next(it)
    state = it.get_state()  # save it with the model (grain.checkpoint.CheckpointSave(it))
    it.close()
    again = iter(ds)
    again.set_state(state)  # a new run continues after step --steps
    print(f"mask of step {args.steps}: {float(batch['loss_mask'].mean()):.3f}; "
          f"next step {again.get_state()['step']}")
    again.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
