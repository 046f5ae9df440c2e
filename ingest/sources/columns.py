"""Arrow columns as the feed reads them: a text column as Python strings with a reason code per
bad row, and integer columns as numpy views without a copy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ingest.errors import BAD_REASONS

__all__ = ["decode_texts", "numpy_view", "one_array"]


def decode_texts(arr: pa.Array) -> tuple[list[str | None], np.ndarray]:
    """Turns a string/binary array into Python strings.

    Returns:
      (texts, bad) where ``bad[i]`` is 0 for a usable text, else a reason code from
      ``BAD_REASONS`` (the text at a bad index is None).
    """
    n = len(arr)
    bad = np.zeros(n, dtype=np.int8)
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        raw = arr.to_pylist()
        texts = []
        for i, b in enumerate(raw):
            if b is None:
                texts.append(None)
                continue
            try:
                texts.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(None)
                bad[i] = BAD_REASONS.index("invalid_utf8")
        return _mark_empty(arr, texts, bad)
    try:
        arr.validate(full=True)
        texts = arr.to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError):
        # Some value is not valid UTF-8: find which, one by one (rare, so the slow path is fine).
        texts = []
        for i in range(n):
            try:
                v = arr[i].as_py()
            except (pa.ArrowInvalid, UnicodeDecodeError):
                v = None
                bad[i] = BAD_REASONS.index("invalid_utf8")
            texts.append(v)
    return _mark_empty(arr, texts, bad)


def one_array(col: pa.ChunkedArray) -> pa.Array:
    """``col`` as one array: its only chunk as it is, else the chunks joined (a copy)."""
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def numpy_view(arr: pa.Array | pa.ChunkedArray, *, nulls_ok: bool = False) -> np.ndarray:
    """A numpy copy-free view of an Arrow integer array (booleans: unpacked).

    Read off the data buffer: ``Array.to_numpy``, ``fill_null`` and ``pa.scalar`` import
    pandas on first use, which costs every worker time and memory it never needs. With
    ``nulls_ok``, the values at null slots are undefined: mask them with ``is_null()``.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = one_array(arr)
    if arr.null_count and not nulls_ok:
        raise ValueError("numpy_view needs an array without nulls (or nulls_ok=True)")
    n = len(arr)
    if pa.types.is_boolean(arr.type):
        if n == 0:
            return np.zeros(0, dtype=bool)
        bits = np.unpackbits(np.frombuffer(arr.buffers()[1], dtype=np.uint8), bitorder="little")
        return bits[arr.offset:arr.offset + n].astype(bool)
    if not pa.types.is_integer(arr.type):
        raise TypeError(f"numpy_view takes integer or boolean arrays, got {arr.type}")
    kind = "i" if pa.types.is_signed_integer(arr.type) else "u"
    dtype = np.dtype(f"<{kind}{arr.type.bit_width // 8}")
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=n, offset=arr.offset * dtype.itemsize)


def _mark_empty(arr: pa.Array, texts: list, bad: np.ndarray) -> tuple[list, np.ndarray]:
    """Marks null and empty texts, from the offsets rather than a Python loop over documents
    (cheaper than ``pc.binary_length`` on a unit)."""
    t = arr.type
    large = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
    if large or pa.types.is_string(t) or pa.types.is_binary(t):
        width = 8 if large else 4
        offsets = np.frombuffer(arr.buffers()[1], dtype=f"<i{width}", count=len(arr) + 1,
                                offset=arr.offset * width)
        empty = offsets[1:] == offsets[:-1]
    else:  # another layout (string views): Arrow's lengths
        empty = numpy_view(pc.binary_length(arr), nulls_ok=True) == 0
    code = np.where(empty, np.int8(BAD_REASONS.index("empty_text")), np.int8(0))
    if arr.null_count:  # whatever the offsets of a null slot, it is null
        code[numpy_view(arr.is_null())] = BAD_REASONS.index("null_text")
    return texts, np.where(bad != 0, bad, code)
