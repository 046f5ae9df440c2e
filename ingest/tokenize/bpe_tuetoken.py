"""tuetoken as an exact GPT-2 backend: a ``tokenizer.json`` from tiktoken's own ranks, and
the characters on which its pre-tokenizer and tiktoken's disagree sent to tiktoken.

tuetoken splits text into pieces with Unicode tables older than tiktoken's: the letters and
digits that Unicode 16.0 added (5,004 code points, ``UNICODE_16_LETTERS_AND_DIGITS``) are
letters or digits to tiktoken and neither to tuetoken, so a text holding one may be cut into
other pieces (``"\\u1c89's"``: tiktoken ``[157, 110, 231, 338]``, tuetoken ``[..., 6, 82]``).
A text that holds such a character, or any character this Python's ``unicodedata`` has not
assigned (those a later Unicode may make letters, to a later tiktoken), is encoded by
tiktoken (``needs_tiktoken``); on every other code point, in every context tried, the ids are
tiktoken's. ASCII texts (``str.isascii``, which CPython answers without a scan) need no check.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import unicodedata
from collections.abc import Callable

import numpy as np

from ingest.cache import cache_root, cached_by_files, made_once, write_atomically
from ingest.tokenize.bpe_common import Backend, Encoders, vocabulary_digest
from ingest.tokenize.private_api import tiktoken_buffer_encoder, tiktoken_ranks, tiktoken_specials

__all__ = ["BACKEND", "UNICODE_16_LETTERS_AND_DIGITS", "GuardedTuetoken", "hf_family",
           "needs_tiktoken", "tokenizer_json"]

log = logging.getLogger("ingest.tokenize.tokenizer")

# The ranges (first, last) of letters and decimal digits new in Unicode 16.0.
UNICODE_16_LETTERS_AND_DIGITS = (
    (0x1C89, 0x1C8A), (0xA7CB, 0xA7CD), (0xA7DA, 0xA7DC), (0x105C0, 0x105F3),
    (0x10D40, 0x10D65), (0x10D6F, 0x10D85), (0x10EC2, 0x10EC4), (0x11380, 0x11389),
    (0x1138B, 0x1138B), (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113B7),
    (0x113D1, 0x113D1), (0x113D3, 0x113D3), (0x116D0, 0x116E3), (0x11BC0, 0x11BE0),
    (0x11BF0, 0x11BF9), (0x13460, 0x143FA), (0x16100, 0x1611D), (0x16130, 0x16139),
    (0x16D40, 0x16D6C), (0x16D70, 0x16D79), (0x18CFF, 0x18CFF), (0x1CCF0, 0x1CCF9),
    (0x1E5D0, 0x1E5ED), (0x1E5F0, 0x1E5FA), (0x2EBF0, 0x2EE5D))
# unicodedata's tables past this version may call letters what tuetoken's do not, and no
# longer mark them unassigned: the backend is then not used.
NEWEST_UNICODE = (16, 0)


@functools.cache
def _tiktoken_only() -> np.ndarray:
    """A flag per code point: True where a text holding it goes to tiktoken. Made once per
    machine and Unicode version, kept in the cache folder (reading it is cheaper than making it)."""
    bits = cached_by_files(f"tuetoken-guard-{unicodedata.unidata_version}", [__file__],
                           _tiktoken_only_bits,
                           what="the table of the characters tuetoken is not used on")
    return np.unpackbits(bits, count=0x110000).view(bool)


def _tiktoken_only_bits() -> np.ndarray:
    flags = np.zeros(0x110000, dtype=bool)
    for first, last in UNICODE_16_LETTERS_AND_DIGITS:
        flags[first:last + 1] = True
    category = unicodedata.category
    flags[[c for c in range(0x110000) if category(chr(c)) == "Cn"]] = True
    return np.packbits(flags)


def needs_tiktoken(texts: list[str]) -> list[int]:
    """The indices of ``texts`` that hold a character tuetoken may split otherwise: all but
    the ASCII ones are looked up in a table of every code point (numpy passes)."""
    other = [i for i, t in enumerate(texts) if not t.isascii()]
    if not other:
        return []
    flags = _tiktoken_only()
    codes = np.frombuffer("".join([texts[i] for i in other]).encode("utf-32-le",
                                                                    "surrogatepass"),
                          dtype=np.uint32)
    if not flags[codes].any():
        return []
    return [i for i in other if flags[np.frombuffer(texts[i].encode(
        "utf-32-le", "surrogatepass"), dtype=np.uint32)].any()]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the character HF tokenizers writes for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The pair whose merge makes ``token``: its bytes merged by rank down to two parts."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = min(range(len(parts) - 1),
                   key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 62))
        if parts[best] + parts[best + 1] not in ranks:
            return None
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def tokenizer_json(encoding, name: str) -> str:
    """The path of a HF ``tokenizer.json`` for the GPT-2 tiktoken ``encoding`` (its ranks as
    a byte-level BPE: vocabulary, merges in rank order, GPT-2's pre-tokenizer), written to
    the cache folder by vocabulary ``name`` once, else to a
    temporary file."""
    path = os.path.join(cache_root(), "tuetoken", f"{name}.json")
    if os.path.exists(path):
        return path

    def dump(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(_tokenizer_spec(encoding), f)

    try:
        with made_once(f"tuetoken's vocabulary for {name}", os.path.dirname(path)):
            write_atomically(path, dump)
    except OSError:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        dump(path)
    return path


def _tokenizer_spec(encoding) -> dict:
    ranks = tiktoken_ranks(encoding)
    alphabet = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        pair = _merge_of(token, ranks) if len(token) > 1 else None
        if pair is not None:
            merges.append(f"{text(pair[0])} {text(pair[1])}")
    return {"version": "1.0",
            "model": {"type": "BPE", "vocab": {text(t): r for t, r in ranks.items()},
                      "merges": merges},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": True, "use_regex": True},
            "decoder": {"type": "ByteLevel"},
            "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}
                             for s, i in tiktoken_specials(encoding).items()]}


# The pre-tokenizers of HF ``tokenizer.json`` files tuetoken is proven on (tests/
# test_hf_fast.py: a differential test against HF tokenizers per family). Their patterns class
# characters by letter, digit and whitespace only, so the letters and digits of
# ``UNICODE_16_LETTERS_AND_DIGITS`` and the unassigned characters are all a guard needs.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PROVEN_SPLIT_PATTERNS = {_LLAMA3_PATTERN: "llama3", _QWEN2_PATTERN: "qwen2"}
_BYTE_LEVEL_ALONE = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_BYTE_LEVEL_AFTER_SPLIT = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}


def _has(node: object, want: dict) -> bool:
    return isinstance(node, dict) and all(node.get(k) == v for k, v in want.items())


def hf_family(spec: dict) -> str | None:
    """The family of a parsed ``tokenizer.json`` that tuetoken is proven on (``gpt2``: a
    byte-level BPE with GPT-2's own pre-tokenizer, as GPT-2, GPT-NeoX and OLMo; ``llama3``,
    ``qwen2``: a split by that family's pattern, then bytes), else None: another model,
    normalizer (Qwen2's NFC is allowed: its texts are normalized the same way by both),
    pre-tokenizer, or BPE options tuetoken does not take."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    if spec.get("normalizer") not in (None, {"type": "NFC"}):
        return None
    pre = spec.get("pre_tokenizer")
    if _has(pre, _BYTE_LEVEL_ALONE):
        return "gpt2" if spec.get("normalizer") is None else None
    if not (_has(pre, {"type": "Sequence"}) and len(pre.get("pretokenizers", ())) == 2):
        return None
    split, byte_level = pre["pretokenizers"]
    if not (_has(split, {"type": "Split", "behavior": "Isolated", "invert": False})
            and _has(byte_level, _BYTE_LEVEL_AFTER_SPLIT)):
        return None
    return PROVEN_SPLIT_PATTERNS.get((split.get("pattern") or {}).get("Regex"))


class GuardedTuetoken:
    """tuetoken on texts where its ids are proven, the reference library on the others; both
    give int32 arrays (tuetoken's uint32 ids, viewed).

    Args:
      path: the ``tokenizer.json`` tuetoken loads.
      reference: ``encode(text) -> int32 ids`` of the reference library (ordinary text).
      eos_id: the id put after each document by ``encode_docs``.
      literal: strings a text must not hold to go to tuetoken (a HF file's added tokens that
        are not special: HF splits them out of ordinary text).
    """

    def __init__(self, path: str, reference: Callable[[str], np.ndarray], eos_id: int,
                 literal: tuple[str, ...] = ()):
        try:
            import tuetoken  # noqa: PLC0415 (its wheels cover a few platforms only)
        except ImportError as e:
            raise ImportError(f"tuetoken is not installed ({e})") from e

        if tuple(map(int, unicodedata.unidata_version.split(".")[:2])) > NEWEST_UNICODE:
            raise ImportError(f"this Python's Unicode {unicodedata.unidata_version} is newer "
                              f"than the {'.'.join(map(str, NEWEST_UNICODE))} tuetoken's "
                              f"ids are proven against")
        self._fast = tuetoken.Tokenizer(path)
        self._reference = reference
        self._eos_id = eos_id
        self._literal = literal

    @classmethod
    def of_tiktoken(cls, reference, name: str) -> GuardedTuetoken:
        """For the tiktoken tokenizer ``reference`` (GPT-2): a ``tokenizer.json`` made from
        its ranks (``tokenizer_json``), tiktoken's core on the other texts."""
        buffer = tiktoken_buffer_encoder(reference.encoding)
        return cls(tokenizer_json(reference.encoding, name),
                   lambda text: np.frombuffer(buffer(text, frozenset()), dtype=np.int32),
                   reference.eos_id)

    def _needs_reference(self, texts: list[str]) -> list[int]:
        out = needs_tiktoken(texts)
        if self._literal:
            flagged = set(out)
            out = sorted(flagged | {i for i, t in enumerate(texts)
                                    if any(s in t for s in self._literal)})
        return out

    def encode_ordinary(self, text: str) -> np.ndarray:
        if (not text.isascii() or self._literal) and self._needs_reference([text]):
            return self._reference(text)
        return np.frombuffer(self._fast.encode_to_bytes(text), dtype=np.int32)

    def encode_docs(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``Tokenizer.encode_docs``: each document's ordinary ids and the end-of-document id
        after it, in one call (on one thread); the index of each EOS."""
        out = self._fast.encode_ordinary_to_buffer(texts, 1)
        ids, offsets = out["data"].view(np.int32), out["offsets"]
        other = self._needs_reference(texts)
        if other:
            parts = [ids[offsets[i]:offsets[i + 1]] for i in range(len(texts))]
            for i in other:
                parts[i] = self._reference(texts[i])
            ids = np.concatenate(parts)
            offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
        # ingest.tokenize.tokenizer.with_eos's layout (this module is below it): an EOS after each
        # document's ids, and the index of each EOS.
        ends = offsets[1:]
        return (np.insert(ids, ends, np.int32(self._eos_id)),
                ends + np.arange(len(texts), dtype=np.int64))


@functools.lru_cache(maxsize=8)
def _guarded_tuetoken(reference) -> GuardedTuetoken:
    return GuardedTuetoken.of_tiktoken(
        reference, f"{reference.name}-{vocabulary_digest(reference.encoding)}")


def _load(reference, encoding: str) -> Encoders:
    guarded = _guarded_tuetoken(reference)
    return Encoders(encode=guarded.encode_ordinary, encode_docs=guarded.encode_docs)


BACKEND = Backend(
    name="tuetoken", proven={"gpt2": "gpt2"}, load=_load,
    guard="texts holding a letter or digit new in Unicode 16, or an unassigned character, go "
          "to the reference",
    modules=("tuetoken._core",), package="tuetoken")
