"""Faster exact BPE backends for the tiktoken vocabularies they are proven on.

A backend runs the same byte-pair encoding as tiktoken in another library. It is used only
for a vocabulary where a differential test against tiktoken (``tests/test_bpe_backend.py``,
over a large generated adversarial corpus and the standard library's sources) found identical
ids; it is runtime only: the ids, and so the batches, do not depend on it.

==============  ====================================================  ===================
backend         library call                                          vocabularies proven
==============  ====================================================  ===================
``toktok``      ``private_api.toktok_tokenizer("cl100k_base")``       cl100k, ASCII texts
``rs_bpe``      ``rs_bpe.bpe.openai.cl100k_base().encode``            cl100k
``bpe_openai``  ``bpe_openai.get_encoding("cl100k_base")``            cl100k
``tuetoken``    ``tuetoken.Tokenizer(tokenizer_json(encoding))``      gpt2
``riptoken``    ``riptoken.CoreBPE(ranks, specials, pattern)``        gpt2
==============  ====================================================  ===================

toktok, rs_bpe and bpe_openai hold named encodings in their compiled code and cannot run
GPT-2's vocabulary offline. toktok's ids differ from tiktoken's on a few texts with rare
characters (2 of 20,000 adversarial texts: one splits a text into pieces another way, one
merges a piece with a supplementary-plane character another way) and equal them on every ASCII
text tried, so it encodes ASCII texts only (``str.isascii``, which CPython answers without a
scan). A document with other characters is cut at line ends where every cl100k piece ends
(``ascii_runs``): its long ASCII stretches go to toktok, the lines holding other characters to
rs_bpe where it is installed, else to tiktoken (``_AsciiToktok``). tuetoken runs a
``tokenizer.json`` made from the tiktoken encoding's ranks, and sends texts with characters its
older Unicode tables class otherwise to tiktoken (``ingest.bpe_tuetoken``). riptoken is built
from the tiktoken encoding's own ranks, special tokens and pattern. It merges a regex piece of
``LONG_PIECE_BYTES`` bytes or more by another algorithm, whose ids can differ from tiktoken's
(``"1" * 501`` in GPT-2), so a text that may hold such a piece goes to tiktoken
(``long_piece_possible``); riptoken also encodes with an allowed special token, so a call's
documents go to it as one text joined by the end-of-document token, as they go to tiktoken
(``TiktokenTokenizer.encode_joined``).

``auto`` picks the first backend of ``FASTEST_FIRST`` proven on the vocabulary that is
installed and passes the load-time self-check, else tiktoken. The self-check encodes
``probe_texts()`` with both libraries, one text at a time and joined; if any id differs, the
tokenizer falls back to tiktoken with a warning. Its verdict is kept in the cache folder by
vocabulary and library files (``checked``), so worker processes after the first start
without running it. A document a backend cannot take (a string
with lone surrogates, one past a library's size limit) is encoded by tiktoken.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import logging
import random
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from ingest.bpe_tuetoken import GuardedTuetoken
from ingest.cache import cached_by_files
from ingest.private_api import (
    tiktoken_buffer_encoder,
    tiktoken_pattern,
    tiktoken_ranks,
    tiktoken_specials,
    toktok_tokenizer,
)

__all__ = ["FASTEST_FIRST", "LONG_PIECE_BYTES", "PROVEN", "FastBPETokenizer", "accelerate",
           "adversarial_texts", "ascii_runs", "checked", "int32_ids", "lists_with_eos",
           "load_docs_encoder", "load_encoder", "load_joined_encoder", "long_piece_possible",
           "probe_texts", "self_check"]

log = logging.getLogger("ingest.tokenize")

# Single-core speed of encode_docs on cl100k (one core of a shared, noisy 2-CPU machine, best
# of 3): on 1,000 stdlib files (3,800 tokens each) tiktoken 3.8 M tokens/s, rs_bpe 6.9 M
# (1.8x), bpe_openai 6.3 - 6.5 M (1.65x); on 17,000 paragraphs of them (80 tokens each)
# tiktoken 3.8 M, rs_bpe 6.3 M (1.65x), bpe_openai 5.6 M (1.45x).
# GPT-2 through encode_docs in units of 256 documents (one core, another such machine), the
# long-piece check included: the demo corpus tiktoken 3.2 M tokens/s, riptoken 4.5 M (1.38x);
# tiny documents 3.0 M and 4.2 M (1.42x).
# toktok (the lines with other characters on rs_bpe) on the demo corpus through the feed's
# call, on the benchmark's machine: 34.1 - 37.4 M tokens/s against tiktoken's 2.8 - 3.1 M
# (11.1 - 13.3x).
# tuetoken on GPT-2 through the feed's call there: the demo 18.8 M against 7.3 M (2.6x), tiny
# documents 11.2 M against 6.8 M (1.6x).
FASTEST_FIRST = ("toktok", "tuetoken", "rs_bpe", "bpe_openai", "riptoken")
# Vocabularies (tokenizer specs) each backend is proven on, and its name there.
PROVEN = {"toktok": {"cl100k": "cl100k_base", "cl100k_base": "cl100k_base"},
          "rs_bpe": {"cl100k": "cl100k_base", "cl100k_base": "cl100k_base"},
          "bpe_openai": {"cl100k": "cl100k_base", "cl100k_base": "cl100k_base"},
          "tuetoken": {"gpt2": "gpt2"},
          "riptoken": {"gpt2": "gpt2"}}

_NO_SPECIALS: frozenset[str] = frozenset()

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


def int32_ids(ids: Iterable[int], count: int) -> np.ndarray:
    """``count`` ids, a backend's Python ints (or an array of them), as int32. Most backends
    return lists; struct packs them in about two thirds of numpy's time (a list of 840k GPT-2
    ids: 22 against 35 ns an id, next to riptoken's 177 for encoding them)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int32, copy=False)
    return np.frombuffer(struct.pack(f"{count}i", *ids), dtype=np.int32)


def lists_with_eos(ids: list[Sequence[int]], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Each document's ids followed by ``eos_id``, back to back, and the index of each EOS
    (``Tokenizer.encode_docs``), from the id lists a library returns, in one pass in C."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    if ids and all(isinstance(x, np.ndarray) for x in ids):
        eos = np.array([eos_id], dtype=np.int32)
        return (np.concatenate([x for a in ids for x in (int32_ids(a, len(a)), eos)]),
                np.cumsum(lengths + 1) - 1)
    tokens = int32_ids(itertools.chain.from_iterable(
        itertools.chain.from_iterable(zip(ids, itertools.repeat((eos_id,))))),
        int(lengths.sum()) + len(ids))
    return tokens, np.cumsum(lengths + 1) - 1


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


def load_encoder(backend: str, encoding: str, reference=None) -> Callable[[str], Sequence[int]]:
    """The backend's encode-ordinary-text call for ``encoding`` (riptoken: for the tiktoken
    tokenizer ``reference``, whose ranks it is built from)."""
    if backend == "riptoken":
        return _GuardedRiptoken(reference.encoding).encode_ordinary
    if backend == "tuetoken":
        return _guarded_tuetoken(reference).encode_ordinary
    if backend == "toktok":
        return _ascii_toktok(encoding, reference).encode_ordinary
    if backend == "rs_bpe":
        try:
            from rs_bpe.bpe import openai  # noqa: PLC0415 (the fast-bpe extra)
        except ImportError as e:
            raise ImportError(f"rs_bpe is not installed ({e})") from e
        return getattr(openai, encoding)().encode
    if backend == "bpe_openai":
        try:
            import bpe_openai  # noqa: PLC0415 (the fast-bpe extra)
        except ImportError as e:
            raise ImportError(f"bpe_openai is not installed ({e})") from e
        return bpe_openai.get_encoding(encoding).encode_ordinary
    raise ValueError(f"tokenizer_backend={backend!r} is unknown; use 'auto', 'tiktoken' or one "
                     f"of {list(FASTEST_FIRST)}")


def load_joined_encoder(backend: str, reference) -> Callable[[str, frozenset], object] | None:
    """The backend's call that encodes a text with the given special tokens allowed, giving
    a buffer of int32 ids (what ``TiktokenTokenizer.encode_joined`` takes); None where the
    backend has none."""
    if backend == "riptoken":
        return _GuardedRiptoken(reference.encoding).encode
    return None


def load_docs_encoder(backend: str, reference
                      ) -> Callable[[list[str]], tuple[np.ndarray, np.ndarray]] | None:
    """The backend's call that gives ``Tokenizer.encode_docs``'s layout for a list of
    documents in one call; None where the backend has none."""
    if backend == "tuetoken":
        return _guarded_tuetoken(reference).encode_docs
    if backend == "toktok":
        return _ascii_toktok(PROVEN["toktok"][reference.name], reference).encode_docs
    return None


@functools.lru_cache(maxsize=8)
def _guarded_tuetoken(reference) -> GuardedTuetoken:
    return GuardedTuetoken.of_tiktoken(
        reference, f"{reference.name}-{vocabulary_digest(reference.encoding)}")


def _runs(text: str, sep: str, key: Callable[[str], bool]) -> Iterator[tuple[bool, str]]:
    """``text`` cut at ``sep`` into runs of consecutive parts with the same ``key``: each run
    as ``(key, its parts joined by sep, with the sep after it)``; none after the last run."""
    parts = text.split(sep)
    done = 0
    for flag, run in itertools.groupby(parts, key=key):
        run = list(run)
        done += len(run)
        yield flag, sep.join(run) + (sep if done < len(parts) else "")


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
# on their own: a shorter one stays in the part around it (a call costs about a microsecond).
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
            self._other = load_encoder("rs_bpe", encoding)
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


class FastBPETokenizer:
    """A tiktoken tokenizer whose encoding runs on a faster backend with identical ids.

    Attributes not defined here (``name``, ``eos_id``, ``vocab_size``, ...) are the tiktoken
    tokenizer's; ``fallbacks`` counts documents encoded by tiktoken instead.
    """

    def __init__(self, reference, backend: str, encode: Callable[[str], Sequence[int]],
                 encode_joined: Callable[[str, frozenset], object] | None = None,
                 encode_docs: Callable[[list[str]], tuple[np.ndarray, np.ndarray]] | None
                 = None):
        self.reference = reference
        self.backend = backend
        self._encode = encode
        self._encode_joined = encode_joined
        self._encode_docs = encode_docs
        self.fallbacks = 0

    def __getattr__(self, name: str):
        if name == "reference":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.reference, name)

    def _ids(self, text: str) -> Sequence[int]:
        try:
            return self._encode(text)
        except Exception:  # noqa: BLE001 (tiktoken takes it, or raises its own error)
            self.fallbacks += 1
            return self.reference.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [int32_ids(ids, len(ids)) for ids in map(self._ids, texts)]

    def encode_docs(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._encode_docs is not None and texts:
            try:
                return self._encode_docs(texts)
            except Exception:  # noqa: BLE001 (a text it cannot take: one call per document)
                pass
        if self._encode_joined is not None and texts:
            try:
                joined = self.reference.encode_joined(self._encode_joined, texts)
            except Exception:  # noqa: BLE001 (a text it cannot take: one call per document)
                joined = None
            if joined is not None:
                return joined
        return lists_with_eos([self._ids(t) for t in texts], self.reference.eos_id)


def self_check(reference, encode: Callable[[str], Sequence[int]],
               texts: list[str] | None = None, fast: FastBPETokenizer | None = None
               ) -> str | None:
    """None if ``encode`` gives the reference tokenizer's ids on every text (default:
    ``probe_texts()``), and ``fast.encode_docs`` its tokens and document ends on all of them in
    one call, as a stream makes it; else what differs (the first text, shortened)."""
    texts = probe_texts() if texts is None else texts
    want = reference.encode_batch(texts)
    for t, ids in zip(texts, want, strict=True):
        try:
            got = encode(t)
        except Exception as e:  # noqa: BLE001 (the probe texts are all valid text)
            return f"{t[:40]!r}: {type(e).__name__}: {e}"
        if not np.array_equal(np.asarray(got, dtype=np.int64), ids):
            return f"{t[:40]!r}"
    if fast is not None and texts:
        tokens, ends = fast.encode_docs(texts)
        eos = np.array([reference.eos_id], dtype=np.int32)
        if not (np.array_equal(tokens, np.concatenate([x for ids in want for x in (ids, eos)]))
                and np.array_equal(ends, np.cumsum([len(ids) + 1 for ids in want]) - 1)):
            return f"the probe texts encoded in one call ({len(texts)} documents)"
    return None


# The compiled modules whose code gives a backend's ids (tiktoken's: the reference's; toktok
# hands its other texts to rs_bpe).
_LIBRARY_MODULES = {"toktok": ("toktok._toktok", "rs_bpe.bpe"), "rs_bpe": ("rs_bpe.bpe",),
                    "bpe_openai": ("bpe_openai._bindings",),
                    "tuetoken": ("tuetoken._core", "ingest.bpe_tuetoken"),
                    "riptoken": ("riptoken._riptoken",)}


def _module_file(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # its package is not installed
        return None
    return spec.origin if spec is not None else None


def checked(reference, backend: str, encoding: str, fast: FastBPETokenizer) -> str | None:
    """``self_check``'s verdict on ``fast`` (``backend`` running its ``encoding``), kept in
    the cache folder (``ingest.cache``) by both, the vocabulary, and the files of both
    libraries and of this module: the first process on a machine runs it (about 0.3 s), later
    ones (every worker) read it."""
    files = [__file__] + [f for f in map(
        _module_file, (*_LIBRARY_MODULES[backend], "tiktoken._tiktoken")) if f]
    kind = f"backend-checks/{backend}-{encoding}-{vocabulary_digest(reference.encoding)}"
    return cached_by_files(kind, files, lambda: self_check(reference, fast._encode, fast=fast),
                           what=f"the check of {backend}'s ids against tiktoken's ({encoding})")


def _pattern_or_none(encoding) -> str | None:
    try:
        return tiktoken_pattern(encoding)
    except ImportError:
        return None


def vocabulary_digest(encoding) -> str:
    """A digest of a tiktoken encoding's ranks, pattern and special tokens (about 10 ms)."""
    ranks = tiktoken_ranks(encoding)
    h = hashlib.sha256(repr((_pattern_or_none(encoding),
                             sorted(tiktoken_specials(encoding).items()))).encode())
    h.update(np.fromiter(map(len, ranks), dtype=np.int32, count=len(ranks)).tobytes())
    h.update(b"".join(ranks))
    h.update(np.fromiter(ranks.values(), dtype=np.int64, count=len(ranks)).tobytes())
    return h.hexdigest()[:16]


def accelerate_hf(reference, backend: str):
    """``reference`` (a HF ``tokenizer.json`` on HF tokenizers) on tuetoken where its family
    is proven (``bpe_tuetoken.hf_family``) and tuetoken gives HF's ids on the probe texts.

    Args:
      reference: an ``ingest.tokenize.HFTokenizer``.
      backend: ``auto``, ``tiktoken`` (the reference library: HF tokenizers) or ``tuetoken``.

    Returns:
      A ``FastBPETokenizer`` on tuetoken, or ``reference`` itself.

    Raises:
      ValueError: another backend, or ``tuetoken`` named for a file it is not proven on or
        without its library.
    """
    if backend in ("tiktoken", "hf"):
        return reference
    if backend not in ("auto", "tuetoken"):
        raise ValueError(f"tokenizer_backend={backend!r} does not run HF tokenizer.json files "
                         f"(tokenizer={reference.name!r}); use tokenizer_backend: auto, "
                         f"tuetoken or tiktoken (HF tokenizers itself)")
    if reference.family is None:
        if backend == "tuetoken":
            raise ValueError(f"tokenizer_backend='tuetoken' is not proven on "
                             f"tokenizer={reference.name!r} (its normalizer, pre-tokenizer or "
                             f"model is not one of a proven family: GPT-2, GPT-NeoX/OLMo, "
                             f"Llama 3, Qwen2); use tokenizer_backend: auto")
        log.info("tokenizer %s runs on HF tokenizers (no faster backend is proven on its "
                 "pre-tokenizer)", reference.name)
        return reference
    try:
        guarded = GuardedTuetoken(reference.path, reference.encode_one, reference.eos_id,
                                  reference.literal)
    except ImportError as e:
        if backend == "tuetoken":
            raise ValueError(f"tokenizer_backend='tuetoken' needs its library: pip install "
                             f"tuetoken ({e})") from e
        return reference
    fast = FastBPETokenizer(reference, "tuetoken", guarded.encode_ordinary,
                            encode_docs=guarded.encode_docs)
    files = [__file__, reference.path] + [f for f in map(
        _module_file, (*_LIBRARY_MODULES["tuetoken"], "tokenizers.tokenizers")) if f]
    bad = cached_by_files(
        f"backend-checks/tuetoken-hf-{reference.family}", files,
        lambda: self_check(reference, fast._encode, fast=fast),
        what=f"the check of tuetoken's ids against HF tokenizers' ({reference.name})")
    if bad is not None:
        log.warning("tokenizer %s: backend tuetoken gave ids that differ from HF tokenizers' "
                    "on %s; using HF tokenizers", reference.name, bad)
        return reference
    log.info("tokenizer %s (%s family) runs on tuetoken (ids checked against HF tokenizers)",
             reference.name, reference.family)
    return fast


def accelerate(reference, spec: str, backend: str):
    """``reference`` (a tiktoken tokenizer of ``spec``) on ``backend`` where proven.

    Args:
      reference: the tokenizer ``spec`` loads on tiktoken (or HF tokenizers).
      spec: the tokenizer spec (``gpt2``, ``cl100k``, a path).
      backend: ``auto``, ``tiktoken`` or a name in ``FASTEST_FIRST``.

    Returns:
      A ``FastBPETokenizer``, or ``reference`` itself (tiktoken, or no proven backend).

    Raises:
      ValueError: an unknown backend, or a named one that is not proven on ``spec`` or is not
        installed.
    """
    if backend == "tiktoken":
        return reference
    if backend != "auto":
        if backend not in PROVEN:
            load_encoder(backend, "")  # raises, naming the choices
        if spec not in PROVEN[backend]:
            raise ValueError(f"tokenizer_backend={backend!r} is proven on tokenizer "
                             f"{sorted(PROVEN[backend])} only, not {spec!r}; use "
                             f"tokenizer_backend: auto or tiktoken")
    candidates = [b for b in (FASTEST_FIRST if backend == "auto" else (backend,))
                  if spec in PROVEN[b]]
    for name in candidates:
        try:
            fast = FastBPETokenizer(reference, name, load_encoder(name, PROVEN[name][spec],
                                                                  reference),
                                    load_joined_encoder(name, reference),
                                    load_docs_encoder(name, reference))
        except ImportError as e:
            if backend != "auto":
                raise ValueError(f"tokenizer_backend={backend!r} needs its library: pip "
                                 f"install {name.replace('_', '-')} ({e})") from e
            continue
        bad = checked(reference, name, PROVEN[name][spec], fast)
        if bad is not None:
            log.warning("tokenizer %s: backend %s gave ids that differ from tiktoken's on %s; "
                        "using tiktoken", spec, name, bad)
            continue
        log.info("tokenizer %s runs on %s (ids checked against tiktoken)", spec, name)
        return fast
    return reference


_SCRIPTS = ("Hello world, naïve café", "Привет, мир! Ёлка", "Γειά σου Κόσμε", "你好，世界。漢字かな交じり文",
            "こんにちは世界 カタカナ ﾊﾝｶｸ", "안녕하세요 세계", "مرحبا بالعالم ١٢٣", "שלום עולם",
            "नमस्ते दुनिया", "สวัสดีชาวโลก", "ሰላም ልዑል", "Ṱ̺̺̕o͞ ̷i̲̬͇̪͙n̝̗͕v̟̜̘̦͟o̶̙̰̠kè͚̮̺̪̹̱̤",
            "e\u0301 o\u0308 a\u030a", "ﬁ ﬂ Ⅻ ½ ² ⁴ ①", "𝕳𝖊𝖑𝖑𝖔 𝐀𝐁𝐂 𝟘𝟙𝟚")
_EMOJI = ("😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇯🇵", "❤️", "🧑🏿‍💻", "🤷‍♀️", "©️", "1️⃣")
_SPACES = (" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u2009", "\u200b",
           "\x0b", "\x0c", "\u0085", "\ufeff")
_CODE = ("def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = "
         "b[i]; }", "SELECT * FROM t WHERE id IN (1, 2, 3);", "<div class=\"a\">&amp;</div>",
         "{\"key\": [1, 2.5e-3, null, true]}", "x=>x?.y??z", "#!/bin/sh\nset -eu\n",
         "    \n\t\t}\n\n\n", "I'm you'RE they'll we've she'd IT'S don't", "$100,000.00 3.14159 "
         "1234567890 ١٢٣٤ ௧௨௩", "<|endoftext|> <|fim_prefix|><|endofprompt|>", "a\\nb\\tc")


def adversarial_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` generated texts that stress a BPE's pre-tokenizer and merges: code, mixed scripts,
    emoji, whitespace runs, long runs of one character, random code points, special-token
    strings, and random mixes of those pieces (deterministic for ``seed``)."""
    rng = random.Random(seed)
    pieces = _SCRIPTS + _EMOJI + _SPACES + _CODE

    def random_char() -> str:
        while True:
            c = rng.choice((rng.randrange(0x20, 0x250), rng.randrange(0x250, 0x3000),
                            rng.randrange(0x3000, 0xD800), rng.randrange(0xE000, 0x10000),
                            rng.randrange(0x10000, 0x110000)))
            if not 0xD800 <= c < 0xE000:
                return chr(c)

    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:  # a long run of one character or pair
            unit = rng.choice(("a", " ", "\n", "!", "1", "ab", " a", "\t ", "é", "😀", "'s", "."))
            out.append(rng.choice(("", "x", " ")) + unit * rng.randrange(1, 3000))
        elif kind == 1:  # whitespace runs between words
            out.append("".join(rng.choice(("w", "word", "Word", "1", ".")) + "".join(
                rng.choice(_SPACES) for _ in range(rng.randrange(0, 6)))
                for _ in range(rng.randrange(1, 60))))
        elif kind == 2:  # random code points
            out.append("".join(random_char() for _ in range(rng.randrange(1, 400))))
        elif kind == 3:  # code
            out.append("".join(rng.choice(_CODE) for _ in range(rng.randrange(1, 20))))
        else:  # mixes of every kind of piece
            out.append("".join(rng.choice(pieces) if rng.random() < 0.8 else random_char()
                               for _ in range(rng.randrange(1, 80))))
    return out


def probe_texts() -> list[str]:
    """The load-time self-check's texts: every fixed piece, and a few hundred generated ones
    (about 40 ms to encode with tiktoken)."""
    return list(_probe_texts())


@functools.cache
def _probe_texts() -> tuple[str, ...]:
    return (*_SCRIPTS, *_EMOJI, *_SPACES, *_CODE, "".join(_SCRIPTS + _EMOJI + _SPACES + _CODE),
            *adversarial_texts(300, seed=1))
