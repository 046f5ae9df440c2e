"""JSON Lines (plain and compressed) and Arrow IPC sources: each file parsed or decoded once per
process, Arrow's JSON reader exactly where it agrees with the line-by-line parser, and files that
changed after the plan was built caught."""

from __future__ import annotations

import gzip
import json
import logging
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from ingest import BadInputError, Stream, build_plan
from ingest.errors import BAD_REASONS
from ingest.plan import build as plan_module
from ingest.sources import files as sources
from ingest.sources import jsonl, paths
from ingest.sources.columns import decode_texts
from ingest.sources.files import describe_file, read_texts
from tests.helpers import (
    all_streams,
    drain,
    forget_decoded,
    make_config,
    make_texts,
    split_documents,
    stream_tokens,
    tokenize,
    write_arrow,
    write_jsonl,
    write_parquet,
)

EOS = 50256  # gpt2's <|endoftext|>

# Kinds of JSONL line. The clean ones the Arrow reader takes as they are; any other in a file
# sends the whole file to the line-by-line parser, which names each bad line.
CLEAN = {
    "plain": lambda i: json.dumps({"text": f"doc {i} plain words", "id": i}),
    "unicode": lambda i: json.dumps({"text": f"naïve café {i} 日本 🙂\n\"q\"\t"},
                                    ensure_ascii=False),
    "escaped": lambda i: json.dumps({"text": f"naïve {i} \ud83d\ude42 \u0000 end"}),
    "nested": lambda i: json.dumps({"meta": {"k": [1, "s", None, {"z": True}]}, "text": f"n{i}"}),
    "empty_text": lambda i: json.dumps({"text": ""}),
    "nan_field": lambda i: f'{{"text": "nan {i}", "score": NaN}}',
    "crlf": lambda i: json.dumps({"text": f"crlf {i}"}) + "\r",
}
UNCLEAN = {
    "blank": lambda i: "",
    "spaces": lambda i: "  \t",
    "bad_json": lambda i: f'{{"text": "unterminated {i}"',
    "not_object": lambda i: "[1, 2]",
    "null_text": lambda i: '{"text": null}',
    "two_objects": lambda i: f'{{"text": "a{i}"}} {{"text": "b"}}',
    "lone_surrogate": lambda i: f'{{"text": "half \\ud800 pair {i}"}}',
    "invalid_utf8": lambda i: b'{"text": "latin-1 caf\xe9 %d"}' % i,
}


def _file(rng: random.Random) -> tuple[bytes, bool]:
    """A random JSONL file and whether every line is clean."""
    kinds = [rng.choice(list(CLEAN)) if rng.random() < 0.8 else rng.choice(list(UNCLEAN))
             for _ in range(rng.randint(1, 10))]
    lines = [{**CLEAN, **UNCLEAN}[k](i) for i, k in enumerate(kinds)]
    data = b"\n".join(x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass")
                      for x in lines)
    if rng.random() < 0.7:
        data += b"\n"
    elif kinds[-1] in ("blank", "spaces"):
        data += b"\n"  # an unterminated blank last line is no line to the plan's count
    if rng.random() < 0.2:
        data = b"\xef\xbb\xbf" + data
    return data, all(k in CLEAN for k in kinds)


def _outcomes(table: pa.Table) -> list[tuple[str | None, int]]:
    """Per row: the text a stream would tokenize (None for a bad one) and the reason code."""
    texts, codes = decode_texts(table.column(0).combine_chunks())
    if table.num_columns > 1:
        pre = table.column(1).to_numpy()
        codes = np.where(pre != 0, pre, codes)
    return [(t if c == 0 else None, int(c)) for t, c in zip(texts, codes, strict=True)]


def test_jsonl_read_a_block_at_a_time_gives_the_rows_of_the_whole_file(tmp_path, monkeypatch):
    """deal: row_groups reads a JSONL file's units in order through a cursor that parses a
    block of lines at a time (here about 64 bytes): each unit gets the texts and reason codes
    the whole file's parse gives it."""
    monkeypatch.setattr(jsonl, "_BLOCK_BYTES", 64)
    rng = random.Random(11)
    kinds = {**CLEAN, **UNCLEAN, "bom": lambda i: b'\xef\xbb\xbf{"text": "bom %d"}' % i}
    for case in range(150):
        lines = [kinds[rng.choice(list(CLEAN)) if rng.random() < 0.8
                       else rng.choice([*UNCLEAN, "bom"])](i) for i in range(rng.randint(1, 40))]
        lines = [x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass")
                 for x in lines]
        if lines[-1].strip(b" \t") == b"":
            lines.append(b'{"text": "last"}')  # no unterminated blank last line (see _file)
        data = (b"\xef\xbb\xbf" if rng.random() < 0.2 else b"") + b"\n".join(lines) + (
            b"\n" if rng.random() < 0.7 else b"")
        path = tmp_path / f"b{case}.jsonl"
        path.write_bytes(data)
        info = describe_file(str(path), None, "text")
        step = rng.randint(1, 7)
        units = [(a, min(a + step, info.num_rows)) for a in range(0, info.num_rows, step)]

        def outcomes(arr, bad):
            texts, codes = decode_texts(arr)
            if bad is not None:
                codes = np.where(bad != 0, bad, codes)
            return [(t if c == 0 else None, int(c)) for t, c in zip(texts, codes, strict=True)]

        forget_decoded()
        got = [outcomes(*read_texts(info, 0, a, b, "text", sequential=True)) for a, b in units]
        assert not sources._cursors, "the file's last unit closes its cursor"
        forget_decoded()
        want = [outcomes(*read_texts(info, 0, a, b, "text")) for a, b in units]
        assert got == want, (case, data)
    forget_decoded()
    # A bad line far into the file is named by its line in the file, not in its block.
    path = tmp_path / "named.jsonl"
    path.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(30))
                    + '{"body": "no text"}\n')
    info = describe_file(str(path), None, "text")
    with pytest.raises(BadInputError, match="line 31 has no field"):
        for a in range(0, 31, 4):
            read_texts(info, 0, a, min(a + 4, 31), "text", sequential=True)
    forget_decoded()


def test_arrow_json_reader_gives_exactly_the_line_parser_rows(tmp_path, monkeypatch):
    rng = random.Random(5)
    fast_used = 0
    for case in range(300):
        data, clean = _file(rng)
        path = tmp_path / f"c{case}.jsonl"
        path.write_bytes(data)
        info = describe_file(str(path), None, "text")
        fs, local = paths.filesystem(str(path))
        fast = jsonl._by_arrow(data, "text", info.num_rows)
        assert (fast is not None) == clean, (case, data)
        fast_used += fast is not None
        got = _outcomes(jsonl.read_table(info.path, fs, local, "text", info.num_rows))
        with monkeypatch.context() as m:
            m.setattr(jsonl, "_by_arrow", lambda *a: None)
            want = _outcomes(jsonl.read_table(info.path, fs, local, "text", info.num_rows))
        assert got == want, (case, data)
        assert len(got) == info.num_rows
    assert 50 < fast_used < 280, fast_used


def test_a_line_longer_than_arrows_block_is_read_whole(tmp_path):
    texts = ["short one", "x" * (3 << 20), "short two"]
    path = write_jsonl(tmp_path / "long.jsonl", texts)
    data = open(path, "rb").read()
    table = jsonl._by_arrow(data, "text", 3)
    assert table is not None and table.column(0).to_pylist() == texts


def test_token_id_lists_take_the_arrow_path_and_bad_ones_are_errors(tmp_path):
    good = tmp_path / "ids.jsonl"
    good.write_text('{"ids": [1, 2, 3]}\n{"ids": []}\n{"ids": [50256]}\n')
    table = jsonl._by_arrow(good.read_bytes(), "ids", 3)
    assert table.column(0).to_pylist() == [[1, 2, 3], [], [50256]]
    for line in ('{"ids": [1, null]}', '{"ids": [1.5]}', '{"ids": [true]}', '{"ids": "text"}'):
        data = b'{"ids": [7]}\n' + line.encode() + b"\n"
        assert jsonl._by_arrow(data, "ids", 2) is None, line


def test_each_jsonl_file_is_parsed_once_however_streams_interleave(tmp_path, monkeypatch):
    files = [write_jsonl(tmp_path / f"p{i}.jsonl", make_texts(40, i)) for i in range(4)]
    config = make_config(files, unit_rows=4, num_streams=8, global_batch_size=8)
    plan = build_plan(config)
    assert len(plan.units) == 40
    parsed = Counter()
    real = jsonl.read_table

    def counting(path, *args, **kwargs):
        parsed[path] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(jsonl, "read_table", counting)
    forget_decoded()
    try:
        streams = [Stream(config, plan, s) for s in range(8)]
        while any(s.produce(1).num_rows for s in streams):  # every stream a row at a time
            pass
    finally:
        forget_decoded()
    # The single file kept before made each unit of another file parse it again.
    assert parsed == Counter(files), parsed


def test_compressed_jsonl_is_found_and_read_like_plain(tmp_path):
    texts = [make_texts(9, i) for i in range(4)]
    (tmp_path / "plain").mkdir()
    plain = write_jsonl(tmp_path / "plain" / "a.jsonl", texts[0])
    src = tmp_path / "src"
    src.mkdir()
    for name, codec, t in (("b.jsonl.gz", "gzip", texts[1]), ("c.json.zst", "zstd", texts[2]),
                           ("d.ndjson.bz2", "bz2", texts[3])):
        raw = "".join(json.dumps({"text": x}) + "\n" for x in t).encode()
        with pa.CompressedOutputStream(str(src / name), codec) as f:
            f.write(raw)
    (src / "notes.txt.gz").write_bytes(gzip.compress(b"not a corpus file"))
    config = make_config([plain, str(src)], unit_rows=4)
    plan = build_plan(config)
    assert [f.path.rsplit("/", 1)[1] for f in plan.files] == [
        "a.jsonl", "b.jsonl.gz", "c.json.zst", "d.ndjson.bz2"]
    assert [f.num_rows for f in plan.files] == [9, 9, 9, 9]
    docs = split_documents(stream_tokens(drain(Stream(config, plan, 0), 4)), EOS)
    assert Counter(map(tuple, docs)) == Counter(map(tuple, tokenize(sum(texts, []))))


@pytest.mark.parametrize("compression", ["uncompressed", "zstd", "lz4"])
def test_ipc_files_compressed_or_not_give_the_rows_of_parquet(tmp_path, compression):
    texts = make_texts(30, seed=3)
    ipc = write_arrow(tmp_path / "t.arrow", texts, batch_size=8, compression=compression)
    parquet = write_parquet(tmp_path / "t.parquet", texts, row_group_size=8)
    forget_decoded()
    try:
        for path in (ipc, parquet):
            config = make_config([path], unit_rows=3, num_streams=2)
            docs = [d for f in all_streams(config) for d in split_documents(stream_tokens(f), EOS)]
            assert Counter(map(tuple, docs)) == Counter(map(tuple, tokenize(texts))), path
        one = [drain(Stream(make_config([p], unit_rows=3), build_plan(make_config([p], unit_rows=3)),
                            0), 2) for p in (ipc, parquet)]
        np.testing.assert_array_equal(one[0], one[1])
        # An uncompressed batch is read in place from the memory-mapped file; a compressed one
        # is decompressed once and kept with the decoded Parquet row groups.
        kept = {k[0] for k in sources._row_groups}
        assert (ipc in kept) == (compression != "uncompressed"), kept
    finally:
        forget_decoded()


def test_a_file_changed_after_planning_is_an_error_not_other_rows(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", make_texts(10, 1))
    config = make_config([path], unit_rows=4)
    plan = build_plan(config)
    write_parquet(path, make_texts(12, 2))
    forget_decoded()  # a worker started after the change
    with pytest.raises(BadInputError) as e:
        read_texts(plan.files[0], 0, 0, 4, "text")
    assert e.value.reason == "corrupt_file" and e.value.path == path
    assert "12 rows" in str(e.value) and "10 when the plan was built" in str(e.value)


@pytest.mark.parametrize("tail", [b"", b"\n", b"\n\n", b'{"text": "no newline"}'])
def test_planning_counts_jsonl_lines_across_read_blocks(tmp_path, tail):
    data = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in make_texts(30, 4)) + tail
    path = tmp_path / "a.jsonl"
    path.write_bytes(data)
    fs, local = paths.filesystem(str(path))
    whole = jsonl.scan(fs, local)
    assert (sum(whole[0]), whole[1][-1]) == (data.count(b"\n") + (not data.endswith(b"\n")),
                                            len(data))
    for block in (1, 7, 64, 1000):
        assert jsonl.scan(fs, local, block=block) == whole, block
    # Groups of whole lines, cut the same way whatever the read block.
    grouped = jsonl.scan(fs, local, group_bytes=200)
    assert sum(grouped[0]) == sum(whole[0]) and len(grouped[0]) > 3
    for block in (1, 7, 64, 1000):
        assert jsonl.scan(fs, local, group_bytes=200, block=block) == grouped, block
    assert all(data[o - 1:o] == b"\n" for o in grouped[1][1:-1])
    assert [data[a:b].count(b"\n") + (b == len(data) and not data.endswith(b"\n"))
            for a, b in zip(grouped[1], grouped[1][1:], strict=False)] == list(grouped[0])


def test_files_are_planned_in_order_and_the_first_bad_one_in_order_is_named(tmp_path):
    texts = [make_texts(3 + i % 4, i) for i in range(40)]
    paths = [write_jsonl(tmp_path / f"f{i:02d}.jsonl", t) if i % 2 else
             write_parquet(tmp_path / f"f{i:02d}.parquet", t) for i, t in enumerate(texts)]
    plan = build_plan(make_config([str(tmp_path)]))
    assert [f.path for f in plan.files] == paths
    assert [f.num_rows for f in plan.files] == [len(t) for t in texts]
    # Three broken files: the plan names the first in path order, whichever thread read it.
    (tmp_path / "f13.jsonl").unlink()
    (tmp_path / "f13.parquet").write_bytes(b"PAR1 not really")
    with open(tmp_path / "f30.parquet", "r+b") as f:
        f.truncate(3)
    (tmp_path / "f31.parquet").write_bytes(b"nor this")
    with pytest.raises(BadInputError) as e:
        build_plan(make_config([str(tmp_path)]))
    assert e.value.path.endswith("f13.parquet"), e.value.path
    skipping = build_plan(make_config([str(tmp_path)], on_bad_file="skip"))
    assert [p.rsplit("/", 1)[1] for p, _, _ in skipping.skipped_files] == [
        "f13.parquet", "f30.parquet", "f31.parquet"]
    assert len(skipping.files) == 38


def test_long_planning_logs_its_progress(tmp_path, monkeypatch, caplog):
    paths = [write_jsonl(tmp_path / f"f{i}.jsonl", make_texts(3, i)) for i in range(5)]
    monkeypatch.setattr(plan_module, "_PROGRESS_EVERY_S", 0.0)  # every file counts as long
    with caplog.at_level(logging.INFO, logger="ingest.plan.build"):
        build_plan(make_config(paths))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planning:")]
    assert "read the metadata of 1 of 5 files" in lines[0], lines
    assert "read the metadata of 5 files in" in lines[-1], lines


@pytest.mark.parametrize("kind", ["string", "large_string", "binary", "large_binary"])
def test_decode_texts_codes_every_row_of_any_slice_as_its_value_says(kind):
    """Null, empty and (binary) invalid UTF-8 rows get their reason, the others their text,
    in arrays of both offset widths and slices of them (an offset into the buffers)."""
    rng = random.Random(kind)
    values = [None, "", "x", "héllo wörld", "a\nb"] + ([b"\xff\xfe"] if "binary" in kind else [])
    reasons = {None: "null_text", "": "empty_text", b"\xff\xfe": "invalid_utf8"}
    for _ in range(60):
        rows = [rng.choice(values) for _ in range(rng.randint(0, 40))]
        raw = [v.encode() if isinstance(v, str) and "binary" in kind else v for v in rows]
        arr = pa.array(raw, getattr(pa, kind)())
        a = rng.randint(0, len(rows))
        b = rng.randint(a, len(rows))
        texts, codes = decode_texts(arr.slice(a, b - a))
        want = [BAD_REASONS.index(reasons[v]) if v in reasons else 0 for v in rows[a:b]]
        assert codes.tolist() == want, (kind, rows, a, b)
        assert [t for t, c in zip(texts, codes, strict=True) if c == 0] == \
            [v for v, c in zip(rows[a:b], want, strict=True) if c == 0]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("copy", [True, False])
def test_a_jsonl_file_read_in_groups_gives_what_the_whole_file_does(tmp_path, monkeypatch,
                                                                    suffix, sequential, copy):
    """A JSONL file is split into groups of lines found by byte offset (plain; compressed,
    in a decompressed copy on disk) or by decompressing on (compressed, without the disk
    cache), so a reader holds a group, never the file: every row, with its bad-line reasons
    and their line numbers, as a parse of the whole file gives them."""
    if not copy and suffix == ".jsonl":
        pytest.skip("a plain file needs no copy")
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("INGEST_ROW_GROUP_CACHE_GB", "1" if copy else "0")
    texts = make_texts(300, 7)
    lines = [json.dumps({"text": t}) for t in texts]
    lines[0] = "\ufeff" + lines[0]
    lines[41] = "{not json"
    lines[150] = "[1, 2]"
    data = ("\n".join(lines)).encode()  # the last line without a newline
    path = tmp_path / f"f{suffix}"
    if suffix.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif suffix.endswith(".zst"):
        with pa.CompressedOutputStream(str(path), "zstd") as out:
            out.write(data)
    else:
        path.write_bytes(data)
    monkeypatch.setattr(jsonl, "GROUP_BYTES", 2000)
    monkeypatch.setattr(sources, "_copies", {})
    forget_decoded()
    info = describe_file(str(path), None, "text")
    assert len(info.row_groups) > 5 and info.num_rows == 300
    assert info.group_offsets[-1] == len(data)
    fs, local = paths.filesystem(str(path))
    whole = jsonl.read_table(str(path), fs, local, "text", 300)
    want = whole.column(0).cast(pa.binary()).to_pylist()
    want_bad = whole.column(1).to_pylist()
    got, got_bad = [], []
    try:
        for g, rows in enumerate(info.row_groups):
            for start in range(0, rows, 7):
                stop = min(rows, start + 7)
                arr, bad = read_texts(info, g, start, stop, "text", sequential=sequential)
                got += arr.cast(pa.binary()).to_pylist() if arr.type != pa.binary() \
                    else arr.to_pylist()
                got_bad += bad.tolist() if bad is not None else [0] * (stop - start)
    finally:
        forget_decoded()
    assert got == want and got_bad == want_bad
    copies = list((tmp_path / "cache").rglob("*")) if (tmp_path / "cache").exists() else []
    assert any(p.is_file() and p.stat().st_size == len(data) for p in copies) == (
        copy and suffix != ".jsonl")


def test_a_large_jsonl_files_scan_is_kept_for_the_next_plan_until_it_changes(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jsonl, "GROUP_BYTES", 2000)
    path = write_jsonl(tmp_path / "a.jsonl", make_texts(300, 3))
    scans = []
    real = jsonl.scan
    monkeypatch.setattr(jsonl, "scan", lambda *a, **k: scans.append(1) or real(*a, **k))
    first = describe_file(path, None, "text")
    assert describe_file(path, None, "text") == first and len(scans) == 1
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    again = describe_file(path, None, "text")
    assert len(scans) == 2 and again.num_rows == first.num_rows + 1


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_jsonl_file_in_groups_feeds_its_documents_in_order_and_again_the_same(
        tmp_path, monkeypatch, suffix):
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    texts = make_texts(200, 5)
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    path = tmp_path / f"a{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    monkeypatch.setattr(jsonl, "GROUP_BYTES", 1500)
    forget_decoded()
    config = make_config([path], shuffle=False, seq_len=8, unit_rows=16)
    assert len(build_plan(config).files[0].row_groups) > 5
    docs = split_documents(stream_tokens(all_streams(config)[0]), EOS)
    assert docs == tokenize(texts)
    # Shuffled: the same documents, and the same streams again from a fresh process state.
    shuffled = make_config([path], seq_len=8, unit_rows=16, num_streams=4, global_batch_size=4)
    one = all_streams(shuffled)
    forget_decoded()
    assert all((a == b).all() for a, b in zip(one, all_streams(shuffled), strict=True))
    got = sorted(d for s in one for d in split_documents(stream_tokens(s), EOS))
    assert got == sorted(tokenize(texts))
