"""``ingest materialize`` and the ``materialized`` source kind.

A materialized directory must hold exactly the rows of each stream (local and Ray backends
alike), survive a SIGKILL mid-job with no row lost or repeated when the same command runs
again, refuse a different config or corpus, and replay batches whose digests equal those of
streaming the original config, also across a resume mid-replay.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from helpers import assert_resumes_identically, drain, make_config, write_parquet_corpus
from test_cli import cli_env, ingest_command

from actors.materialize_job import materialize_corpus
from ingest import (
    FIELDS,
    BadInputError,
    Config,
    ConfigError,
    SourceConfig,
    build_plan,
    load_config,
    step_digest,
)
from ingest.materialize.replay import ReplayStream
from ingest.materialize.segments import SegmentWriter, read_manifest, read_segment
from ingest.stream.kinds import open_stream
from jax_side import HostFeed, batch_sharding

DEADLINE_S = 120  # a healthy job here takes seconds; 2 shared CPUs can be slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mat_corpus")
    write_parquet_corpus(root, 3, 60, 20, seed=11, min_words=5, max_words=40)
    return root


@pytest.fixture(scope="module")
def config(corpus) -> Config:
    # Two epochs: packing carries over the epoch boundary, so replay must too.
    return make_config([corpus], seq_len=32, global_batch_size=8, num_streams=4, unit_rows=10,
                       num_epochs=2, chunk_rows=3)


def replay_config(out, config: Config, **changes) -> Config:
    fields = dict(seq_len=config.seq_len, num_streams=config.num_streams,
                  global_batch_size=config.global_batch_size, chunk_rows=5)
    fields.update(changes)
    return Config.from_dict({"sources": [SourceConfig(paths=(str(out),), kind="materialized")],
                             **fields})


def stream_rows(out) -> list[np.ndarray]:
    """Every stream's rows, read back from the segments the manifest lists, in order."""
    m = read_manifest(str(out))
    assert m is not None and m["complete"]
    return [np.concatenate([read_segment(os.path.join(out, seg["path"]), m["seq_len"])
                            for seg in st["segments"]], axis=1) for st in m["streams"]]


def feed_digests(config: Config, *, backend: str = "local", state=None, steps=None):
    """Per-step digests of the feed on 8 CPU devices; with ``steps``, also the state after."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    feed = HostFeed(config, sharding=batch_sharding(mesh, "data"), backend=backend, workers=2)
    if state is not None:
        feed.set_state(state)
    out = []
    try:
        for batch in feed:
            out.append(step_digest({k: np.asarray(v) for k, v in batch.items()}))
            if steps is not None and len(out) == steps:
                return out, json.loads(json.dumps(feed.get_state()))
    finally:
        feed.close()
    return out, None


@pytest.fixture(scope="module")
def materialized(config, tmp_path_factory) -> Path:
    """The config materialized with the local backend, segments not aligned to chunks."""
    out = tmp_path_factory.mktemp("mat") / "out"
    s = materialize_corpus(config, str(out), backend="local", segment_rows=7)
    assert s.complete and s.segments_written == s.segments and s.segments_skipped == 0
    return out


def test_segments_hold_every_stream_row_in_order(config, materialized):
    plan = build_plan(config)
    want = [drain(open_stream(config, plan, s), n_rows=5) for s in range(config.num_streams)]
    got = stream_rows(materialized)
    for s in range(config.num_streams):
        np.testing.assert_array_equal(got[s], want[s], err_msg=f"stream {s}")
    m = read_manifest(str(materialized))
    assert m["config_fingerprint"] == config.fingerprint()
    assert m["corpus_fingerprint"] == plan.fingerprint
    assert all(seg["rows"] == 7 for st in m["streams"] for seg in st["segments"][:-1])
    assert sum(st["tokens"] for st in m["streams"]) == sum(
        int(np.count_nonzero(r[2])) for r in got)


def test_replay_digests_equal_streaming_digests_and_resume_mid_replay(config, materialized):
    streamed, _ = feed_digests(config)
    replay = replay_config(materialized, config)
    replayed, _ = feed_digests(replay)
    assert replayed == streamed and len(streamed) > 10
    # Resume from a state saved mid-replay, in a fresh feed.
    head, state = feed_digests(replay, steps=6)
    rest, _ = feed_digests(replay, state=state)
    assert head + rest == streamed
    # Any global_batch_size that num_streams divides: the same rows, cut into other batches.
    assert feed_digests(replay_config(materialized, config, global_batch_size=16))[0] == \
        feed_digests(config.replace(global_batch_size=16))[0]


def test_replay_stream_resumes_identically_at_every_row(config, materialized):
    replay = replay_config(materialized, config, num_epochs=2)
    plan = build_plan(replay)
    run = assert_resumes_identically(lambda: open_stream(replay, plan, 1))
    one_pass = stream_rows(materialized)[1].shape[1]
    assert len(run.outputs) == 2 * one_pass  # num_epochs replays the directory twice
    assert isinstance(open_stream(replay, plan, 1), ReplayStream)


class _StopAfter:
    """A chunk source that raises after ``n`` chunks: a job interrupted at a known point."""

    def __init__(self, inner, n: int):
        self._inner, self._left = inner, n

    def open(self, states):
        self._inner.open(states)

    def next_chunk(self, s):
        self._left -= 1
        if self._left < 0:
            raise KeyboardInterrupt("stopped by the test")
        return self._inner.next_chunk(s)

    def close(self):
        self._inner.close()


def test_interrupted_job_continues_to_the_same_rows(config, materialized, tmp_path):
    from ingest.materialize.writer import materialize
    from ingest.stream.local_source import LocalSource

    plan = build_plan(config)
    out = str(tmp_path / "out")
    for n in (7, 11, 1000):  # two interruptions mid-segment (7 rows, chunks of 3), then finish
        try:
            s = materialize(config, plan, out,
                            lambda ids, n=n: _StopAfter(LocalSource(config, plan, ids), n),
                            segment_rows=7)
        except KeyboardInterrupt:
            assert not read_manifest(out)["complete"]
            assert not [p for p in Path(out).rglob(".*.tmp")], "temporary files left behind"
            continue
    assert s.complete and s.segments_skipped > 0
    for s_id, (a, b) in enumerate(zip(stream_rows(out), stream_rows(materialized), strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"stream {s_id}")
    assert read_manifest(out)["streams"] == read_manifest(str(materialized))["streams"]


def test_a_resubmit_with_another_config_or_corpus_is_refused(config, corpus, tmp_path):
    out = str(tmp_path / "out")
    materialize_corpus(config, out, backend="local", segment_rows=50)
    with pytest.raises(ValueError, match=r"seed: the directory has 7, the config 8"):
        materialize_corpus(config.replace(seed=8), out, backend="local", segment_rows=50)
    with pytest.raises(ValueError, match=r"--segment-rows: the directory has 50, this job 10"):
        materialize_corpus(config, out, backend="local", segment_rows=10)
    other = tmp_path / "corpus"
    write_parquet_corpus(other, 3, 61, 20, seed=11, min_words=5, max_words=40)
    with pytest.raises(ValueError, match="the corpus changed"):
        materialize_corpus(config.replace(sources=(SourceConfig(paths=(str(other),)),)), out,
                           backend="local", segment_rows=50)
    with pytest.raises(ValueError, match="num_epochs is null"):
        materialize_corpus(config.replace(num_epochs=None), str(tmp_path / "x"),
                           backend="local")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        materialize_corpus(config, str(tmp_path / "full"), backend="local")


def test_replay_configs_that_do_not_fit_the_directory_are_refused(config, corpus, materialized,
                                                                  tmp_path):
    with pytest.raises(ValueError, match=r"seq_len=64 but .* seq_len=32"):
        build_plan(replay_config(materialized, config, seq_len=64))
    with pytest.raises(ValueError, match=r"num_streams=2 but .* num_streams=4"):
        build_plan(replay_config(materialized, config, num_streams=2))
    with pytest.raises(FileNotFoundError, match="ingest materialize"):
        build_plan(replay_config(tmp_path, config))
    mixed = config.replace(sources=(SourceConfig(paths=(str(materialized),), kind="materialized"),
                                    SourceConfig(paths=(str(corpus),))))
    with pytest.raises(ValueError, match="cannot be mixed"):
        build_plan(mixed)
    with pytest.raises(ConfigError, match=r"kind='tapes' must be one of"):
        Config(sources=(SourceConfig(paths=("x",), kind="tapes"),))
    with pytest.raises(ConfigError, match="exactly one path"):
        Config(sources=(SourceConfig(paths=("a", "b"), kind="materialized"),))
    unfinished = tmp_path / "unfinished"
    m = read_manifest(str(materialized))
    unfinished.mkdir()
    (unfinished / "manifest.json").write_text(json.dumps(dict(m, complete=False)))
    with pytest.raises(ValueError, match="unfinished"):
        build_plan(replay_config(unfinished, config))


def _committed(out: Path) -> dict[str, tuple[int, int]]:
    """Committed segments (those with a record): path -> (inode, mtime_ns)."""
    found = {}
    for rec in out.glob("stream-*/segment-*.json"):
        seg = rec.with_suffix(".parquet")
        try:
            st = seg.stat()
        except FileNotFoundError:
            continue
        found[str(seg.relative_to(out))] = (st.st_ino, st.st_mtime_ns)
    return found


@pytest.mark.slow
def test_sigkilled_job_resubmitted_completes_without_duplicate_or_missing_rows(tmp_path):
    corpus = tmp_path / "corpus"
    write_parquet_corpus(corpus, 4, 400, 50, seed=5, min_words=20, max_words=80)
    cfg = {"sources": [{"paths": ["corpus"]}], "seq_len": 32, "global_batch_size": 8,
           "num_streams": 4, "unit_rows": 25, "chunk_rows": 4, "seed": 1, "num_epochs": 1}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(cfg))
    config = load_config(str(tmp_path / "m.yaml"))
    ref = tmp_path / "ref"
    total = materialize_corpus(config, str(ref), backend="local", segment_rows=4).segments
    out = tmp_path / "out"
    cmd = ingest_command() + ["materialize", str(tmp_path / "m.yaml"), "--out", str(out),
                              "--backend", "local", "--segment-rows", "4", "--json"]
    proc = subprocess.Popen(cmd, env=cli_env(tmp_path / "cache"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while len(_committed(out)) < total // 4:
            assert proc.poll() is None, f"the job ended early: {proc.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, f"no {total // 4} segments in {DEADLINE_S} s"
            threading.Event().wait(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    before = _committed(out)
    assert total // 4 <= len(before) < total, "the kill did not land mid-job"
    assert not read_manifest(str(out))["complete"]
    done = subprocess.run(cmd, env=cli_env(tmp_path / "cache"), capture_output=True, text=True,
                          timeout=DEADLINE_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["complete"] and summary["segments"] == total
    assert summary["segments_skipped"] >= len(before)
    assert summary["segments_written"] == total - summary["segments_skipped"]
    assert f"skipped {summary['segments_skipped']})" in done.stderr  # the human summary
    after = _committed(out)
    assert {p: after[p] for p in before} == before, "a finished segment was rewritten"
    for s, (a, b) in enumerate(zip(stream_rows(out), stream_rows(ref), strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"stream {s}: rows lost or repeated")
    assert not [p for p in out.rglob(".*.tmp")]


@pytest.mark.ray
@pytest.mark.slow
def test_ray_backend_writes_the_same_segments_and_replays_on_workers(ray_cluster, config,
                                                                      materialized, tmp_path):
    out = tmp_path / "ray"
    s = materialize_corpus(config, str(out), backend="ray", workers=2, segment_rows=7)
    assert s.complete
    assert read_manifest(str(out))["streams"] == read_manifest(str(materialized))["streams"]
    replayed, _ = feed_digests(replay_config(out, config), backend="ray")
    assert replayed == feed_digests(config)[0]


def test_cli_checks_materialize_flags():
    from ingest.cli import parse_args

    args = parse_args(["materialize", "c.yaml", "--out", "d", "--segment-rows", "9",
                       "--backend", "local", "--no-progress"])
    assert (args.segment_rows, args.backend, args.no_progress) == (9, "local", True)
    with pytest.raises(SystemExit):
        parse_args(["materialize", "c.yaml", "--out", "d", "--segment-rows", "0"])
    with pytest.raises(SystemExit):
        parse_args(["materialize", "c.yaml"])  # --out is required


def test_progress_reports_rows_tokens_and_eta_without_a_terminal(config, tmp_path, caplog):
    import actors.materialize_job as driver

    caplog.set_level("INFO", logger="ingest.materialize.writer")
    progress = driver.Progress(config, build_plan(config), bar=False, every_s=0.0)
    s = materialize_corpus(config, str(tmp_path / "out"), backend="local", segment_rows=50,
                           progress=progress)
    progress.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "ingest.materialize.writer"]
    assert lines and lines[-1].startswith("materialize: 100.0% of units")
    assert f"rows {s.rows:,}  tokens {s.tokens:,}" in lines[-1] and "ETA 0 s" in lines[-1]


def _damage(path: Path, at: int) -> None:
    """Flips every bit of the byte at offset ``at`` of a real file."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _copy(materialized: Path, out: Path) -> Path:
    shutil.copytree(materialized, out)
    return out


def test_a_damaged_segment_stops_replay_naming_it_and_its_fix(config, materialized, tmp_path):
    m = read_manifest(str(materialized))
    seg = m["streams"][2]["segments"][1]
    size = seg["bytes"]
    # In the first data page, the middle of the file, and the footer's metadata.
    for at in (8, size // 2, size - 20):
        out = _copy(materialized, tmp_path / f"flip{at}")
        _damage(out / seg["path"], at)
        with pytest.raises(BadInputError, match=r"segment 1 of stream 2\) does not match the "
                                                r"manifest .*`ingest materialize`") as e:
            feed_digests(replay_config(out, config))
        assert e.value.path == str(out / seg["path"]) and e.value.reason == "corrupt_segment"


def test_a_segment_whose_target_positions_differ_is_refused(config, materialized, tmp_path):
    # A chunk keeps one copy of the positions (every packing gives targets the inputs'), so a
    # segment that says otherwise, hashes and all, is refused rather than read as the inputs'.
    out = _copy(materialized, tmp_path / "out")
    m = read_manifest(str(out))
    seg = m["streams"][1]["segments"][0]
    fields = read_segment(str(out / seg["path"]), config.seq_len)
    fields[FIELDS.index("targets_position"), 0, 1] += 1
    w = SegmentWriter(str(out), 1, 0, config.seq_len)
    w.append(fields)
    record = w.commit(None, 0)
    seg.update({k: record[k] for k in ("sha256", "file_sha256", "bytes")})
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BadInputError, match=r"segment 0 of stream 1\) has targets_position "
                                            r"other than inputs_position in row group 0") as e:
        feed_digests(replay_config(out, config))
    assert e.value.reason == "corrupt_segment"


def test_deleting_a_damaged_segments_record_and_rerunning_materialize_repairs_it(
        config, materialized, tmp_path):
    out = _copy(materialized, tmp_path / "out")
    seg = read_manifest(str(out))["streams"][1]["segments"][2]
    _damage(out / seg["path"], seg["bytes"] // 2)
    replay = replay_config(out, config)
    with pytest.raises(BadInputError, match="Delete its record") as e:
        feed_digests(replay)
    record = str(out / seg["path"]).removesuffix(".parquet") + ".json"
    assert record in str(e.value)
    os.remove(record)  # the fix the message names
    s = materialize_corpus(config, str(out), backend="local", segment_rows=7)
    assert s.complete and s.streams_done_before == config.num_streams - 1
    assert s.segments_written == len(read_manifest(str(out))["streams"][1]["segments"]) - 2
    assert read_manifest(str(out))["streams"] == read_manifest(str(materialized))["streams"]
    assert feed_digests(replay)[0] == feed_digests(config)[0]


def test_a_manifest_without_file_hashes_checks_segment_content(config, materialized, tmp_path):
    out = _copy(materialized, tmp_path / "out")
    m = read_manifest(str(out))
    for st in m["streams"]:
        for seg in st["segments"]:
            del seg["file_sha256"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert feed_digests(replay_config(out, config))[0] == feed_digests(config)[0]
    seg = m["streams"][0]["segments"][0]
    path = out / seg["path"]
    _damage(path, 8)  # inside the first data page
    with pytest.raises(BadInputError, match=rf"{path} \(segment 0 of stream 0\) (does not match "
                                            rf"the manifest|cannot be decoded)"):
        feed_digests(replay_config(out, config))


def test_replay_of_a_damaged_segment_exits_with_its_name_and_no_traceback(config, materialized,
                                                                         tmp_path):
    out = _copy(materialized, tmp_path / "out")
    seg = read_manifest(str(out))["streams"][3]["segments"][0]
    _damage(out / seg["path"], seg["bytes"] // 2)
    cfg = {"sources": [{"paths": [str(out)], "kind": "materialized"}],
           "seq_len": config.seq_len, "global_batch_size": config.global_batch_size,
           "num_streams": config.num_streams}
    (tmp_path / "replay.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run(ingest_command() + ["run", str(tmp_path / "replay.yaml"), "--backend",
                                              "local", "--digest", "--no-progress"],
                          env=cli_env(tmp_path / "cache"), capture_output=True, text=True,
                          timeout=DEADLINE_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"{out / seg['path']} (segment 0 of stream 3) does not match" in done.stderr
    assert "Traceback" not in done.stderr


def test_segment_paths_outside_the_directory_are_refused(config, materialized, tmp_path):
    out = _copy(materialized, tmp_path / "out")
    m = read_manifest(str(out))
    segs = [st["segments"][0] for st in m["streams"]]
    # A valid segment outside the directory, reached three ways; every size matches.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(out / segs[0]["path"], elsewhere / "seg.parquet")
    climb = os.path.relpath(elsewhere / "seg.parquet", out)
    segs[0]["path"] = climb
    segs[1].update(path=str(elsewhere / "seg.parquet"), **{
        k: segs[0][k] for k in ("bytes", "rows", "sha256", "file_sha256")})
    link = out / segs[2]["path"]
    link.unlink()
    os.symlink(elsewhere / "seg.parquet", link)
    segs[2].update({k: segs[0][k] for k in ("bytes", "rows", "sha256", "file_sha256")})
    passwd = "../" * (len(out.parts) + 2) + "etc/passwd"
    segs[3].update(path=passwd, bytes=os.path.getsize("/etc/passwd"))
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"4 segment path\(s\) .* lie outside") as e:
        build_plan(replay_config(out, config))
    msg = str(e.value)
    assert f"{climb!r} climbs out with '..'" in msg
    assert f"{str(elsewhere / 'seg.parquet')!r} is absolute" in msg
    assert f"{segs[2]['path']!r} resolves through a link to {elsewhere / 'seg.parquet'}" in msg
    assert f"{passwd!r} climbs out" in msg and "Materialize again into a new directory" in msg


def test_a_segment_record_naming_another_path_is_refused_on_resume(config, tmp_path):
    out = tmp_path / "out"
    materialize_corpus(config, str(out), backend="local", segment_rows=50)
    rec = out / "stream-00001" / "segment-000000.json"
    r = json.loads(rec.read_text())
    r["path"] = "../../../../etc/passwd"
    rec.write_text(json.dumps(r))
    with pytest.raises(ValueError, match=r"names the segment '\.\./\.\./\.\./\.\./etc/passwd', "
                                         r"not 'stream-00001/segment-000000.parquet'"):
        materialize_corpus(config, str(out), backend="local", segment_rows=50)
