"""The one place ``ingest`` uses another library's private API, with a fallback.

``toktok_tokenizer`` gives toktok's full encoder (``toktok._toktok.Tokenizer``): the package's
public API counts tokens and truncates, and its encoder, which gives the ids as one numpy
array, is the compiled class behind it (the package calls it "the full encode/decode surface"
and keeps it for those who want it). When this toktok lacks it, the ``toktok`` backend is not
available and ``tokenizer_backend: auto`` runs the next proven one; the self-check at start
(``ingest.bpe_backend``) guards against a release whose encoder gives other ids.
"""

from __future__ import annotations

from typing import Any

__all__ = ["toktok_tokenizer"]


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
