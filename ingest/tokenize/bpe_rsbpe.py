"""rs-bpe as an exact cl100k backend (the ``fast-bpe`` extra). It holds named encodings in
its compiled code and cannot run GPT-2's vocabulary offline."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ingest.tokenize.bpe_common import Backend, Encoders

__all__ = ["BACKEND", "rs_bpe_encoder"]


def rs_bpe_encoder(encoding: str) -> Callable[[str], Sequence[int]]:
    """rs-bpe's encoder of ``encoding`` (a name compiled into it, e.g. ``cl100k_base``).

    Raises:
      ImportError: rs-bpe is not installed.
    """
    try:
        from rs_bpe.bpe import openai  # noqa: PLC0415 (the fast-bpe extra)
    except ImportError as e:
        raise ImportError(f"rs_bpe is not installed ({e})") from e
    return getattr(openai, encoding)().encode


BACKEND = Backend(
    name="rs_bpe", proven={"cl100k": "cl100k_base", "cl100k_base": "cl100k_base"},
    load=lambda reference, encoding: Encoders(encode=rs_bpe_encoder(encoding)),
    guard="a text it cannot take (an error) goes to the reference",
    modules=("rs_bpe.bpe",), package="rs-bpe")
