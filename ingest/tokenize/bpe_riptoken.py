"""riptoken as an exact GPT-2 backend: built from the tiktoken encoding's own ranks, special
tokens and pattern. It merges a regex piece of ``LONG_PIECE_BYTES`` bytes or more by another
algorithm, whose ids can differ from tiktoken's (``"1" * 501`` in GPT-2), so a text that may
hold such a piece goes to tiktoken (``long_piece_possible``); riptoken also encodes with an
allowed special token, so a call's documents go to it as one text joined by the
end-of-document token, as they go to tiktoken (``TiktokenTokenizer.encode_joined``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ingest.tokenize.bpe_common import NO_SPECIALS, Backend, Encoders, int32_ids
from ingest.tokenize.private_api import (
    tiktoken_buffer_encoder,
    tiktoken_pattern,
    tiktoken_ranks,
    tiktoken_specials,
)

__all__ = ["BACKEND", "LONG_PIECE_BYTES", "long_piece_possible"]

_NO_SPECIALS = NO_SPECIALS

# riptoken merges pieces of this many bytes or more another way (its heap path).
LONG_PIECE_BYTES = 500
# A GPT-2 piece is one space at most and a run of letters, of numbers or of other characters
# that are not whitespace, or a run of whitespace. So a piece of LONG_PIECE_BYTES in UTF-8
# holds a run of LONG_PIECE_BYTES - 1 bytes with no ASCII whitespace byte, or one with no
# ASCII byte that is not whitespace: bytes of other characters may belong to either run.
_RUN_BYTES = LONG_PIECE_BYTES - 1
_ASCII_WS = b"\t\n\x0b\x0c\r "  # the regex's \s below 128 (str.isspace adds \x1c-\x1f)
# Byte -> 1 where it may be part of whitespace, 0 where it may be part of a run of
# non-whitespace; other characters' bytes get the mark that makes the run go on.
_WS_MARK = bytes(int(b in _ASCII_WS) for b in range(128)) + b"\0" * 128
_TEXT_MARK = bytes(int(b in _ASCII_WS) for b in range(128)) + b"\1" * 128
_NOT_WS_RUN, _WS_RUN = b"\0" * _RUN_BYTES, b"\1" * _RUN_BYTES


def long_piece_possible(text: str) -> bool:
    """Whether a GPT-2 piece of ``text`` may reach ``LONG_PIECE_BYTES`` in UTF-8: False means
    it cannot (every run of non-whitespace and of whitespace is shorter)."""
    if 4 * len(text) < _RUN_BYTES:
        return False
    data = text.encode("utf-8", "surrogatepass")
    if len(data) < _RUN_BYTES:
        return False
    if data.isascii():  # one map: each byte is whitespace or not
        marks = data.translate(_WS_MARK)
        return _NOT_WS_RUN in marks or _WS_RUN in marks
    return _NOT_WS_RUN in data.translate(_WS_MARK) or _WS_RUN in data.translate(_TEXT_MARK)


def _runs(text: str, sep: str, key: Callable[[str], bool]) -> Iterator[tuple[bool, str]]:
    """``text`` cut at ``sep`` into runs of consecutive parts with the same ``key``: each run
    as ``(key, its parts joined by sep, with the sep after it)``; none after the last run."""
    parts = text.split(sep)
    done = 0
    for flag, run in itertools.groupby(parts, key=key):
        run = list(run)
        done += len(run)
        yield flag, sep.join(run) + (sep if done < len(parts) else "")


@functools.lru_cache(maxsize=8)
def _riptoken_core(encoding):
    """riptoken's encoder of a tiktoken ``Encoding``: its ranks, special tokens and pattern."""
    try:
        import riptoken  # noqa: PLC0415 (the fast-bpe extra)
    except ImportError as e:
        raise ImportError(f"riptoken is not installed ({e})") from e
    return riptoken.CoreBPE(tiktoken_ranks(encoding), tiktoken_specials(encoding),
                            tiktoken_pattern(encoding))


class _GuardedRiptoken:
    """riptoken where no piece can reach ``LONG_PIECE_BYTES``, tiktoken's own core elsewhere."""

    def __init__(self, encoding):
        self._fast = _riptoken_core(encoding)
        self._tiktoken = tiktoken_buffer_encoder(encoding)

    def encode_ordinary(self, text: str) -> Sequence[int]:
        if long_piece_possible(text):
            return np.frombuffer(self._tiktoken(text, _NO_SPECIALS), dtype=np.int32)
        return self._fast.encode_ordinary(text)

    def encode(self, text: str, allowed: frozenset) -> np.ndarray:
        """``text`` with ``allowed`` special tokens, as int32 ids. The text is cut where the
        allowed token stands (no piece crosses one); runs of parts that may hold a long piece
        go to tiktoken, the others to riptoken."""
        if not long_piece_possible(text):
            return self._riptoken(text, allowed)
        if len(allowed) != 1:
            return np.frombuffer(self._tiktoken(text, allowed),
                                 dtype=np.int32)
        (sep,) = allowed  # the end-of-document token that joins a call's documents
        return np.concatenate([
            np.frombuffer(self._tiktoken(segment, allowed),
                          dtype=np.int32) if long else self._riptoken(segment, allowed)
            for long, segment in _runs(text, sep, long_piece_possible)])

    def _riptoken(self, text: str, allowed: frozenset) -> np.ndarray:
        ids = self._fast.encode(text, allowed)
        return int32_ids(ids, len(ids))


def _load(reference, encoding: str) -> Encoders:
    guarded = _GuardedRiptoken(reference.encoding)
    return Encoders(encode=guarded.encode_ordinary, encode_joined=guarded.encode)


BACKEND = Backend(
    name="riptoken", proven={"gpt2": "gpt2"}, load=_load,
    guard="texts where a GPT-2 piece may reach LONG_PIECE_BYTES go to tiktoken",
    modules=("riptoken._riptoken",), package="riptoken")
