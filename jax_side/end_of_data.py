"""Where finite data ends for one host's feed, alone or agreed with the other JAX hosts.

On one host the feed ends at the first step with no row (with ``drop_remainder``: at the first
step with a padding row, which is dropped). With several JAX processes and finite data, every
host goes on, padding, until the hosts agree that no host has a row left
(``jax_side.multihost.EndAgreement``). The producer thread keeps this host's *claim* for that
agreement: the last step the rows already in hand reach (with ``drop_remainder``: fill), which
the consumer's thread hands to the agreement before delivering a step::

    step assembled   3, rows in hand cover 2 more steps   -> claim 5
    consumer at 4:   allgather of the claims (3, 5)        -> steps 4..5 go ahead
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from ingest.config import Config
from jax_side.iterator_length import steps_covering
from jax_side.multihost import AGREEMENT_TIMEOUT_S, EndAgreement

__all__ = ["EndOfData", "steps_in_hand"]


def steps_in_hand(config: Config, step: int, left: list[int], *, full: bool = False) -> int:
    """Steps after ``step`` that ``left`` rows of each stream reach for some stream (with
    ``full``: fill completely for every stream)."""
    if full:
        return min(steps_covering(config, n, start=step, full=True) for n in left)
    return max(steps_covering(config, n, start=step) for n in left)


class EndOfData:
    """One pass's end of the data, for one host's feed.

    Args:
      config: the validated config; the hosts agree when several JAX processes run and
        ``num_epochs`` is finite.
      timeout_s: the longest wait for the other hosts at an agreement.
    """

    def __init__(self, config: Config, timeout_s: float = AGREEMENT_TIMEOUT_S):
        self.config = config
        agreeing = jax.process_count() > 1 and config.num_epochs is not None
        self._agreement = (EndAgreement(drop_remainder=config.drop_remainder,
                                        timeout_s=timeout_s) if agreeing else None)
        # The last step known to have a row here (with drop_remainder: known to be full),
        # written by the producer, read by the consumer.
        self._claim = 0
        self._partial_seen = False

    @property
    def agreed(self) -> bool:
        """Whether the hosts agree on the last step (else this host ends on its own)."""
        return self._agreement is not None

    @property
    def syncs(self) -> int:
        """The agreement's allgathers so far (0 on one host)."""
        return self._agreement.syncs if self._agreement is not None else 0

    @property
    def ends_at_first_partial(self) -> bool:
        """One host with ``drop_remainder``: the first step with padding is the last one
        assembled (the consumer drops it and counts its rows)."""
        return self.config.drop_remainder and self._agreement is None

    def assembled(self, step: int, got: int, padding_rows: int,
                  rows_in_hand: Callable[[], list[int]]) -> None:
        """Updates the claim after assembling ``step`` (counted from 1) with ``got`` real rows
        and ``padding_rows``; ``rows_in_hand`` gives each stream's rows received but not taken.
        """
        if self._agreement is None:
            return
        if self.config.drop_remainder:
            # A step with padding here ends the claims: later steps are never full again.
            self._partial_seen = self._partial_seen or padding_rows > 0
            if not self._partial_seen:
                self._claim = max(self._claim, step + steps_in_hand(
                    self.config, step, rows_in_hand(), full=True))
        elif got:
            self._claim = step + steps_in_hand(self.config, step, rows_in_hand())

    def goes_ahead(self, step: int, padding_rows: int) -> bool:
        """Whether an assembled ``step`` is delivered (else the data ended before it).

        Raises:
          multihost.PeerError: another host died while the hosts compared claims.
        """
        if self._agreement is not None:
            return self._agreement.continues(step, self._claim)
        return not (self.config.drop_remainder and padding_rows)
