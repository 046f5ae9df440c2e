"""Host state checks (and, with orbax, saving it beside the model checkpoint)."""

from __future__ import annotations

from typing import Any

from ingest.config import Config
from ingest.plan import UnitPlan

__all__ = ["check_compatible"]


def check_compatible(state: dict[str, Any], config: Config, plan: UnitPlan) -> None:
    """Raises ValueError naming every difference that would change the batches."""
    from jax_side.feed import HOST_STATE_VERSION  # noqa: PLC0415

    if not isinstance(state, dict) or "streams" not in state:
        raise ValueError("not a HostFeed state: expected a dict with 'streams' (was it written "
                         "by HostFeed.get_state?)")
    if state.get("version") != HOST_STATE_VERSION:
        raise ValueError(f"feed state version {state.get('version')!r} is not supported "
                         f"(expected {HOST_STATE_VERSION})")
    problems = []
    saved = state.get("config", {})
    now = config.output_fields()
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            problems.append(f"{key}: checkpoint has {saved.get(key)!r}, config has {now.get(key)!r}")
    if state.get("corpus_fingerprint") != plan.fingerprint:
        problems.append(f"the corpus changed (fingerprint {state.get('corpus_fingerprint')} in "
                        f"the checkpoint, {plan.fingerprint} now): files were added, removed or "
                        f"rewritten")
    if problems:
        raise ValueError("cannot restore the feed: " + "; ".join(problems)
                         + ". Restore with the original config and corpus, or start fresh.")
