"""Faster exact BPE backends for the vocabularies they are proven on: one registry.

A backend (``ingest.tokenize.bpe_common.Backend``: a name, the vocabularies it is proven on, a loader,
a guard) runs the same byte-pair encoding as the reference library in another one. It is
used only for a vocabulary where a differential test against the reference
(``tests/test_bpe_backend.py`` for tiktoken, ``tests/test_hf_fast.py`` for HF tokenizers,
over a large generated adversarial corpus and the standard library's sources) found identical
ids; it is runtime only: the ids, and so the batches, do not depend on it.

==============  ===========================  ======================================  ========
backend         module                       vocabularies proven                     install
==============  ===========================  ======================================  ========
``toktok``      ``ingest.tokenize.bpe_toktok``        cl100k, ASCII texts                     core
``tuetoken``    ``ingest.tokenize.bpe_tuetoken``      gpt2; tokenizer.json: GPT-2/NeoX, Llama  core
                                             3, Qwen2 families
``rs_bpe``      ``ingest.tokenize.bpe_rsbpe``         cl100k                                  fast-bpe
``bpe_openai``  ``ingest.tokenize.bpe_bpeopenai``     cl100k                                  fast-bpe
``riptoken``    ``ingest.tokenize.bpe_riptoken``      gpt2                                    fast-bpe
==============  ===========================  ======================================  ========

``auto`` picks the first backend of ``REGISTRY`` proven on the vocabulary that is installed
and passes the load-time self-check, else the reference. The self-check encodes
``probe_texts()`` with both libraries, one text at a time and in one call; if any id differs,
the tokenizer falls back to the reference with a warning. Its verdict is kept in the cache
folder by vocabulary and library files (``checked``), so worker processes after the first
start without running it. A document a backend cannot take (a string with lone surrogates,
one past a library's size limit) is encoded by the reference.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import random
from collections.abc import Callable, Sequence

import numpy as np

from ingest.cache import cached_by_files
from ingest.tokenize import bpe_bpeopenai, bpe_riptoken, bpe_rsbpe, bpe_toktok, bpe_tuetoken
from ingest.tokenize.bpe_common import Backend, int32_ids, lists_with_eos, vocabulary_digest
from ingest.tokenize.bpe_tuetoken import GuardedTuetoken

__all__ = ["FASTEST_FIRST", "PROVEN", "REGISTRY", "FastBPETokenizer", "accelerate",
           "accelerate_hf", "adversarial_texts", "checked", "lists_with_eos", "probe_texts",
           "self_check"]

log = logging.getLogger("ingest.tokenize.tokenizer")

# Fastest first (single-core speeds: benchmarks/tokenizer_speed.py and benchmarks/RESULTS.md).
REGISTRY: dict[str, Backend] = {b.name: b for b in (
    bpe_toktok.BACKEND, bpe_tuetoken.BACKEND, bpe_rsbpe.BACKEND, bpe_bpeopenai.BACKEND,
    bpe_riptoken.BACKEND)}
FASTEST_FIRST = tuple(REGISTRY)
# Vocabularies (tokenizer specs) each backend is proven on, and its name there.
PROVEN = {name: b.proven for name, b in REGISTRY.items()}


class FastBPETokenizer:
    """A tokenizer whose encoding runs on a faster backend with the reference's ids.

    ``name``, ``eos_id``, ``vocab_size``, ``bos_id``, ``add_bos`` and ``specials_reason`` are
    the reference tokenizer's (tiktoken's, or HF tokenizers' for a ``tokenizer.json``);
    ``fallbacks`` counts documents encoded by the reference instead.
    """

    def __init__(self, reference, backend: str, encode: Callable[[str], Sequence[int]],
                 encode_joined: Callable[[str, frozenset], object] | None = None,
                 encode_docs: Callable[[list[str]], tuple[np.ndarray, np.ndarray]] | None
                 = None, family: str | None = None):
        self.reference = reference
        self.name: str = reference.name
        self.eos_id: int = reference.eos_id
        self.vocab_size: int = reference.vocab_size
        self.bos_id: int | None = reference.bos_id
        self.add_bos: bool = reference.add_bos
        self.specials_reason: str = reference.specials_reason
        self.family = family  # a tokenizer.json's proven family (ingest.tokenize.bpe_tuetoken.hf_family)
        self.backend = backend
        self._encode = encode
        self._encode_joined = encode_joined
        self._encode_docs = encode_docs
        self.fallbacks = 0

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


def _module_file(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # its package is not installed
        return None
    return spec.origin if spec is not None else None


def checked(reference, backend: str, encoding: str, fast: FastBPETokenizer) -> str | None:
    """``self_check``'s verdict on ``fast`` (``backend`` running its ``encoding``), kept in
    the cache folder (``ingest.cache``) by both, the vocabulary, and the files of both
    libraries and of this module: the first process on a machine runs it, later
    ones (every worker) read it."""
    files = [__file__] + [f for f in map(
        _module_file, (*REGISTRY[backend].modules,
                       f"ingest.tokenize.bpe_{backend.replace('_', '')}",
                       "tiktoken._tiktoken")) if f]
    kind = f"backend-checks/{backend}-{encoding}-{vocabulary_digest(reference.encoding)}"
    return cached_by_files(kind, files, lambda: self_check(reference, fast._encode, fast=fast),
                           what=f"the check of {backend}'s ids against tiktoken's ({encoding})")


def accelerate_hf(reference, backend: str):
    """``reference`` (a HF ``tokenizer.json`` on HF tokenizers) on tuetoken where its family
    is proven (``bpe_tuetoken.hf_family``) and tuetoken gives HF's ids on the probe texts.

    Args:
      reference: an ``ingest.tokenize.tokenizer.HFTokenizer``.
      backend: ``auto``, ``tiktoken`` (the reference library: HF tokenizers) or ``tuetoken``.

    Returns:
      A ``FastBPETokenizer`` on tuetoken, or ``reference`` itself.

    Raises:
      ValueError: another backend, or ``tuetoken`` named for a file it is not proven on or
        without its library.
    """
    if backend == "tiktoken":
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
                            encode_docs=guarded.encode_docs, family=reference.family)
    files = [__file__, reference.path] + [f for f in map(
        _module_file, (*REGISTRY["tuetoken"].modules, "ingest.tokenize.bpe_tuetoken",
                       "tokenizers.tokenizers")) if f]
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
        if backend not in REGISTRY:
            raise ValueError(f"tokenizer_backend={backend!r} is unknown; use 'auto', "
                             f"'tiktoken' or one of {list(FASTEST_FIRST)}")
        if spec not in PROVEN[backend]:
            raise ValueError(f"tokenizer_backend={backend!r} is proven on tokenizer "
                             f"{sorted(PROVEN[backend])} only, not {spec!r}; use "
                             f"tokenizer_backend: auto or tiktoken")
    candidates = [REGISTRY[b] for b in (FASTEST_FIRST if backend == "auto" else (backend,))
                  if spec in PROVEN[b]]
    for candidate in candidates:
        encoding = candidate.proven[spec]
        try:
            encoders = candidate.load(reference, encoding)
        except ImportError as e:
            if backend != "auto":
                raise ValueError(f"tokenizer_backend={backend!r} needs its library: pip "
                                 f"install {candidate.package} ({e})") from e
            continue
        fast = FastBPETokenizer(reference, candidate.name, encoders.encode,
                                encoders.encode_joined, encoders.encode_docs)
        bad = checked(reference, candidate.name, encoding, fast)
        if bad is not None:
            log.warning("tokenizer %s: backend %s gave ids that differ from tiktoken's on %s; "
                        "using tiktoken", spec, candidate.name, bad)
            continue
        log.info("tokenizer %s runs on %s (ids checked against tiktoken)", spec,
                 candidate.name)
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
    (a small share of a worker's start)."""
    return list(_probe_texts())


@functools.cache
def _probe_texts() -> tuple[str, ...]:
    return (*_SCRIPTS, *_EMOJI, *_SPACES, *_CODE, "".join(_SCRIPTS + _EMOJI + _SPACES + _CODE),
            *adversarial_texts(300, seed=1))
