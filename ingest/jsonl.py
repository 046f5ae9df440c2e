"""JSON Lines files: counting their lines, parsing them whole or a block of lines at a time.

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

__all__ = ["count_lines", "parse", "parse_blocks", "read_table"]

_BLOCK_BYTES = 4 << 20  # parse_blocks: about this much text at a time


def count_lines(fs: pafs.FileSystem, local: str, block: int = 16 << 20
                 ) -> tuple[int, int, str]:
    """A JSONL file's lines (a last one without newline counts), its bytes (decompressed),
    and a hash of them, read in blocks: planning never holds a whole file in memory."""
    h = hashlib.sha256()
    lines = total = 0
    last = b"\n"
    with fs.open_input_stream(local) as f:
        while data := f.read(block):
            h.update(data)
            lines += data.count(b"\n")
            total += len(data)
            last = data[-1:]
    return lines + (last != b"\n"), total, h.hexdigest()[:16]


def parse_blocks(path: str, f, column: str) -> Iterator[pa.Table]:
    """A JSONL file parsed a block of whole lines (about ``_BLOCK_BYTES``) at a time,
    each as ``read_table`` parses a whole file (its reasons are per line)."""
    rest, line = b"", 0
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


def read_table(path: str, fs: pafs.FileSystem, local: str, column: str, rows: int) -> pa.Table:
    """A JSONL file's ``column``, one row per line, and the reason codes of malformed lines
    (a second column, only if there are any). Compressed files (``.jsonl.gz``, ``.zst``...)
    are decompressed by their suffix."""
    with fs.open_input_stream(local) as f:
        data = f.read()
    return parse(path, data, column, rows)


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
    """``column`` parsed by Arrow's JSON reader (5x faster than ``json.loads`` per line on
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
