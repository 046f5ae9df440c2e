"""ingest: the pure core of the feed (no Ray, no JAX): the config and runtime options, then one
subpackage per stage of the data path: sources, plan, tokenize, stream, materialize, evaluation."""

from ingest.config import Config, SourceConfig, load_config
from ingest.digest import BatchDigest, step_digest
from ingest.errors import BadInputError, ConfigError, StreamError
from ingest.plan.build import UnitPlan, build_plan
from ingest.runtime import RuntimeOptions
from ingest.stream.chunk_format import FIELDS
from ingest.stream.kinds import Chunk, Stream, open_stream

__all__ = [
    "FIELDS", "BadInputError", "BatchDigest", "Chunk", "Config", "ConfigError", "RuntimeOptions",
    "SourceConfig", "Stream", "StreamError", "UnitPlan", "build_plan", "load_config",
    "open_stream", "step_digest",
]
