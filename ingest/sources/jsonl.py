"""JSON Lines files: cutting them into groups of lines, parsing them a group or a block of lines
at a time.

A line that is not a JSON object, or not valid UTF-8, is a bad *document* (its reason code in
``ingest.errors.BAD_REASONS``), not a bad file. Positions are 1-based line numbers.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import json
import re
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.json as pj

from ingest.errors import BAD_REASONS, BadInputError

__all__ = ["parse", "parse_blocks", "read_table", "scan"]

_BLOCK_BYTES = 4 << 20  # parse_blocks: about this much text at a time
# A JSONL file is split into groups of whole lines of at least this many (decompressed) bytes,
# cut at the first newline past the mark: a group is the unit of reading, so a worker holds
# one group's text and its parse, never the file, and finds a group of a plain file by a seek.
# Below the decoded-group cache's per-group limit, so that parsed groups are kept in memory.
GROUP_BYTES = 8 << 20
_READ_BYTES = 1 << 20  # scan and skip: read this much at a time


def scan(fs: pafs.FileSystem, local: str, group_bytes: int | None = None,
         block: int = _READ_BYTES, sink=None) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """A JSONL file's groups of lines, read in blocks (planning never holds a whole file):
    the lines of each group (a last line without newline counts), the byte offset of each
    group's start and of the end (decompressed bytes; one more than groups), and a hash of
    the content. A file under ``group_bytes`` is one group; an empty one, one group of 0.
    ``sink``: a binary file that the (decompressed) bytes are also written to."""
    group_bytes = group_bytes or GROUP_BYTES
    h = hashlib.sha256()
    rows: list[int] = []
    offsets = [0]
    lines = pos = 0
    last = b"\n"
    with fs.open_input_stream(local) as f:
        while data := f.read(block):
            h.update(data)
            if sink is not None:
                sink.write(data)
            i = 0
            while (mark := offsets[-1] + group_bytes - 1 - pos) < len(data):
                nl = data.find(b"\n", max(i, mark))
                if nl < 0:
                    break
                rows.append(lines + data.count(b"\n", i, nl + 1))
                offsets.append(pos + nl + 1)
                lines, i = 0, nl + 1
            lines += data.count(b"\n", i)
            pos += len(data)
            last = data[-1:]
    if pos > offsets[-1] or not rows:
        rows.append(lines + (last != b"\n"))
        offsets.append(pos)
    return tuple(rows), tuple(offsets), h.hexdigest()[:16]


class _Range:
    """The bytes ``[start, stop)`` of a file as a stream: a plain file is opened at
    ``start``; a compressed one cannot seek, so it is decompressed from its start and the
    bytes before ``start`` are read in blocks and dropped (bounded memory)."""

    def __init__(self, fs: pafs.FileSystem, local: str, start: int, stop: int, *,
                 compressed: bool):
        self._left = stop - start
        if compressed:
            self._f = fs.open_input_stream(local)
            skip = start
            while skip > 0:
                got = len(self._f.read(min(skip, _READ_BYTES)))
                if not got:
                    break
                skip -= got
        else:
            self._f = fs.open_input_file(local)
            self._f.seek(start)

    def read(self, n: int = -1) -> bytes:
        n = self._left if n < 0 else min(n, self._left)
        data = self._f.read(n) if n > 0 else b""
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._f.close()


def open_range(fs: pafs.FileSystem, local: str, start: int, stop: int, *,
               compressed: bool) -> _Range:
    """A stream of the (decompressed) bytes ``[start, stop)`` of a JSONL file."""
    return _Range(fs, local, start, stop, compressed=compressed)


def parse_blocks(path: str, f, column: str, first_line: int = 0) -> Iterator[pa.Table]:
    """A JSONL file (or a group of it whose first line is ``first_line``, 0-based) parsed a
    block of whole lines (about ``_BLOCK_BYTES``) at a time, each as ``read_table`` parses a
    whole file (its reasons are per line)."""
    rest, line = b"", first_line
    while True:
        data = f.read(_BLOCK_BYTES)
        rest += data
        cut = rest.rfind(b"\n") + 1 if data else len(rest)
        if not cut:
            if not data:
                return
            continue  # a line longer than a block: read on
        block, rest = rest[:cut], rest[cut:]
        rows = block.count(b"\n") + (not block.endswith(b"\n") and len(block) > 0)
        if rows:
            yield parse(path, block, column, rows, first_line=line)
        line += rows
        if not data:
            return


def read_table(path: str, fs: pafs.FileSystem, local: str, column: str, rows: int, *,
               start: int = 0, stop: int | None = None, first_line: int = 0,
               compressed: bool = False) -> pa.Table:
    """A JSONL file's ``column`` (or that of its bytes ``[start, stop)``, whole lines, the
    first of them line ``first_line``, 0-based), one row per line, and the reason codes of
    malformed lines (a second column, only if there are any). Compressed files
    (``.jsonl.gz``, ``.zst``...) are decompressed by their suffix."""
    if stop is None:
        with fs.open_input_stream(local) as f:
            data = f.read()
    else:
        f = open_range(fs, local, start, stop, compressed=compressed)
        try:
            data = f.read()
        finally:
            f.close()
    return parse(path, data, column, rows, first_line=first_line)


def parse(path: str, data: bytes, column: str, rows: int, *,
                 first_line: int = 0) -> pa.Table:
    """``read_table`` of JSONL text ``data`` of ``rows`` lines, the first of them line
    ``first_line`` (0-based) of the file ``path``. Only the file's start may hold a byte-order
    mark: a later line starting with one is malformed, which Arrow's reader would not see."""
    if not (first_line and data.startswith(codecs.BOM_UTF8)):
        table = _by_arrow(data, column, rows)
        if table is not None:
            return table
    texts, bad = _rows(path, data, column, first_line=first_line)
    if texts and any(isinstance(t, list) for t in texts):
        # A tokens_column: lists of ids (other rows are null or malformed).
        arr = pa.array([t if isinstance(t, list) else None for t in texts],
                       type=pa.list_(pa.int64()))
    else:
        arr = pa.array(texts, type=pa.binary())
    if not bad.any():
        return pa.table({"v": arr})
    return pa.table({"v": arr, "bad": pa.array(bad, type=pa.int8())})


_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n")


def _by_arrow(data: bytes, column: str, rows: int) -> pa.Table | None:
    """``column`` parsed by Arrow's JSON reader (much faster than ``json.loads`` per line on
    short documents), when that is exactly what the line-by-line parser gives: valid UTF-8,
    each of the ``rows`` lines one JSON object holding the column as a string (or a list of
    integers), never null. None otherwise: the slow parser finds and names the bad lines.

    Arrow skips blank lines and reads ``{..} {..}`` on one line as two rows, so with no blank
    line, as many rows as lines means one object per line.
    """
    first = data[:data.find(b"\n")] if b"\n" in data else data
    if (_BLANK_LINE.search(data) or not first.strip(b" \t\r")
            or not data.rsplit(b"\n", 1)[-1].strip(b" \t\r") and not data.endswith(b"\n")):
        return None
    offsets = pa.py_buffer(np.array([0, len(data)], dtype=np.int64))
    try:
        pa.LargeStringArray.from_buffers(1, offsets, pa.py_buffer(data)).validate(full=True)
        value = json.loads(first.removeprefix(codecs.BOM_UTF8)).get(column)
    except (pa.ArrowInvalid, ValueError, AttributeError):
        return None
    kind = pa.list_(pa.int64()) if isinstance(value, list) else pa.string()
    parse = pj.ParseOptions(explicit_schema=pa.schema([(column, kind)]),
                            unexpected_field_behavior="ignore")
    for block in (1 << 20, min(len(data) + 1, 2**31 - 1)):  # a longer line needs one block
        try:
            table = pj.read_json(pa.BufferReader(data), parse_options=parse,
                                 read_options=pj.ReadOptions(use_threads=False,
                                                             block_size=block))
            break
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e) or block > len(data):
                return None
    else:
        return None
    col = table.column(0)
    if table.num_rows != rows or col.null_count or (
            kind != pa.string() and pc.list_flatten(col).null_count):
        return None
    return pa.table({"v": col})


def _rows(path: str, data: bytes, text_column: str, *,
                first_line: int = 0) -> tuple[list, np.ndarray]:
    """All rows of JSONL text (a file, or its lines from ``first_line`` on) as UTF-8 bytes
    (None for null), or lists of token ids, and per row the reason code of a malformed line
    (else 0), parsed a line at a time."""
    if not first_line:
        data = data.removeprefix(codecs.BOM_UTF8)
    texts: list = []
    bad = np.zeros(data.count(b"\n") + 1, dtype=np.int8)
    for lineno, line in enumerate(io.BytesIO(data)):
        # Invalid UTF-8 or bad JSON on one line is a bad *document*, not a bad file.
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            bad[lineno] = BAD_REASONS.index("invalid_utf8")
            obj = None
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            bad[lineno] = bad[lineno] or BAD_REASONS.index("invalid_json")
            texts.append(None)
            continue
        if text_column not in obj:
            raise BadInputError(
                f"{path}: line {first_line + lineno + 1} has no field "
                f"text_column={text_column!r} (fields: {sorted(obj)}); set "
                f"sources[].text_column", reason="missing_column", path=path,
                row=first_line + lineno)
        value = obj[text_column]
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value):
            texts.append(value)  # token ids of a tokens_column
            continue
        if value is not None and not isinstance(value, str):
            raise BadInputError(
                f"{path}: line {first_line + lineno + 1}: text_column={text_column!r} "
                f"holds {type(value).__name__}, expected a string", reason="column_type",
                path=path, row=first_line + lineno)
        texts.append(None if value is None else value.encode("utf-8", "surrogatepass"))
    return texts, bad[:len(texts)]
