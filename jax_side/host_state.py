"""The host feed's state: its version and the check that a saved one fits a config and corpus.

``jax_side.feed.HostFeed`` writes and restores the state; ``jax_side.checkpoint`` saves it
with orbax. Both check it here, which needs neither JAX nor orbax.
"""

from __future__ import annotations

import logging
from typing import Any

from ingest.config import Config
from ingest.units import UnitPlan

__all__ = ["HOST_STATE_VERSION", "check_compatible"]

log = logging.getLogger(__name__)

HOST_STATE_VERSION = 1
"""The version ``HostFeed.get_state`` writes; restoring accepts this one only."""


def _moved(state: dict[str, Any], now: dict[str, Any], plan: UnitPlan) -> bool:
    """Whether the saved corpus is ``plan``'s, moved: only ``sources[].paths`` differ, and the
    files found there are the same (paths relative to their source's folder, sizes, row
    groups, content keys, order)."""
    saved = state.get("config", {})
    if (saved == now or not plan.content_fingerprint
            or state.get("corpus_content") != plan.content_fingerprint):
        return False
    without = [{**s, "paths": None} for s in saved.get("sources", [])]
    return ({**saved, "sources": without}
            == {**now, "sources": [{**s, "paths": None} for s in now["sources"]]})


def check_compatible(state: dict[str, Any], config: Config, plan: UnitPlan) -> None:
    """Checks that a saved host state can continue under ``config`` over ``plan``.

    Runtime fields (workers, chunk_rows, prefetch) may differ; every other field and the
    corpus must be as saved.

    Raises:
      ValueError: naming every difference that would change the batches.
    """
    if not isinstance(state, dict) or "streams" not in state:
        raise ValueError("not a HostFeed state: expected a dict with 'streams' (was it written "
                         "by HostFeed.get_state?)")
    if state.get("version") != HOST_STATE_VERSION:
        raise ValueError(f"feed state version {state.get('version')!r} is not supported "
                         f"(expected {HOST_STATE_VERSION})")
    problems = []
    saved = state.get("config", {})
    now = config.output_fields()
    moved = _moved(state, now, plan)
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key) and not (key == "sources" and moved):
            problems.append(f"{key}: checkpoint has {saved.get(key)!r}, config has {now.get(key)!r}")
    if state.get("corpus_fingerprint") != plan.fingerprint and not moved:
        problems.append(f"the corpus changed (fingerprint {state.get('corpus_fingerprint')} in "
                        f"the checkpoint, {plan.fingerprint} now): files were added, removed or "
                        f"rewritten"
                        + ("" if "corpus_content" in state or not plan.content_fingerprint else
                           "; a corpus moved elsewhere restores only from checkpoints saved "
                           "with its content fingerprint (this version on)"))
    if moved:
        log.warning("the corpus moved (sources[].paths %s in the checkpoint, %s now): the same "
                    "files relative to their folders, with the same sizes, row groups and "
                    "content, in the same order; restoring there",
                    [s["paths"] for s in saved["sources"]], [s["paths"] for s in now["sources"]])
    if problems:
        raise ValueError("cannot restore the feed: " + "; ".join(problems)
                         + ". Restore with the original config and corpus, or start fresh.")
