"""Damaged or edited checkpoints, on the local backend: a stream position out of range, a
process file that cannot be read, and a corpus edited in place under its checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import jax
import pyarrow.parquet as pq
import pytest
from helpers import drain_feed, make_config, make_texts, write_parquet, write_parquet_corpus

from ingest import SourceConfig, StreamError
from ingest.stream.kinds import StreamState
from jax_side import HostFeed, batch_sharding, checkpoint

FEED = dict(seq_len=32, global_batch_size=8, num_streams=4, unit_rows=5, chunk_rows=3)


def sharding():
    return batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")


def save_steps(config, directory: Path, steps: int) -> list[dict]:
    """Runs ``steps`` steps on the local backend, saving after each; the states saved."""
    manager = checkpoint.open_manager(directory)
    states = []
    with HostFeed(config, sharding=sharding(), backend="local") as feed:
        for step, _ in zip(range(1, steps + 1), feed, strict=False):
            states.append(feed.get_state())
            checkpoint.save_feed(manager, step, states[-1])
    manager.wait_until_finished()
    manager.close()
    return states


def process_file(directory: Path, step: int) -> Path:
    return directory / str(step) / checkpoint.FEED_ITEM / "process_0-of-1.json"


def rewrite(path: Path, state: dict, *, checksum: bool) -> None:
    """Writes ``state`` as the process file, with a valid checksum of it or none."""
    if checksum:
        canonical = json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)
        state = dict(state, **{checkpoint.CHECKSUM_KEY: hashlib.sha256(
            canonical.encode()).hexdigest()})
    path.write_text(json.dumps(state))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("damage_corpus")
    write_parquet_corpus(d / "a", n_files=2, docs_per_file=30, row_group_size=10, seed=31,
                         min_words=5, max_words=40)
    write_parquet_corpus(d / "b", n_files=2, docs_per_file=30, row_group_size=10, seed=32,
                         min_words=5, max_words=40)
    return d


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("kind", ["text", "mixture"])
def test_a_stream_offset_out_of_its_document_is_refused_naming_field_stream_and_file(
        corpus, tmp_path, kind, checksum):
    config = make_config([corpus / "a"], **FEED)
    if kind == "mixture":
        config = config.replace(sources=(SourceConfig(paths=(str(corpus / "a"),), weight=3.0),
                                         SourceConfig(paths=(str(corpus / "b"),), weight=1.0)))
    save_steps(config, tmp_path / "ckpt", 3)
    path = process_file(tmp_path / "ckpt", 3)
    state = json.loads(path.read_text())
    del state[checkpoint.CHECKSUM_KEY]
    st = state["streams"]["2"]["state"]
    if kind == "mixture":
        component = st["components"][0]
        # None: the component's start (its first chunk is still being taken).
        st = component["state"] = component["state"] or StreamState().to_json()
    st["offset"] = 10**9
    rewrite(path, state, checksum=checksum)
    restored = checkpoint.restore_latest_feed(checkpoint.open_manager(tmp_path / "ckpt"))
    assert restored["step"] == 3
    feed = HostFeed(config, sharding=sharding(), backend="local")
    feed.set_state(restored)
    with feed, pytest.raises(StreamError) as e:
        drain_feed(feed, max_steps=5)
    message = str(e.value)
    assert "stream 2" in message and "offset=1000000000" in message, message
    assert str(corpus / "a") in message and ".parquet" in message, message
    if kind == "mixture":
        assert "sources[0]" in message, message


@pytest.mark.parametrize("damage", ["directory", "unreadable"])
def test_a_process_file_that_cannot_be_read_falls_back_to_the_previous_step(
        corpus, tmp_path, caplog, damage):
    config = make_config([corpus / "a"], **FEED)
    states = save_steps(config, tmp_path / "ckpt", 3)
    path = process_file(tmp_path / "ckpt", 3)
    if damage == "directory":
        path.unlink()
        path.mkdir()
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads a file whatever its permissions")
        path.chmod(0)
    manager = checkpoint.open_manager(tmp_path / "ckpt")
    with pytest.raises(checkpoint.FeedCheckpointError, match="cannot be read") as e:
        checkpoint.restore_feed(manager, 3)
    assert str(path) in str(e.value)
    with caplog.at_level(logging.WARNING, logger="jax_side.checkpoint"):
        assert checkpoint.restore_latest_feed(manager) == states[1]
    assert "falling back to the previous checkpoint" in caplog.text


def test_a_corpus_edited_in_place_with_its_footer_unchanged_is_refused(tmp_path):
    # Uncompressed, without statistics: a same-length edit of the text keeps every offset,
    # length and so the whole footer byte for byte.
    directory = tmp_path / "corpus"
    directory.mkdir()
    paths = []
    for i in range(2):
        path = directory / f"part-{i}.parquet"
        write_parquet(path, make_texts(30, seed=40 + i, min_words=5, max_words=30),
                      row_group_size=10, compression="none")
        paths.append(path)
    pq.write_table(pq.read_table(paths[0]), str(paths[0]), row_group_size=10,
                   compression="none", write_statistics=False)
    config = make_config([directory], **FEED)
    save_steps(config, tmp_path / "ckpt", 2)

    def footer(p: Path) -> bytes:
        data = p.read_bytes()
        n = int.from_bytes(data[-8:-4], "little")
        return data[-8 - n:]

    before, data = footer(paths[0]), bytearray(paths[0].read_bytes())
    at = data.index(b"Doc4")  # the first document's text
    data[at:at + 4] = b"Dox4"
    paths[0].write_bytes(bytes(data))
    assert footer(paths[0]) == before
    state = checkpoint.restore_latest_feed(checkpoint.open_manager(tmp_path / "ckpt"))
    feed = HostFeed(config, sharding=sharding(), backend="local")
    with feed, pytest.raises(ValueError, match="the corpus changed"):
        feed.set_state(state)
