"""The one place ``ingest`` uses another library's private API, each with a public fallback.

- ``toktok_tokenizer``: toktok's full encoder (``toktok._toktok.Tokenizer``). The package's
  public API counts tokens and truncates; its encoder, which gives the ids as one numpy array,
  is the compiled class behind it (the package calls it "the full encode/decode surface" and
  keeps it for those who want it). When this toktok lacks it, the ``toktok`` backend is not
  available and ``tokenizer_backend: auto`` runs the next proven one; the self-check at start
  guards against a release whose encoder gives other ids.
- ``tiktoken_*``: a tiktoken ``Encoding``'s ranks, pattern and special tokens (which other BPE
  libraries are built from), and its core's call that returns ids as one buffer without the
  Python ``encode_to_numpy`` wraps around it. The fallbacks rebuild the ranks and special
  tokens through the public API and call ``encode_to_numpy``; without a pattern, the backends
  that need one are not available.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["tiktoken_buffer_encoder", "tiktoken_pattern", "tiktoken_ranks",
           "tiktoken_specials", "toktok_tokenizer"]


def toktok_tokenizer(encoding: str) -> Any:
    """toktok's encoder of ``encoding`` (a name compiled into it, e.g. ``cl100k_base``).

    Raises:
      ImportError: toktok is not installed, or keeps its encoder elsewhere.
    """
    try:
        from toktok._toktok import Tokenizer  # noqa: PLC0415 (optional, loaded on demand)
    except ImportError as e:
        raise ImportError(f"toktok's encoder is not available: {e}") from e
    return Tokenizer(encoding, "")


def tiktoken_ranks(encoding) -> dict[bytes, int]:
    """A tiktoken ``Encoding``'s mergeable ranks (token bytes -> rank)."""
    ranks = getattr(encoding, "_mergeable_ranks", None)
    if isinstance(ranks, dict):
        return ranks
    specials = set(tiktoken_specials(encoding).values())
    return {encoding.decode_single_token_bytes(i): i for i in range(encoding.n_vocab)
            if i not in specials}


def tiktoken_specials(encoding) -> dict[str, int]:
    """A tiktoken ``Encoding``'s special tokens (string -> id)."""
    specials = getattr(encoding, "_special_tokens", None)
    if isinstance(specials, dict):
        return specials
    return {t: encoding.encode_single_token(t) for t in encoding.special_tokens_set}


def tiktoken_pattern(encoding) -> str:
    """A tiktoken ``Encoding``'s pre-tokenization pattern.

    Raises:
      ImportError: this tiktoken keeps it elsewhere (the backends built from it are then not
        available).
    """
    pattern = getattr(encoding, "_pat_str", None)
    if not isinstance(pattern, str):
        raise ImportError("this tiktoken does not expose its encoding's pattern")
    return pattern


def tiktoken_buffer_encoder(encoding) -> Callable[[str, frozenset], Any]:
    """``encode(text, allowed_special)``: the ids as a buffer of int32 (tiktoken's core
    ``encode_to_tiktoken_buffer``, else the public ``encode_to_numpy``)."""
    call = getattr(getattr(encoding, "_core_bpe", None), "encode_to_tiktoken_buffer", None)
    if call is not None:
        return call

    def encode(text: str, allowed: frozenset) -> np.ndarray:
        return encoding.encode_to_numpy(text, allowed_special=allowed,
                                        disallowed_special=()).view(np.int32)

    return encode
