"""The text stream: a deterministic, resumable pipeline over its units, producing chunks of rows.

read rows -> tokenize -> pack -> shift, in three parts: ``ingest.stream.unit_reader`` (which units,
read and tokenized), ``ingest.stream.head`` (the head and its small state; everything else is a
cache rebuilt from it) and ``ingest.stream.rows`` (rows from the head: concat or packed, then
shifted).
"""

from __future__ import annotations

from typing import Any

from ingest.config import Config
from ingest.errors import BadInputError, StreamError
from ingest.plan.units import UnitPlan
from ingest.stream.chunk import Chunk, ChunkStream
from ingest.stream.head import Head, StreamState
from ingest.stream.rows import RowBuilder
from ingest.stream.state_check import StateRanges
from ingest.stream.unit_reader import UnitReader
from ingest.tokenize.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Stream", "StreamState"]


class Stream(ChunkStream):
    """The stream ``stream_id`` of ``num_streams`` over a plan (of source ``source`` only, for
    a mixture component; None: every source's units, pooled).

    Iterating is ``produce(n)``; ``get_state``/``set_state`` save and restore its head exactly.
    """

    def __init__(self, config: Config, plan: UnitPlan, stream_id: int,
                 tokenizer: Tokenizer | None = None, *, source: int | None = None):
        super().__init__(config, plan, stream_id)
        self.source = source
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer,
                                                     config.runtime.tokenizer_backend)
        self.reader = UnitReader(config, plan, stream_id, self.tokenizer, source)
        self._rows = RowBuilder(config, self.tokenizer.eos_id)
        self.set_state(StreamState().to_json())

    def get_state(self) -> dict[str, Any]:
        return self._head.state.to_json()

    def set_state(self, state: dict[str, Any]) -> None:
        self._head = Head(self.reader, StreamState.from_json(state))
        self._rows.reset()

    @classmethod
    def check_state(cls, state: Any, ranges: StateRanges, name: str, stream: int) -> None:
        StreamState.check(state, ranges, name, stream)

    def _produce(self, n_rows: int) -> Chunk:
        """Raises:
          BadInputError: a bad document or file under the ``error`` policy.
          StreamError: anything else, naming the stream and its head.
        """
        try:
            (tokens, layout), documents = self._rows.produce(self._head, n_rows)
        except (BadInputError, StreamError):
            raise
        except Exception as e:
            s = self._head.state
            raise StreamError(
                f"stream {self.stream_id} failed at epoch {s.epoch}, unit {s.unit}, document "
                f"{s.doc}: {type(e).__name__}: {e}", stream_id=self.stream_id) from e
        state = self._head.state
        state.rows_emitted += tokens.shape[1]
        return Chunk(self.stream_id, tokens, layout, self.get_state(), state.exhausted, documents)

    def set_trace(self, trace) -> None:
        """Calls ``trace(where)`` before tokenizing each document (None: stop); ``where`` is
        what ``add_poison`` takes. Slow: for locating a document that kills its worker."""
        self.reader.trace = trace

    def add_poison(self, where: dict[str, Any]) -> None:
        """Marks the document ``where`` (from a trace) to be skipped as ``worker_crash``."""
        self._head.add_poison(where)
        self._rows.reset()

    def describe_head(self) -> str:
        """Where the head is, in the corpus's terms: ``FILE row N (unit U of epoch E)``."""
        return self._head.describe()
