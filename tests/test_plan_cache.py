"""The plan's file metadata cache: a file whose listing stamp (size, and modification time or
ETag) is unchanged is not read again, a changed one always is, and a store that gives no such
stamp is never cached. Files are real Parquet, JSONL and Arrow files, on the local disk and
behind ``slowfs://``, the benchmark's fsspec store (latency 0 here), which counts requests."""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.errors import BadInputError
from ingest.plan.build import build_plan
from ingest.sources.files import describe_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: not installed
from benchmarks.corpus_plan import SlowFileSystem, register  # noqa: E402
from tests.helpers import make_config  # noqa: E402

HOUR_AGO = time.time() - 3600


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch):
    """A cache folder of this test's own, and ``slowfs://`` registered with its counts reset."""
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    register()
    monkeypatch.setattr(SlowFileSystem, "requests", collections.Counter())
    monkeypatch.setattr(SlowFileSystem, "latency_s", 0.0)
    return SlowFileSystem


def _parquet(path: Path, texts: list[str], *, mtime: float = HOUR_AGO, **kw) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path, **kw)
    os.utime(path, (mtime, mtime))


def _corpus(root: Path, files: int = 6) -> None:
    for i in range(files):
        _parquet(root / f"d{i % 2}" / f"part-{i:03d}.parquet",
                 [f"file {i} document {r}" for r in range(5 + i)], row_group_size=3)
    (root / "extra.jsonl").write_text("".join(json.dumps({"text": f"line {r}"}) + "\n"
                                              for r in range(7)))
    with pa.ipc.new_file(root / "extra.arrow", pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": ["a", "b", "c"]}), max_chunksize=2)
    for name in ("extra.jsonl", "extra.arrow"):
        os.utime(root / name, (HOUR_AGO, HOUR_AGO))


@pytest.mark.parametrize("where", ["local", "slowfs"])
def test_a_cached_plan_equals_a_cold_one_and_reads_no_file(tmp_path, store, where):
    _corpus(tmp_path / "data")
    root = str(tmp_path / "data") if where == "local" else f"slowfs://{tmp_path}/data"
    cold = build_plan(make_config([root]))
    before = collections.Counter(store.requests)
    warm = build_plan(make_config([root]))
    if where == "slowfs":
        assert before["read"] >= len(cold.files)
        # The warm plan only listed: one info (is the path a folder?) and listing pages.
        assert store.requests - before == collections.Counter(info=1, list=before["list"])
    assert warm.fingerprint == cold.fingerprint
    assert warm.content_fingerprint == cold.content_fingerprint
    assert warm.files == cold.files  # every field: sizes, groups, content keys, JSONL offsets
    assert [describe_file(f.path, None, "text") for f in warm.files] == list(warm.files)
    assert len(warm.files) == 8 and warm.files[-1].group_offsets  # the JSONL file's


def _rewrite_same_size(path: Path, mtime: float) -> None:
    """Replaces a one-document Parquet file by another of the same size and a new content."""
    before = path.stat().st_size
    old = pq.read_table(path).column("text")[0].as_py()
    _parquet(path, [old.translate(str.maketrans("ab", "ba"))], mtime=mtime)
    assert path.stat().st_size == before


@pytest.mark.parametrize("where", ["local", "slowfs"])
@pytest.mark.parametrize("change", ["same_size_new_mtime", "new_size"])
def test_a_changed_file_is_described_again(tmp_path, where, change):
    data = tmp_path / "data"
    for i in range(3):
        _parquet(data / f"part-{i}.parquet", [f"aaaa bbbb {i}"])
    root = str(data) if where == "local" else f"slowfs://{tmp_path}/data"
    first = build_plan(make_config([root]))
    target = data / "part-1.parquet"
    if change == "new_size":
        _parquet(target, ["a longer document than before", "and a second one"])
    else:
        _rewrite_same_size(target, HOUR_AGO + 60)
    second = build_plan(make_config([root]))
    assert second.files[1] == describe_file(second.files[1].path, None, "text")
    assert second.files[1].content_key != first.files[1].content_key
    assert second.fingerprint != first.fingerprint
    assert second.files[0] == first.files[0] and second.files[2] == first.files[2]


def test_a_store_without_modification_times_is_not_cached(tmp_path, store, monkeypatch,
                                                           caplog):
    monkeypatch.setattr(SlowFileSystem, "mtime", False)
    data = tmp_path / "data"
    for i in range(3):
        _parquet(data / f"part-{i}.parquet", [f"aaaa bbbb {i}"])
    root = f"slowfs://{tmp_path}/data"
    with caplog.at_level(logging.INFO, logger="ingest.plan.build"):
        first = build_plan(make_config([root]))
    assert "neither a modification time nor an ETag" in caplog.text
    reads = store.requests["read"]
    # Same size and no time to tell: only reading the file again sees the change.
    _rewrite_same_size(data / "part-1.parquet", HOUR_AGO)
    second = build_plan(make_config([root]))
    assert store.requests["read"] == 2 * reads
    assert second.files[1].content_key != first.files[1].content_key
    assert not (tmp_path / "cache" / "plan-files").exists()


def test_files_changed_just_before_the_plan_are_described_again(tmp_path, store):
    """A time within the store clock's error of the plan could be kept by a second write."""
    data = tmp_path / "data"
    _parquet(data / "old.parquet", ["an old document"])
    _parquet(data / "new.parquet", ["a new document"], mtime=time.time())
    root = f"slowfs://{tmp_path}/data"
    build_plan(make_config([root]))
    assert store.requests["read"] == 2
    build_plan(make_config([root]))
    assert store.requests["read"] == 3  # the new file again, the old one from the cache


class _LaterFilesFirst(SlowFileSystem):
    """Answers later files sooner, so that descriptions finish out of path order."""

    protocol = "slowfsrev"

    @classmethod
    def _request(cls, kind: str, n: int = 1) -> None:
        pass

    def cat_file(self, path, start=None, end=None, **kwargs):
        index = int(Path(path).stem.rsplit("-", 1)[1])
        time.sleep(0.002 * (40 - index))
        return super().cat_file(path, start, end, **kwargs)


def test_parallel_descriptions_keep_the_plan_in_path_order(tmp_path):
    import fsspec

    fsspec.register_implementation("slowfsrev", _LaterFilesFirst, clobber=True)
    data = tmp_path / "data"
    for i in range(40):
        _parquet(data / f"part-{i:02d}.parquet", [f"document {i} {r}" for r in range(i % 5 + 1)])
    local = build_plan(make_config([str(data)]))
    remote = build_plan(make_config([f"slowfsrev://{data}"]))
    assert [f.path.rsplit("/", 1)[1] for f in remote.files] == \
        [f"part-{i:02d}.parquet" for i in range(40)]
    # The same files, order and metadata as the local plan (paths aside).
    assert remote.content_fingerprint == local.content_fingerprint
    # Two bad files: the error names the first in path order, though the later answers first.
    for i in (20, 30):
        (data / f"part-{i:02d}.parquet").write_bytes(b"not parquet at all")
        os.utime(data / f"part-{i:02d}.parquet", (HOUR_AGO, HOUR_AGO))
    with pytest.raises(BadInputError, match="part-20"):
        build_plan(make_config([f"slowfsrev://{data}"]))


def test_the_remote_timeout_bounds_the_first_answer_not_a_long_listing(tmp_path, store,
                                                                      monkeypatch):
    from ingest.sources import paths

    for i in range(8):
        _parquet(tmp_path / "data" / "sub" / f"part-{i}.parquet", [f"document {i}"])
    monkeypatch.setattr(paths, "REMOTE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(SlowFileSystem, "page", 1)  # 8 pages in turn: longer than the timeout
    monkeypatch.setattr(SlowFileSystem, "latency_s", 0.1)
    listed = paths.list_files((f"slowfs://{tmp_path}/data",))
    assert len(listed) == 8 and store.requests["list"] == 9
    monkeypatch.setattr(SlowFileSystem, "latency_s", 1.0)  # no first answer in time
    with pytest.raises(FileNotFoundError, match="no answer from its storage in 0.3 s"):
        paths.list_files((f"slowfs://{tmp_path}/data",))


@pytest.mark.parametrize("folders_at_once", [16, 2])
def test_a_listing_by_folders_finds_what_a_flat_one_does(tmp_path, store, monkeypatch,
                                                         folders_at_once):
    from ingest.sources import paths

    monkeypatch.setattr(paths, "_LIST_FOLDERS", folders_at_once)  # 2: a flat listing
    for i in range(9):
        _parquet(tmp_path / "data" / f"f{i % 3}" / ("deep" if i % 2 else "") / f"p{i}.parquet",
                 [f"document {i}"])
    _parquet(tmp_path / "data" / "top.parquet", ["top"])
    stamps: dict = {}
    listed = paths.list_files((f"slowfs://{tmp_path}/data",), stamps=stamps)
    local = paths.list_files((str(tmp_path / "data"),))
    assert [p.split("/data/", 1)[1] for p in listed] == \
        [p.split("/data/", 1)[1] for p in local]
    assert set(stamps) == set(listed)
    assert {s.size for s in stamps.values()} == {os.path.getsize(p) for p in local}
