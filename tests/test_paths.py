"""Where corpus files come from: fsspec filesystems (``memory://`` here), one glob rule on
every filesystem, directories with symbolic-link loops, and Arrow IPC streams (``datasets``'
``.arrow`` files and ``save_to_disk`` folders)."""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from ingest import BadInputError, build_plan
from ingest.sources.files import describe_file, read_texts
from ingest.sources.paths import list_files
from tests.helpers import (
    all_streams,
    forget_decoded,
    free_port,
    make_config,
    make_texts,
    split_documents,
    stream_tokens,
    tokenize,
    write_arrow,
    write_jsonl,
    write_parquet,
)

fsspec = pytest.importorskip("fsspec")
EOS = 50256  # gpt2's <|endoftext|>

# A tree with nested folders, hidden names and several formats: each glob below must pick
# the same relative files from it on every filesystem.
TREE = ["a.parquet", "b.parquet", "c.jsonl", "sub/d.parquet", "sub/e.jsonl",
        "sub/deep/f.parquet", "sib/g.parquet", ".hidden/h.parquet", "sub/.i.parquet",
        "_j.parquet", "sub/_k.parquet"]
PATTERNS = ["*.parquet", "**/*.parquet", "sub/*", "*/*.jsonl", "s?b/**", "[ab].parquet",
            "[!a].parquet", "**", "sub/**/*.parquet", "*/deep/*", "**/deep/*.parquet"]


def _write_tree(root) -> None:
    for i, rel in enumerate(TREE):
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        texts = make_texts(6, 40 + i)
        (write_jsonl if rel.endswith(".jsonl") else write_parquet)(path, texts)


def _to_memory(local_root, mem_root: str) -> None:
    """Copies every file below ``local_root`` into fsspec's memory filesystem."""
    fs = fsspec.filesystem("memory")
    for folder, _, names in os.walk(local_root):
        for name in names:
            src = os.path.join(folder, name)
            rel = os.path.relpath(src, local_root)
            with open(src, "rb") as f, fs.open(f"{mem_root}/{rel}", "wb") as out:
                out.write(f.read())


@pytest.fixture
def memory_root():
    root = f"corpus-{uuid.uuid4().hex[:8]}"
    yield root
    fsspec.filesystem("memory").rm(f"/{root}", recursive=True)


def test_a_corpus_in_memory_filesystem_gives_the_batches_of_the_same_files_on_disk(
        tmp_path, memory_root):
    local = tmp_path / "corpus"
    local.mkdir()
    write_parquet(local / "a.parquet", make_texts(30, 1), row_group_size=7)
    write_jsonl(local / "b.jsonl", make_texts(25, 2))
    (local / "nested").mkdir()
    write_parquet(local / "nested" / "c.parquet", make_texts(20, 3), row_group_size=6)
    _to_memory(local, memory_root)
    kw = dict(num_streams=2, global_batch_size=4, unit_rows=5, seed=3)
    on_disk = all_streams(make_config([local], **kw))
    forget_decoded()
    in_memory = all_streams(make_config([f"memory://{memory_root}"], **kw))
    assert sum(r.shape[1] for r in on_disk) > 4
    for a, b in zip(on_disk, in_memory, strict=True):
        np.testing.assert_array_equal(a, b)
    # The same files, written as the user wrote the folder.
    assert list_files((f"memory://{memory_root}/",)) == [
        f"memory://{memory_root}/{n}" for n in ("a.parquet", "b.jsonl", "nested/c.parquet")]


def _relative(found: list[str], prefix: str) -> list[str]:
    assert all(f.startswith(prefix) for f in found), (found, prefix)
    return sorted(f[len(prefix):] for f in found)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_glob_picks_the_same_files_locally_and_in_memory_as_the_shell_does(
        pattern, tmp_path, memory_root, monkeypatch):
    _write_tree(tmp_path)
    _to_memory(tmp_path, memory_root)
    # The shell's rule (Python's glob), less the names the reader always leaves out.
    shell = sorted(os.path.relpath(h, tmp_path)
                   for h in glob.glob(str(tmp_path / pattern), recursive=True)
                   if os.path.isfile(h) and not os.path.basename(h).startswith(("_", ".")))
    assert shell, pattern
    assert _relative(list_files((str(tmp_path / pattern),)), f"{tmp_path}/") == shell
    monkeypatch.chdir(tmp_path)
    assert sorted(list_files((pattern,))) == shell
    assert _relative(list_files((f"memory://{memory_root}/{pattern}",)),
                     f"memory://{memory_root}/") == shell


def test_a_star_does_not_cross_folders_on_an_object_store(memory_root, tmp_path):
    _write_tree(tmp_path)
    _to_memory(tmp_path, memory_root)
    found = _relative(list_files((f"memory://{memory_root}/*.parquet",)),
                      f"memory://{memory_root}/")
    assert found == ["a.parquet", "b.parquet"]


@pytest.fixture(scope="module")
def s3_tree(tmp_path_factory):
    """The glob tree in a bucket of a moto S3 server on 127.0.0.1."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(),
                                            verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret",
           "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server._server.server_port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    local = tmp_path_factory.mktemp("s3_tree")
    _write_tree(local)
    client = boto3.client("s3")
    client.create_bucket(Bucket="globtree")
    for rel in TREE:
        client.upload_file(str(local / rel), "globtree", f"t/{rel}")
    try:
        yield local
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_glob_picks_the_same_files_on_s3_as_locally(pattern, s3_tree):
    local = _relative(list_files((str(s3_tree / pattern),)), f"{s3_tree}/")
    assert _relative(list_files((f"s3://globtree/t/{pattern}",)), "s3://globtree/t/") == local


def test_a_scheme_without_its_package_or_unknown_is_a_clear_error():
    if importlib.util.find_spec("adlfs") is None:
        with pytest.raises(ImportError, match=r"az://box/x\.parquet: .*needs the adlfs "
                                              r"package; pip install adlfs"):
            list_files(("az://box/x.parquet",))
    with pytest.raises(ValueError, match=r"unknown filesystem scheme nosuch://"):
        list_files(("nosuch://box/x.parquet",))


# -- symbolic links ---------------------------------------------------------------------------


def test_symlink_loops_in_a_folder_read_each_file_once_and_are_named(tmp_path, caplog):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    texts = {name: make_texts(5, i) for i, name in enumerate(["a", "b", "c"])}
    write_parquet(data / "a.parquet", texts["a"])
    write_parquet(data / "b.parquet", texts["b"])
    write_parquet(data / "sub" / "c.parquet", texts["c"])
    os.symlink(".", data / "self")                     # ln -s . data/self
    os.symlink("..", data / "sub" / "up")              # a second loop
    os.symlink("sub", data / "also_sub")               # a second path to a folder
    os.symlink("a.parquet", data / "z_alias.parquet")  # a second path to a file
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ingest.sources.paths"):
        found = list_files((str(data),))
        globbed = list_files((str(data / "**" / "*.parquet"),))
    assert time.monotonic() - t0 < 10
    expected = [str(data / "a.parquet"), str(data / "b.parquet"), str(data / "sub" / "c.parquet")]
    assert found == expected
    assert globbed == expected
    for link in ("self -> .", "up -> ..", "also_sub -> sub"):
        assert link in caplog.text
    # Every document once in the feed.
    config = make_config([data], shuffle=False, seq_len=8)
    assert build_plan(config).units.num_rows.sum() == 15
    docs = split_documents(stream_tokens(all_streams(config)[0]), EOS)
    assert docs == tokenize(texts["a"] + texts["b"] + texts["c"])


# -- Arrow IPC streams ------------------------------------------------------------------------


def _write_stream(path, texts: list[str], batch_rows: int) -> None:
    table = pa.table({"text": texts, "n": list(range(len(texts)))})
    with pa.OSFile(str(path), "wb") as f, ipc.new_stream(f, table.schema) as w:
        for b in table.to_batches(max_chunksize=batch_rows):
            w.write_batch(b)


def test_an_ipc_stream_file_reads_as_the_ipc_file_of_the_same_batches(tmp_path, memory_root):
    texts = make_texts(23, 5)
    (tmp_path / "s").mkdir()
    (tmp_path / "f").mkdir()
    _write_stream(tmp_path / "s" / "data.arrow", texts, 5)
    write_arrow(tmp_path / "f" / "data.arrow", texts, batch_size=5)
    info = describe_file(str(tmp_path / "s" / "data.arrow"), None, "text")
    assert info.format == "arrow_stream" and info.row_groups == (5, 5, 5, 5, 3)
    got, _ = read_texts(info, 2, 1, 4, "text")
    assert got.to_pylist() == texts[11:14]
    kw = dict(num_streams=2, global_batch_size=2, unit_rows=3, seed=1)
    want = all_streams(make_config([tmp_path / "f"], **kw))
    forget_decoded()
    for a, b in zip(want, all_streams(make_config([tmp_path / "s"], **kw)), strict=True):
        np.testing.assert_array_equal(a, b)
    # The same stream on another filesystem.
    _to_memory(tmp_path / "s", memory_root)
    forget_decoded()
    for a, b in zip(want, all_streams(make_config([f"memory://{memory_root}"], **kw)),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_damaged_ipc_stream_is_a_corrupt_file(tmp_path):
    _write_stream(tmp_path / "data.arrow", make_texts(20, 1), 5)
    data = (tmp_path / "data.arrow").read_bytes()
    (tmp_path / "data.arrow").write_bytes(data[:len(data) // 2])
    with pytest.raises(BadInputError, match="cannot read this arrow_stream file") as e:
        describe_file(str(tmp_path / "data.arrow"), None, "text")
    assert e.value.reason == "corrupt_file"


def test_a_save_to_disk_folder_reads_the_files_its_state_names_in_its_order(tmp_path):
    folder = tmp_path / "saved"
    folder.mkdir()
    first, second, stray = make_texts(7, 1), make_texts(6, 2), make_texts(4, 3)
    _write_stream(folder / "data-b.arrow", first, 3)
    _write_stream(folder / "data-a.arrow", second, 4)
    _write_stream(folder / "cache-0123.arrow", stray, 4)  # a cache file: not the dataset's
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-b.arrow"}, {"filename": "data-a.arrow"}],
         "_fingerprint": "x", "_split": None}))
    (folder / "dataset_info.json").write_text("{}")
    assert list_files((str(folder),)) == [str(folder / "data-b.arrow"),
                                          str(folder / "data-a.arrow")]
    config = make_config([folder], shuffle=False, seq_len=8)
    docs = split_documents(stream_tokens(all_streams(config)[0]), EOS)
    assert docs == tokenize(first + second)


def test_a_folder_written_by_datasets_save_to_disk_feeds_its_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = make_texts(40, 9)
    ds = datasets.Dataset.from_dict({"text": texts, "id": list(range(40))})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    files = list_files((str(tmp_path / "ds"),))
    assert [os.path.basename(f) for f in files] == [f"data-0000{i}-of-00003.arrow"
                                                    for i in range(3)]
    assert describe_file(files[0], None, "text").format == "arrow_stream"
    config = make_config([tmp_path / "ds"], shuffle=False, seq_len=8)
    docs = split_documents(stream_tokens(all_streams(config)[0]), EOS)
    assert docs == tokenize(texts)


def test_a_datasetdict_folder_needs_its_split_and_a_split_folder_reads_only_it(tmp_path):
    datasets = pytest.importorskip("datasets")
    train, valid = make_texts(30, 1), make_texts(10, 2)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train}),
                               "validation": datasets.Dataset.from_dict({"text": valid})})
    dd.save_to_disk(str(tmp_path / "dd"))
    # The whole folder would pool train and validation: refused, naming a split folder.
    with pytest.raises(ValueError, match=r"DatasetDict.*\['train', 'validation'\].*dd/train"):
        list_files((str(tmp_path / "dd"),))
    files = list_files((str(tmp_path / "dd" / "train"),))
    assert [os.path.basename(f) for f in files] == ["data-00000-of-00001.arrow"]
    # A glob never takes datasets' metadata files for JSON Lines data.
    with pytest.raises(FileNotFoundError, match="glob matched no file"):
        list_files((str(tmp_path / "dd" / "**" / "*.json"),))
    config = make_config([tmp_path / "dd" / "train"], shuffle=False, seq_len=8)
    docs = split_documents(stream_tokens(all_streams(config)[0]), EOS)
    assert docs == tokenize(train)
