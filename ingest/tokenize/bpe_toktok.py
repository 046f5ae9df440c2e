"""toktok as an exact cl100k backend, on ASCII text.

toktok holds named encodings in its compiled code. Its ids differ from tiktoken's on a few
texts with rare characters (2 of 20,000 adversarial texts: one splits a text into pieces
another way, one merges a piece with a supplementary-plane character another way) and equal
them on every ASCII text tried, so it encodes ASCII texts only (``str.isascii``, which CPython
answers without a scan). A document with other characters is cut at line ends where every
cl100k piece ends (``ascii_runs``): its long ASCII stretches go to toktok, the lines holding
other characters to rs_bpe where it is installed, else to tiktoken (``_AsciiToktok``).
"""

from __future__ import annotations

import functools
import itertools
import re

import numpy as np

from ingest.tokenize.bpe_common import NO_SPECIALS, Backend, Encoders, int32_ids, lists_with_eos
from ingest.tokenize.bpe_rsbpe import rs_bpe_encoder
from ingest.tokenize.private_api import tiktoken_buffer_encoder, toktok_tokenizer

__all__ = ["BACKEND", "ascii_runs"]

_NO_SPECIALS = NO_SPECIALS

# cl100k's pattern (tiktoken's):
#   '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+
#   |\s++$|\s*[\r\n]|\s+(?!\S)|\s
# Only the last five alternatives take a newline, and each piece they make with one ends at the
# last \r or \n of its whitespace run unless the run reaches the text's end ("\s++$"): so where
# a newline is followed by whitespace without \r or \n and then a character that is not
# whitespace, a piece ends after the newline, and the pieces on each side are those of the
# text cut there (the pattern looks behind nowhere; the "$" and "(?!\S)" tests meet the same
# answer at the cut as in the whole text). Python's \s holds every character of the pattern's
# \s (and \x1c - \x1f besides), so a cut found here is one there.
_LINE_END = re.compile(r"\n(?=[^\S\r\n]*\S)")
_LINE_START = re.compile(r"[^\S\r\n]*\S")
# The fewest characters of an ASCII stretch between two lines outside ASCII that go to toktok
# on their own: a shorter one stays in the part around it (each call has a fixed cost).
_MIN_ASCII_PART = 256


def _cut_before(text: str, lo: int, i: int) -> int:
    """The last cut (``ascii_runs``) in ``[lo, i]``, else ``lo``."""
    j = i
    while (j := text.rfind("\n", lo, j)) >= 0:
        if _LINE_START.match(text, j + 1):
            return j + 1
    return lo


def _cut_after(text: str, i: int) -> int:
    """The first cut (``ascii_runs``) at ``i`` or after it, else the text's end."""
    if 0 < i < len(text) and text[i - 1] == "\n" and _LINE_START.match(text, i):
        return i
    end = _LINE_END.search(text, i)
    return len(text) if end is None else end.end()


def ascii_runs(text: str) -> list[tuple[bool, str]]:
    """``text`` cut at line ends where every cl100k piece ends, as ``(ascii, part)`` in order,
    no two neighbours alike: the lines that hold a character outside ASCII, with the ASCII
    stretches of fewer than ``_MIN_ASCII_PART`` characters between them, and the ASCII
    stretches between those. The parts' ids, back to back, are the text's. A text with more
    than one character in eight outside ASCII, or whose ASCII stretches would hold at most half
    of it, is one part. The lines are found in numpy passes over the code points; Python takes
    a step per part."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    others = np.flatnonzero(codes > 0x7F)
    if not len(others):
        return [(True, text)] if text else []
    # The ASCII between neighbours outside ASCII, where enough to go on its own: an upper
    # bound on what the parts below would send to toktok (the lines around are cut off).
    gaps = np.diff(others)
    room = int(others[0]) + len(text) - int(others[-1]) + int(gaps[gaps > _MIN_ASCII_PART].sum())
    if len(others) * 8 > len(text) or 2 * room <= len(text):
        return [(False, text)]
    # Line j is [bounds[j], bounds[j + 1]); the lines holding a character outside ASCII, and
    # those of them after an ASCII stretch long enough to go on its own.
    bounds = np.concatenate(([0], np.flatnonzero(codes == 0x0A) + 1, [len(text)]))
    lines = np.unique(np.searchsorted(bounds, others, side="right")) - 1
    starts, ends = bounds[lines], bounds[lines + 1]
    new = np.flatnonzero(starts[1:] - ends[:-1] >= _MIN_ASCII_PART) + 1
    firsts, lasts = starts[np.r_[0, new]], ends[np.r_[new - 1, len(lines) - 1]]
    if 2 * int((lasts - firsts).sum()) > len(text):
        return [(False, text)]  # at most half of it would go to toktok: not worth the cuts
    out: list[tuple[bool, str]] = []
    done = 0  # where the text not yet in out begins
    for a, b in zip(firsts.tolist(), lasts.tolist(), strict=True):
        a, b = _cut_before(text, done, max(a, done)), _cut_after(text, max(b, done))
        if a > done:
            out.append((True, text[done:a]))
        if out and not out[-1][0]:  # no cut between it and the last part: one part
            out[-1] = (False, out[-1][1] + text[done:b])
        else:
            out.append((False, text[a:b]))
        done = b
    if done < len(text):
        out.append((True, text[done:]))
    return out


@functools.lru_cache(maxsize=8)
def _ascii_toktok(encoding: str, reference) -> _AsciiToktok:
    return _AsciiToktok(encoding, reference)


class _AsciiToktok:
    """toktok on ASCII texts, where its ids are proven; in other texts, toktok on their ASCII
    stretches and rs_bpe (where it is installed, else tiktoken) on the lines with other
    characters (``ascii_runs``). Its calls give int32 arrays (toktok's uint32 ids, viewed)."""

    def __init__(self, encoding: str, reference):
        self._fast = toktok_tokenizer(encoding)
        self._reference = reference
        self._tiktoken = tiktoken_buffer_encoder(reference.encoding)
        try:
            self._other = rs_bpe_encoder(encoding)
        except ImportError:
            self._other = None

    def encode_ordinary(self, text: str) -> np.ndarray:
        if text.isascii():
            return self._toktok(text, _NO_SPECIALS)
        return self._ordinary_other(text)

    def _ordinary_other(self, text: str) -> np.ndarray:
        """A text with a character outside ASCII: its ASCII stretches on toktok, the rest on
        ``_other_lines``."""
        runs = ascii_runs(text)
        if len(runs) == 1:
            return self._other_lines(text)
        return np.concatenate([self._toktok(part, _NO_SPECIALS) if ascii
                               else self._other_lines(part) for ascii, part in runs])

    def _other_lines(self, text: str) -> np.ndarray:
        if self._other is None:
            return np.frombuffer(self._tiktoken(text, _NO_SPECIALS),
                                 dtype=np.int32)
        ids = self._other(text)
        return int32_ids(ids, len(ids))

    def encode_docs(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``Tokenizer.encode_docs`` of a call's documents: each run of ASCII documents in one
        toktok call, joined by the end-of-document token (``TiktokenTokenizer.encode_joined``,
        which falls back where a document holds that token's string), the others one by one
        (``encode_ordinary``). No text is joined to be split again."""
        tokens, ends, at = [], [], 0
        for ascii, run in itertools.groupby(texts, str.isascii):
            run = list(run)
            out = self._reference.encode_joined(self._toktok, run) if ascii else None
            if out is None:
                out = lists_with_eos([self.encode_ordinary(t) for t in run],
                                     self._reference.eos_id)
            tokens.append(out[0])
            ends.append(out[1] + at)
            at += len(out[0])
        return np.concatenate(tokens), np.concatenate(ends)

    def _toktok(self, text: str, allowed: frozenset) -> np.ndarray:
        return self._fast.encode_to_numpy(text, allowed_special=allowed,
                                          disallowed_special=()).view(np.int32)


def _load(reference, encoding: str) -> Encoders:
    toktok = _ascii_toktok(encoding, reference)
    return Encoders(encode=toktok.encode_ordinary, encode_docs=toktok.encode_docs)


BACKEND = Backend(
    name="toktok", proven={"cl100k": "cl100k_base", "cl100k_base": "cl100k_base"},
    load=_load,
    guard="the lines of a text that hold a character outside ASCII go to rs_bpe or tiktoken",
    modules=("toktok._toktok", "rs_bpe.bpe"), package="toktok-rs")
