"""bpe-openai as an exact cl100k backend (the ``fast-bpe`` extra). It ships cl100k and o200k
offline; ``get_encoding("gpt2")`` downloads, so GPT-2 does not run on it here."""

from __future__ import annotations

from ingest.tokenize.bpe_common import Backend, Encoders

__all__ = ["BACKEND"]


def _load(reference, encoding: str) -> Encoders:
    try:
        import bpe_openai  # noqa: PLC0415 (the fast-bpe extra)
    except ImportError as e:
        raise ImportError(f"bpe_openai is not installed ({e})") from e
    return Encoders(encode=bpe_openai.get_encoding(encoding).encode_ordinary)


BACKEND = Backend(
    name="bpe_openai", proven={"cl100k": "cl100k_base", "cl100k_base": "cl100k_base"},
    load=_load, guard="a text past its input size limit (an error) goes to the reference",
    modules=("bpe_openai._bindings",), package="bpe-openai")
