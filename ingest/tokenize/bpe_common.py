"""The contract every faster exact BPE backend meets (``Backend``), and the helpers they share.

A backend module (``ingest.tokenize.bpe_toktok``, ``ingest.tokenize.bpe_tuetoken``, ``ingest.tokenize.bpe_rsbpe``,
``ingest.tokenize.bpe_bpeopenai``, ``ingest.tokenize.bpe_riptoken``) defines one ``BACKEND``; the registry
(``ingest.tokenize.bpe_backend.REGISTRY``) lists them, fastest first, and runs the self-check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ingest.tokenize.private_api import tiktoken_pattern, tiktoken_ranks, tiktoken_specials

__all__ = ["Backend", "Encoders", "int32_ids", "lists_with_eos", "vocabulary_digest"]

NO_SPECIALS: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Encoders:
    """A backend's calls for one vocabulary.

    Attributes:
      encode: ``encode(text) -> ids`` of ordinary text (a list or an int32 array).
      encode_joined: ``encode(text, allowed_special) -> int32 buffer``, for
        ``TiktokenTokenizer.encode_joined`` (a call's documents joined by the end-of-document
        token); None where the backend has none.
      encode_docs: ``Tokenizer.encode_docs`` of a list of documents in one call; None where
        the backend has none.
    """

    encode: Callable[[str], Sequence[int]]
    encode_joined: Callable[[str, frozenset], Any] | None = None
    encode_docs: Callable[[list[str]], tuple[np.ndarray, np.ndarray]] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
    """A faster library that gives the reference tokenizer's ids exactly where it is used.

    Attributes:
      name: the ``tokenizer_backend`` value.
      proven: the tokenizer specs it is proven on (a differential test against the reference
        in tests/test_bpe_backend.py) -> its own name for that vocabulary.
      load: ``load(reference, encoding) -> Encoders`` for the tiktoken tokenizer
        ``reference``; raises ImportError where the library is not installed.
      guard: the texts it hands to the reference library, and why (for the docs and logs).
      modules: the compiled modules whose code gives its ids (the self-check's verdict is kept
        while their files stay the same).
      package: its distribution on the package index.
    """

    name: str
    proven: Mapping[str, str]
    load: Callable[[Any, str], Encoders]
    guard: str
    modules: tuple[str, ...]
    package: str


def int32_ids(ids: Iterable[int], count: int) -> np.ndarray:
    """``count`` ids, a backend's Python ints (or an array of them), as int32. Most backends
    return lists; struct packs them faster than numpy converts a list."""
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


def _pattern_or_none(encoding) -> str | None:
    try:
        return tiktoken_pattern(encoding)
    except ImportError:
        return None


def vocabulary_digest(encoding) -> str:
    """A digest of a tiktoken encoding's ranks, pattern and special tokens (cheap next to the self-check it keys)."""
    ranks = tiktoken_ranks(encoding)
    h = hashlib.sha256(repr((_pattern_or_none(encoding),
                             sorted(tiktoken_specials(encoding).items()))).encode())
    h.update(np.fromiter(map(len, ranks), dtype=np.int32, count=len(ranks)).tobytes())
    h.update(b"".join(ranks))
    h.update(np.fromiter(ranks.values(), dtype=np.int64, count=len(ranks)).tobytes())
    return h.hexdigest()[:16]
