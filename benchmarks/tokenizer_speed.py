"""Single-core speed of the feed's tokenizer call (``encode_docs``) against HF tokenizers'
own, with the ids checked equal first.

    RAYON_NUM_THREADS=1 python -m benchmarks.tokenizer_speed TOKENIZER [TOKENIZER ...]

TOKENIZER is ``gpt2``, ``cl100k`` or a path (a ``tokenizer.json`` or a model folder). The
corpus is the Python standard library's sources (real text on every machine), cut into
documents of a few thousand characters. For each tokenizer it prints tokens per second of
``load_tokenizer(spec, "auto")`` and ``load_tokenizer(spec, "tiktoken")`` (tiktoken, or HF
tokenizers for ``tokenizer.json`` files), best of three, and their ratio.
"""

from __future__ import annotations

import argparse
import glob
import os
import sysconfig
import time

import numpy as np

os.environ.setdefault("RAYON_NUM_THREADS", "1")


def stdlib_documents(limit_chars: int, piece: int = 4000) -> list[str]:
    """The standard library's sources, cut into documents of ``piece`` characters."""
    out, total = [], 0
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        for i in range(0, len(text), piece):
            out.append(text[i:i + piece])
            total += len(out[-1])
        if total >= limit_chars:
            break
    return out


def tokens_per_second(tok, texts: list[str], repeats: int = 3) -> tuple[float, np.ndarray]:
    tok.encode_docs(texts[:50])  # first calls build caches
    best, tokens = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens, _ = tok.encode_docs(texts)
        best = min(best, time.perf_counter() - t0)
    return len(tokens) / best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizers", nargs="+")
    parser.add_argument("--chars", type=int, default=8_000_000)
    args = parser.parse_args()
    from ingest.tokenize.tokenizer import load_tokenizer

    texts = stdlib_documents(args.chars)
    print(f"{len(texts)} documents, {sum(map(len, texts)):,} characters, "
          f"RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']}")
    for spec in args.tokenizers:
        fast = load_tokenizer(spec, "auto")
        ref = load_tokenizer(spec, "tiktoken")
        fast_rate, fast_tokens = tokens_per_second(fast, texts)
        ref_rate, ref_tokens = tokens_per_second(ref, texts)
        same = np.array_equal(fast_tokens, ref_tokens)
        print(f"{spec}: {getattr(fast, 'backend', 'reference')} {fast_rate / 1e6:.2f} M "
              f"tokens/s, {type(ref).__name__} {ref_rate / 1e6:.2f} M tokens/s, "
              f"{fast_rate / ref_rate:.2f}x, ids equal: {same}")


if __name__ == "__main__":
    main()
