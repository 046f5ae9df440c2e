"""One stream interface: the text stream, the mixture and the replay of a materialized corpus
are ``ChunkStream``s, with the same checks of their arguments and of the states they restore."""

from __future__ import annotations

import pytest
from helpers import make_config, write_parquet_corpus

from actors.materialize_job import materialize_corpus
from ingest import Config, SourceConfig, build_plan
from ingest.materialize.replay import ReplayStream
from ingest.stream.chunk import ChunkStream
from ingest.stream.kinds import open_stream
from ingest.stream.mixture import MixedStream
from ingest.stream.text import Stream


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Config]:
    root = tmp_path_factory.mktemp("interface")
    for name, seed in (("a", 1), ("b", 2)):
        write_parquet_corpus(root / name, 1, 30, 10, seed=seed, min_words=3, max_words=30)
    shape = dict(seq_len=16, global_batch_size=4, num_streams=2, unit_rows=5, num_epochs=1)
    text = make_config([root / "a"], **shape)
    mixture = Config(sources=(SourceConfig(paths=(str(root / "a"),), weight=1.0),
                              SourceConfig(paths=(str(root / "b"),), weight=2.0)), **shape)
    out = root / "materialized"
    assert materialize_corpus(text, str(out), backend="local").complete
    replay = Config(sources=(SourceConfig(paths=(str(out),), kind="materialized"),),
                    **{k: v for k, v in shape.items() if k not in ("unit_rows", "num_epochs")})
    return {"text": text, "mixture": mixture, "replay": replay}


KINDS = {"text": Stream, "mixture": MixedStream, "replay": ReplayStream}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_of_stream_is_a_chunk_stream_and_resumes_through_it(configs, kind):
    config = configs[kind]
    plan = build_plan(config)
    stream = open_stream(config, plan, 1)
    assert type(stream) is KINDS[kind] and isinstance(stream, ChunkStream)
    first = stream.produce(3)
    state = stream.get_state()
    after = stream.produce(4)
    again = open_stream(config, plan, 1)
    again.set_state(state)
    resumed = again.produce(4)
    assert first.num_rows == 3 and (resumed.fields == after.fields).all()
    assert "row" in again.describe_head() or again.describe_head() == "the end of its data"


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("n_rows", [0, -2])
def test_every_kind_refuses_a_count_of_rows_that_is_not_positive(configs, kind, n_rows):
    config = configs[kind]
    with pytest.raises(ValueError, match=rf"n_rows={n_rows} must be positive"):
        open_stream(config, build_plan(config), 0).produce(n_rows)


@pytest.mark.parametrize("kind", ["text", "mixture"])
def test_a_stream_id_outside_the_streams_is_refused(configs, kind):
    config = configs[kind]
    with pytest.raises(ValueError, match=r"stream_id=2 outside \[0, num_streams=2\)"):
        KINDS[kind](config, build_plan(config), 2)


@pytest.mark.parametrize(("saved", "restored", "message"), [
    ("text", "mixture", r"not a mixture state of version 1 \(kind None, version 1\): stream 0 "
                        r"was saved with another number of sources"),
    ("mixture", "text", r"not a stream state of version 1 \(kind 'mixture', version 1\)"),
    ("text", "replay", r"not a replay stream state"),
])
def test_a_state_of_another_kind_of_stream_is_refused_naming_both(configs, saved, restored,
                                                                  message):
    config = configs[saved]
    state = open_stream(config, build_plan(config), 0).get_state()
    target = configs[restored]
    stream = open_stream(target, build_plan(target), 0)
    with pytest.raises(ValueError, match=message):
        stream.set_state(state)


def test_a_state_with_keys_the_stream_does_not_know_is_refused(configs):
    config = configs["text"]
    stream = open_stream(config, build_plan(config), 0)
    with pytest.raises(ValueError, match=r"stream state has unknown keys \['cursor'\]"):
        stream.set_state({**stream.get_state(), "cursor": 3})
