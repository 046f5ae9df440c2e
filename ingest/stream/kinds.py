"""Streams: deterministic, resumable pipelines over a stream's units, producing ``Chunk``s.

``open_stream`` builds the stream of a config, whatever its kind: ``ingest.stream.text.Stream``
(one source of text or token ids), ``ingest.stream.mixture.MixedStream`` (several sources mixed by
weight) or ``ingest.materialize.replay.ReplayStream`` (a materialized corpus).
"""

from __future__ import annotations

from ingest.config import Config
from ingest.materialize.replay import ReplayStream
from ingest.plan.units import UnitPlan
from ingest.stream.chunk import Chunk, ChunkStream
from ingest.stream.mixture import MixedStream
from ingest.stream.text import Stream, StreamState
from ingest.tokenize.tokenizer import Tokenizer

__all__ = ["Chunk", "ChunkStream", "Stream", "StreamState", "open_stream", "stream_kind"]


def stream_kind(config: Config) -> type[ChunkStream]:
    """The kind of stream a config's streams are: replay for a materialized source, mixture
    for several sources, else text. Its ``check_state`` checks their saved states."""
    if config.sources[0].kind == "materialized":
        return ReplayStream
    if len(config.sources) > 1:
        return MixedStream
    return Stream


def open_stream(config: Config, plan: UnitPlan, stream_id: int,
                tokenizer: Tokenizer | None = None) -> ChunkStream:
    """The stream ``stream_id`` of the config: the one constructor workers, the local backend
    and tools use, so every kind of stream (text, mixture, replay) is built the same way."""
    kind = stream_kind(config)
    if kind is ReplayStream:
        return ReplayStream(config, plan, stream_id)
    return kind(config, plan, stream_id, tokenizer)
