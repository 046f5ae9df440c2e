"""EvalFeed: evaluation requests as global ``jax.Array`` batches, sorted by length.

Every process tokenizes every request and builds the same plan (``ingest.evaluation.requests``): the
global sorted order needs every sequence's length, and tokenizing an eval set is seconds
(tiktoken GPT-2: millions of tokens/s per core), so this costs less than a collective
and no process ever waits for another. Each process then fills only the rows its devices hold,
read off the sharding's addressable indices (``jax_side.sharding.host_rows``), and forms the
global arrays with ``jax.make_array_from_process_local_data``::

    global batch b (B=8)     sorted sequences 8b .. 8b+7, width w_b
    host 0 (rows 0-3)        fills sequences 8b .. 8b+3
    host 1 (rows 4-7)        fills sequences 8b+4 .. 8b+7

So the global batches are the same on any number of processes, and every process yields the
same number of batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ingest.evaluation.batches import EvalPlan, plan_batches
from ingest.evaluation.requests import INDEX_FIELDS, EvalConfig, Request, tokenize_requests
from ingest.stream.chunk_format import FIELDS
from ingest.tokenize.tokenizer import Tokenizer
from jax_side.sharding import host_rows

__all__ = ["EvalFeed"]


def _axis_size(sharding: NamedSharding, dim: int) -> int:
    spec = sharding.spec
    axes = spec[dim] if dim < len(spec) else None
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    n = 1
    for a in axes:
        n *= sharding.mesh.shape[a]
    return n


class EvalFeed:
    """Iterates the global batches of an eval set; can be iterated again (every eval).

    Each batch is a dict of int32 ``jax.Array``: the six fields of ``ingest.stream.chunk_format.FIELDS``,
    ``[global_batch_size, width]`` (width varies per batch: a multiple of
    ``config.padding_multiple``), and ``document_idx``, ``sequence_idx``,
    ``[global_batch_size]`` (-1 on the empty rows that pad the last batch). Use
    ``targets_segmentation`` as the loss mask and ``ingest.evaluation.requests.sum_by_request`` to map
    per-row scores back to requests.

    Args:
      requests: ``Document``, ``LoglikelihoodPair`` and ``RollingDocument`` values; the same
        list, in the same order, on every process.
      config: the eval config.
      sharding: a ``NamedSharding`` for ``[global_batch_size, width]`` arrays whose first
        dimension splits rows over the batch axes (and whose second may split tokens); the
        index fields use its first dimension only.
      tokenizer: an already loaded tokenizer (default: ``load_tokenizer(config.tokenizer)``).

    Raises:
      TypeError: ``sharding`` is not a ``NamedSharding``, or a request has a wrong type.
      ValueError: the sharding does not divide the batch (naming the field), this process's
        rows are not one block, or requests cannot be scored (listing them).
    """

    def __init__(self, requests: Sequence[Request], config: EvalConfig, *,
                 sharding: NamedSharding, tokenizer: Tokenizer | None = None):
        if not isinstance(sharding, NamedSharding):
            raise TypeError(f"sharding must be a jax.sharding.NamedSharding, got "
                            f"{type(sharding).__name__}")
        B = config.global_batch_size
        # One "stream" per row: any block of rows is allowed, and host_rows checks that the
        # mesh divides global_batch_size and seq_len and that this process's rows are a block.
        rows = host_rows(sharding, B, config.seq_len, num_streams=B)
        seq_shards = _axis_size(sharding, 1)
        if config.padding_multiple % seq_shards:
            raise ValueError(
                f"padding_multiple={config.padding_multiple} is not divisible by the "
                f"{seq_shards} shards of the token axis {sharding.spec[1]!r}; batch widths are "
                f"multiples of padding_multiple, so choose a multiple of {seq_shards}")
        self.config = config
        self.sharding = sharding
        self._start, self._stop = rows.start, rows.stop
        batch_axes = sharding.spec[0] if len(sharding.spec) else None
        self._index_sharding = NamedSharding(sharding.mesh, PartitionSpec(batch_axes))
        t0 = time.perf_counter()
        self.plan: EvalPlan = plan_batches(
            tokenize_requests(requests, config, tokenizer=tokenizer), config)
        self._prepare_s = time.perf_counter() - t0

    def __len__(self) -> int:
        return self.plan.num_batches

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        for b in range(self.plan.num_batches):
            yield self.batch(b)

    @property
    def rows(self) -> tuple[int, int]:
        """This process's rows ``[start, stop)`` of every global batch."""
        return self._start, self._stop

    def batch(self, b: int) -> dict[str, jax.Array]:
        """Global batch ``b`` (every process must ask for the same ``b``)."""
        local = self.plan.rows(b, self._start, self._stop)
        B = self.config.global_batch_size
        shape = (B, int(self.plan.widths[b]))
        put = jax.make_array_from_process_local_data
        out = dict(zip(FIELDS, put(self.sharding, [local[name] for name in FIELDS], shape),
                       strict=True))
        out.update(zip(INDEX_FIELDS, put(self._index_sharding,
                                         [local[name] for name in INDEX_FIELDS], (B,)),
                       strict=True))
        return out

    def stats(self) -> dict[str, Any]:
        """Counts over all global batches (``EvalPlan.stats``: requests, rows, padding rows and
        tokens, ``padding_fraction`` and ``unsorted_padding_fraction``, truncated prefixes,
        distinct widths), this process's rows, and ``prepare_s``, the seconds spent
        tokenizing and planning (every request, on every process)."""
        return {**self.plan.stats(), "host_rows": [self._start, self._stop],
                "prepare_s": round(self._prepare_s, 3)}
