"""Vocabulary files: ``.tiktoken`` ranks (checked line by line, recognized when they are one of
OpenAI's encodings) and the special tokens a local Hugging Face model folder names.
``ingest.tokenize.tokenizer`` builds the tokenizers from them."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os

from ingest.cache import cached_by_files

__all__ = ["GPT2_PATTERN", "HFFolderFiles", "hf_folder_files", "model_file_error",
           "read_tiktoken_ranks", "tiktoken_file_encoding"]

# GPT-2's pre-tokenization pattern (tiktoken's r50k_base/gpt2 pat_str).
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
_CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"""
                   r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
_O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""",
    r"""\s+""",
])
# Ranks are token ids, int32 in the feed's arrays.
_MAX_RANK = 2**31 - 1
# OpenAI's encodings by the SHA-256 of their ranks written canonically (one ``base64 rank``
# line per rank, in rank order: the published files' hashes): name, pattern, special tokens.
_KNOWN_RANKS = {
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930":
        ("r50k_base", GPT2_PATTERN, {"<|endoftext|>": 50256}),
    "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069":
        ("p50k_base", GPT2_PATTERN, {"<|endoftext|>": 50256}),
    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7":
        ("cl100k_base", _CL100K_PATTERN,
         {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
          "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d":
        ("o200k_base", _O200K_PATTERN, {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}),
}


def tiktoken_file_encoding(path: str) -> tuple[dict[bytes, int], str, dict[str, int]]:
    """A ``.tiktoken`` file's ranks (checked, cached by the file), pattern and special tokens:
    those of the OpenAI encoding the ranks are.

    Raises:
      ValueError: a damaged file (``read_tiktoken_ranks``), or ranks of another vocabulary,
        whose pattern and special tokens the file does not hold.
    """
    ranks = cached_by_files("tiktoken-ranks-checked", [path],
                            lambda: read_tiktoken_ranks(path), what=f"the ranks of {path}")
    known = _KNOWN_RANKS.get(_ranks_hash(ranks))
    if known is None:
        raise ValueError(
            f"tokenizer={path!r}: its {len(ranks)} ranks are not one of the vocabularies "
            f"known here ({', '.join(k[0] for k in _KNOWN_RANKS.values())}), and a .tiktoken "
            f"file holds neither the split pattern nor the special tokens (the "
            f"end-of-document id) its model uses; guessing them would give wrong ids and "
            f"separators. Give the model's Hugging Face tokenizer.json (or the folder holding "
            f"it with tokenizer_config.json), which names both")
    _, pattern, specials = known
    return ranks, pattern, specials


def _ranks_hash(ranks: dict[bytes, int]) -> str:
    """SHA-256 of ranks written canonically (``base64 rank`` lines in rank order)."""
    h = hashlib.sha256()
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(base64.b64encode(token) + b" %d\n" % rank)
    return h.hexdigest()


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """A ``.tiktoken`` file's ranks (one ``base64-token rank`` pair a line), checked: a
    damaged file is named with its line here, not a crash inside the tokenizer later.

    Raises:
      ValueError: an empty file, a line that is not ``BASE64 RANK``, a rank given twice or a
        token listed twice, or a vocabulary lacking a single byte (BPE starts from bytes).
    """
    with open(path, "rb") as f:
        data = f.read()
    fix = "replace it with a complete .tiktoken file (one 'BASE64TOKEN RANK' pair a line)"
    ranks: dict[bytes, int] = {}
    line_of: dict[int, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = [p.decode("utf-8", "replace") for p in line.split()]
        where = f"tokenizer={path!r}, line {lineno} ({line[:60].decode('utf-8', 'replace')!r})"
        if len(parts) != 2:
            raise ValueError(f"{where}: expected 'BASE64TOKEN RANK'; {fix}")
        try:
            token = base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: {parts[0][:40]!r} is not base64; {fix}") from None
        if not parts[1].isdigit():
            raise ValueError(f"{where}: rank {parts[1][:20]!r} is not an integer >= 0; "
                             f"{fix}") from None
        rank = int(parts[1])
        if rank >= _MAX_RANK:
            raise ValueError(f"{where}: rank {rank} is too large (a rank is below "
                             f"{_MAX_RANK}, an id of the vocabulary); {fix}")
        if rank in line_of:
            raise ValueError(f"{where}: rank {rank} was already given on line "
                             f"{line_of[rank]}; ranks must be unique; {fix}")
        if token in ranks:
            raise ValueError(f"{where}: this token already has rank {ranks[token]}; {fix}")
        ranks[token] = rank
        line_of[rank] = lineno
    if not ranks:
        raise ValueError(f"tokenizer={path!r} is empty ({len(data)} bytes, no ranks); {fix}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"tokenizer={path!r} has no token for {len(missing)} single byte(s) (e.g. "
            f"{bytes(missing[:4])!r}): every byte needs a rank for BPE to encode any text; "
            f"{fix}")
    return ranks


def _special_token(value) -> str | None:
    """A special token's string in a HF config (a string, or ``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFFolderFiles:
    """What a local Hugging Face model folder says about its tokenizer.

    Attributes:
      tokenizer_json: the path of its ``tokenizer.json``.
      eos_token, bos_token: the strings its configs name (None: none named).
      add_bos_token: its ``tokenizer_config.json``'s ``add_bos_token`` (None: not given; the
        ``tokenizer.json``'s post-processor decides, as in HF tokenizers).
    """

    tokenizer_json: str
    eos_token: str | None
    bos_token: str | None
    add_bos_token: bool | None


def hf_folder_files(path: str) -> HFFolderFiles:
    """A local Hugging Face model folder's ``tokenizer.json`` path, and the ``eos_token``,
    ``bos_token`` and ``add_bos_token`` its ``tokenizer_config.json`` (else
    ``special_tokens_map.json``) names.

    Raises:
      ValueError: no ``tokenizer.json`` in the folder, or a config that is not valid JSON.
    """
    tok_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_json):
        present = sorted(os.listdir(path))[:12]
        raise ValueError(
            f"tokenizer={path!r} is a folder without tokenizer.json (it has {present}); give "
            f"a folder holding a Hugging Face tokenizer.json (a model with only a "
            f"SentencePiece tokenizer.model needs converting: load it with transformers' "
            f"AutoTokenizer.from_pretrained(folder) and save_pretrained it, which writes "
            f"tokenizer.json)")
    named: dict[str, object] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer={path!r}: {name} is not valid JSON ({e}); fix or "
                             f"remove it") from e
        if not isinstance(cfg, dict):
            continue
        for role in ("eos_token", "bos_token"):
            if (token := _special_token(cfg.get(role))) is not None:
                named[role] = token
        if isinstance(cfg.get("add_bos_token"), bool):
            named["add_bos_token"] = cfg["add_bos_token"]
    return HFFolderFiles(tokenizer_json=tok_json, eos_token=named.get("eos_token"),
                         bos_token=named.get("bos_token"),
                         add_bos_token=named.get("add_bos_token"))


def model_file_error(path: str) -> ValueError:
    """The error for a ``.model`` file: a SentencePiece model, or Meta's Llama 3
    ``tokenizer.model`` (tiktoken ranks), neither of which is loaded directly."""
    with open(path, "rb") as f:
        head = f.read(64)
    first = head.split(b"\n", 1)[0].split()
    if len(first) == 2 and first[1].isdigit():
        return ValueError(
            f"tokenizer={path!r} holds tiktoken ranks (Meta's Llama 3 tokenizer.model), "
            f"without the split pattern and special tokens the model uses; give the model's "
            f"Hugging Face folder (tokenizer.json and tokenizer_config.json) instead")
    return ValueError(
        f"tokenizer={path!r} is a SentencePiece model, which is not loaded directly; convert "
        f"it to a tokenizer.json (transformers: AutoTokenizer.from_pretrained(folder)"
        f".save_pretrained(out), or tokenizers' SentencePieceBPETokenizer/"
        f"SentencePieceUnigramTokenizer) and give the folder holding it")
