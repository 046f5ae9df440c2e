"""The faster BPE backends give tiktoken's ids exactly, on every vocabulary they are used for
(a differential test on a large generated adversarial corpus and the standard library's
sources); a backend whose ids differ is refused at load; and the batches do not depend on the
backend (real libraries, real files, 8 forced CPU devices)."""

from __future__ import annotations

import glob
import logging
import random
import sysconfig

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import make_texts

from ingest import BatchDigest, Config, RuntimeOptions, SourceConfig
from ingest.errors import ConfigError
from ingest.tokenize import bpe_toktok
from ingest.tokenize.bpe_backend import (
    FASTEST_FIRST,
    PROVEN,
    REGISTRY,
    FastBPETokenizer,
    accelerate,
    adversarial_texts,
    checked,
    self_check,
)
from ingest.tokenize.bpe_riptoken import LONG_PIECE_BYTES, long_piece_possible
from ingest.tokenize.bpe_toktok import _AsciiToktok, ascii_runs
from ingest.tokenize.tokenizer import TiktokenTokenizer, load_tokenizer
from jax_side import HostFeed, batch_sharding

BUNDLED = ("gpt2", "cl100k")


def load_encoder(backend: str, encoding: str, reference=None):
    """The backend's encode-ordinary-text call for ``encoding`` (the registry's loader)."""
    return REGISTRY[backend].load(reference, encoding).encode


def stdlib_texts() -> list[str]:
    """Every stdlib ``.py`` file that is UTF-8, and random slices of them (cut anywhere)."""
    files = [f for f in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py",
                                         recursive=True)) if "site-packages" not in f]
    texts = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                texts.append(fh.read())
        except (UnicodeDecodeError, OSError):
            continue
    rng = random.Random(0)
    for _ in range(3000):
        t = rng.choice(texts)
        a = rng.randrange(len(t) + 1)
        texts.append(t[a:a + rng.randrange(1, 400)])
    return texts


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    texts = adversarial_texts(30_000, seed=0) + stdlib_texts()
    assert len(texts) > 33_000 and sum(map(len, texts)) > 20_000_000
    return texts


@pytest.fixture(scope="module")
def tiktoken_ids(corpus_texts):
    """tiktoken's ids of every corpus text, per vocabulary, computed once when asked."""
    cache: dict[str, list[list[int]]] = {}

    def ids(vocab: str) -> list[list[int]]:
        if vocab not in cache:
            enc = load_tokenizer(vocab, "tiktoken")._enc
            cache[vocab] = [enc.encode_ordinary(t) for t in corpus_texts]
        return cache[vocab]

    return ids


@pytest.mark.parametrize("vocab", BUNDLED)
@pytest.mark.parametrize("backend", FASTEST_FIRST)
def test_backend_ids_equal_tiktoken_wherever_it_is_used(vocab, backend, corpus_texts,
                                                        tiktoken_ids):
    reference = load_tokenizer(vocab, "tiktoken")
    assert isinstance(reference, TiktokenTokenizer)
    if vocab not in PROVEN[backend]:
        # Not proven, never used: auto runs another backend, and naming it is refused.
        assert getattr(load_tokenizer(vocab, "auto"), "backend", "tiktoken") != backend
        with pytest.raises(ValueError, match="is proven on tokenizer"):
            load_tokenizer(vocab, backend)
        if backend not in ("riptoken", "tuetoken"):  # no offline encoding of it there
            with pytest.raises(Exception):  # noqa: B017,PT011 (the library's own error)
                load_encoder(backend, vocab)
        return
    encode = load_encoder(backend, PROVEN[backend][vocab], reference)
    bad, refused = [], 0
    for t, want in zip(corpus_texts, tiktoken_ids(vocab), strict=True):
        try:
            got = list(encode(t))
        except ValueError:  # bpe_openai takes under 1M characters (tiktoken encodes those)
            assert len(t) >= 1_000_000
            refused += 1
            continue
        if got != want:
            bad.append(t)
    assert not bad, f"{len(bad)} texts differ, first {bad[0][:80]!r}"
    assert refused <= 2
    # The tokenizer the feed uses, both calls, against tiktoken's own.
    fast = load_tokenizer(vocab, backend)
    assert isinstance(fast, FastBPETokenizer) and fast.backend == backend
    sample = corpus_texts[::7]
    want_tokens, want_eos = reference.encode_docs(sample)
    got_tokens, got_eos = fast.encode_docs(sample)
    assert got_tokens.dtype == np.int32 and np.array_equal(got_tokens, want_tokens)
    assert np.array_equal(got_eos, want_eos)
    for got, want in zip(fast.encode_batch(sample[:500]), reference.encode_batch(sample[:500]),
                         strict=True):
        assert got.dtype == np.int32 and np.array_equal(got, want)
    assert (fast.eos_id, fast.vocab_size, fast.name) == (reference.eos_id,
                                                         reference.vocab_size, reference.name)


def test_auto_is_the_fastest_proven_backend_and_tiktoken_is_tiktoken():
    assert load_tokenizer("cl100k").backend == FASTEST_FIRST[0]
    assert load_tokenizer("gpt2").backend == "tuetoken"
    for vocab in BUNDLED:
        assert isinstance(load_tokenizer(vocab, "tiktoken"), TiktokenTokenizer)


def _runs_near_the_long_piece_size() -> list[str]:
    """Runs of one character (1 to 4 bytes, each class of GPT-2's pieces) just below, at and
    just above ``LONG_PIECE_BYTES``, alone and between other text."""
    texts = []
    for ch in ("1", "a", "#", "é", "日", "🙂", " ", "\n", "\t", "\u3000", "\u00a0"):
        width = len(ch.encode())
        for size in range(LONG_PIECE_BYTES - 6, LONG_PIECE_BYTES + 6):
            run = ch * (size // width)
            texts += [run, f"x {run} y", f" {run}", f"{run}!", f"ab{run}\n{run[:40]}"]
    return texts


def test_a_text_that_may_hold_a_long_piece_is_told_apart():
    # Below the size no piece can reach it; at it, a run of one kind of character can.
    assert not long_piece_possible("1" * (LONG_PIECE_BYTES - 2))
    assert long_piece_possible("1" * (LONG_PIECE_BYTES - 1))  # with a space before: 500
    assert not long_piece_possible(" " * (LONG_PIECE_BYTES - 2))
    assert long_piece_possible("\u3000" * -(-LONG_PIECE_BYTES // 3))
    assert not long_piece_possible("🙂" * ((LONG_PIECE_BYTES - 2) // 4))
    assert long_piece_possible("🙂" * -(-(LONG_PIECE_BYTES - 1) // 4))
    assert not long_piece_possible("word " * 1000)  # long text, short pieces
    # str.isspace's separators (U+001C-1F) are not the regex's whitespace: no run ends there.
    assert long_piece_possible("x\x1c" * LONG_PIECE_BYTES)
    # Other characters' bytes continue either kind of run (a no-break space is whitespace).
    assert long_piece_possible("\u00a0" * LONG_PIECE_BYTES)


@pytest.mark.parametrize("backend", ["riptoken", "tuetoken"])
def test_gpt2_backends_give_tiktoken_ids_around_the_long_piece_size(backend):
    """riptoken merges pieces of LONG_PIECE_BYTES or more another way: texts that may hold
    one go to tiktoken, alone and inside a joined call, and the ids stay tiktoken's. tuetoken
    merges every piece by one algorithm: the same texts, all on tuetoken."""
    reference = load_tokenizer("gpt2", "tiktoken")
    fast = load_tokenizer("gpt2", backend)
    texts = _runs_near_the_long_piece_size()
    for got, want in zip(fast.encode_batch(texts), reference.encode_batch(texts), strict=True):
        assert np.array_equal(got, want)
    for k in (1, 7, len(texts)):  # joined calls of k documents
        for i in range(0, len(texts), k):
            got, want = fast.encode_docs(texts[i:i + k]), reference.encode_docs(texts[i:i + k])
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), i
    assert fast.fallbacks == 0


def _code_points_in_contexts() -> list[str]:
    """Every code point of the planes Unicode assigns (0 - 3 and 14; no surrogates), where
    its class (letter, digit, other, whitespace) changes the pieces: before a contraction,
    between digits, after a space and a letter."""
    points = [chr(c) for c in (*range(0x40000), *range(0xE0000, 0xF0000))
              if not 0xD800 <= c < 0xE000]
    return [f"{c}'s" for c in points] + [f"1{c}2 x{c}'t" for c in points[::7]]


@pytest.mark.slow
def test_tuetoken_gives_tiktoken_ids_on_every_code_point(tmp_path, monkeypatch):
    """tuetoken's Unicode tables are older than tiktoken's: the texts whose ids it gets wrong
    are all flagged by the guard (so go to tiktoken), and the backend's ids are tiktoken's."""
    import tuetoken

    from ingest.tokenize.bpe_tuetoken import needs_tiktoken, tokenizer_json

    reference = load_tokenizer("gpt2", "tiktoken")
    fast = load_tokenizer("gpt2", "tuetoken")
    texts = _code_points_in_contexts()
    want_tokens, want_eos = reference.encode_docs(texts)
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path))  # its own tokenizer.json
    raw = tuetoken.Tokenizer(tokenizer_json(reference.encoding, "gpt2"))
    assert (tmp_path / "tuetoken" / "gpt2.json").is_file()
    out = raw.encode_ordinary_to_buffer(texts, 1)
    want = np.split(want_tokens, want_eos + 1)[:-1]
    wrong = {i for i in range(len(texts)) if not np.array_equal(
        out["data"][out["offsets"][i]:out["offsets"][i + 1]], want[i][:-1])}
    assert len(wrong) > 1000  # the guard is needed: Unicode 16's letters, at least
    assert wrong <= set(needs_tiktoken(texts))
    got_tokens, got_eos = fast.encode_docs(texts)
    assert np.array_equal(got_tokens, want_tokens) and np.array_equal(got_eos, want_eos)


def test_tuetoken_is_not_used_past_the_unicode_it_is_proven_on(monkeypatch, request):
    import ingest.tokenize.bpe_tuetoken as bpe_tuetoken

    reference = load_tokenizer("gpt2", "tiktoken")
    monkeypatch.setattr(bpe_tuetoken, "NEWEST_UNICODE", (13, 0))  # older than this Python's
    bpe_tuetoken._guarded_tuetoken.cache_clear()  # made again, and refused
    request.addfinalizer(bpe_tuetoken._guarded_tuetoken.cache_clear)
    with pytest.raises(ImportError, match="newer than the 13.0"):
        bpe_tuetoken.GuardedTuetoken.of_tiktoken(reference, "gpt2-test")
    assert accelerate(reference, "gpt2", "auto").backend == "riptoken"
    with pytest.raises(ValueError, match="needs its library"):
        accelerate(reference, "gpt2", "tuetoken")


def ascii_texts(n: int, seed: int) -> list[str]:
    """``n`` ASCII texts that reach every branch of cl100k's pattern: contractions in either
    case, digit runs, punctuation runs before newlines, whitespace runs of every kind and
    length (trailing too), control characters, long words, special tokens' strings, code."""
    rng = random.Random(seed)
    alphabet = [chr(i) for i in range(128)]
    pieces = ("'s", "'S", "'t", "'ll", "'LL", "'ve", "'Re", "'d", "'M", " ", "  ", "\t", "\n",
              "\r\n", "\r", "\n\n\n", "    ", "\x0b", "\x0c", "123", "4567890", "0", "a", "Z",
              "hello", "World", "HTTP", "x" * 300, " " * 200, "\n" * 50, "!!", "...", "-->",
              "<|endoftext|>", "<|fim_prefix|>", "def f(x):\n    return x\n", "\x00", "\x7f",
              "\x1f", "__init__", "0x1F", "1e-3", "a'b", "''", "' s")
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randrange(1, 60)):
            r = rng.random()
            if r < 0.5:
                parts.append(rng.choice(pieces))
            elif r < 0.8:
                parts.append("".join(rng.choices(alphabet, k=rng.randrange(1, 12))))
            else:
                parts.append(rng.choice(" \t\n\r") * rng.randrange(1, 40))
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("vocab", [v for v in BUNDLED if v in PROVEN["toktok"]])
def test_toktok_gives_tiktoken_ids_on_ascii_and_hands_other_texts_on(vocab):
    """toktok runs ASCII texts only: there its ids are tiktoken's (40,000 generated texts,
    about 16 M characters). In a text with any other character, the lines holding one go to
    rs_bpe (or, without it, to tiktoken), alone and among ASCII documents in a joined call."""
    reference = load_tokenizer(vocab, "tiktoken")
    enc = reference._enc
    toktok = _AsciiToktok(PROVEN["toktok"][vocab], reference)
    texts = ascii_texts(40_000, seed=3)
    assert sum(map(len, texts)) > 15_000_000 and all(t.isascii() for t in texts)
    bad = [t for t in texts if not np.array_equal(toktok.encode_ordinary(t),
                                                  enc.encode_ordinary(t))]
    assert not bad, f"{len(bad)} ASCII texts differ, first {bad[0][:80]!r}"
    # Other texts, the few that toktok itself encodes otherwise among them.
    others = [t for t in adversarial_texts(20_000) if not t.isascii()]
    wrong = [t for t in others if not np.array_equal(
        toktok._fast.encode_to_numpy(t, disallowed_special=()), enc.encode_ordinary(t))]
    rare = others[:1000 - len(wrong)] + wrong
    mixed = [x for pair in zip(texts[:1000], rare, strict=True) for x in pair]
    mixed += ["a<|endoftext|>b", "é<|endoftext|>", "", "<|endoftext|>"]
    fast = FastBPETokenizer(reference, "toktok", toktok.encode_ordinary,
                            encode_docs=toktok.encode_docs)
    without_rs_bpe = _AsciiToktok(PROVEN["toktok"][vocab], reference)
    without_rs_bpe._other = None
    plain = FastBPETokenizer(reference, "toktok", without_rs_bpe.encode_ordinary,
                             encode_docs=without_rs_bpe.encode_docs)
    for tok in (fast, plain):
        for k in (1, 5, 200):  # joined calls of k documents
            for i in range(0, len(mixed), k):
                got, want = tok.encode_docs(mixed[i:i + k]), reference.encode_docs(mixed[i:i + k])
                assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), i
        for got, want in zip(tok.encode_batch(mixed), reference.encode_batch(mixed),
                             strict=True):
            assert got.dtype == np.int32 and np.array_equal(got, want)


def test_a_document_with_other_characters_is_cut_only_where_cl100k_pieces_end(monkeypatch):
    """``ascii_runs`` cuts a text outside ASCII at line ends: tiktoken's cl100k ids of the
    parts, back to back, are the text's, on 15,000 generated texts outside ASCII and 20,000
    mixes of their lines with ASCII ones, as cut and with every ASCII stretch cut off (line
    ends of every kind, whitespace before and after them, Unicode spaces, control
    characters). Only the lines with other characters are left outside the ASCII parts, and
    a text mostly outside ASCII is not cut."""
    enc = load_tokenizer("cl100k", "tiktoken")._enc
    rng = random.Random(7)
    others = [t for t in adversarial_texts(20_000, seed=4) if not t.isascii()]
    plain = [line for t in ascii_texts(2_000, seed=5) for line in t.splitlines(keepends=True)]
    other = [line for t in others[:2_000] for line in t.splitlines(keepends=True)]
    ends = ("\n", "\r\n", "\n\n", "\n  \n", " \n", "\n\t", "\n\x1c", "\n\xa0", "\u2028\n", "")
    mixes = ["".join(rng.choice(plain if rng.random() < 0.9 else other) + rng.choice(ends)
                     for _ in range(rng.randrange(1, 80))) for _ in range(20_000)]
    fixed = ["abc\né\nxyz", "a\n   é", "a\n\x1cé\nq", "é\n   ", "x\n\n  é\n\n  y", "é\r\ny\n",
             "a\n\xa0é\nz\n \t\nw", "\n\n\n"]
    cuts = 0
    for least in (bpe_toktok._MIN_ASCII_PART, 1):  # 1: every ASCII stretch on its own
        monkeypatch.setattr(bpe_toktok, "_MIN_ASCII_PART", least)
        for text in fixed + others + mixes:
            runs = ascii_runs(text)
            assert "".join(part for _, part in runs) == text
            assert all(part and part.isascii() == ascii for ascii, part in runs), text
            if len(runs) > 1:
                cuts += len(runs) - 1
                got = [i for _, part in runs for i in enc.encode_ordinary(part)]
                assert got == enc.encode_ordinary(text), (text, runs)
    monkeypatch.undo()
    assert cuts > 30_000
    # Whitespace up to the text's end, or another line end after it, is no cut.
    assert ascii_runs("é\n   ") == [(False, "é\n   ")]
    assert ascii_runs("é\n \nbcdefghij") == [(False, "é\n \n"), (True, "bcdefghij")]
    # Mostly outside ASCII: one part. One line outside ASCII among many: only that line (its
    # line end with it) is not ASCII.
    assert ascii_runs("日本語\nabc\n") == [(False, "日本語\nabc\n")]
    code = "def f(x):\n    return x\n\n" * 50
    runs = ascii_runs(code + "    s = 'café'\n" + code)
    assert [(a, len(p)) for a, p in runs] == [(True, len(code)), (False, 15), (True, len(code))]


def test_a_backend_with_other_ids_is_refused_at_load(monkeypatch, caplog):
    reference = load_tokenizer("cl100k", "tiktoken")
    import dataclasses

    # A real library with a real but different vocabulary (o200k) posing as cl100k.
    def pose(name: str) -> None:
        wrong = dataclasses.replace(REGISTRY[name], proven={"cl100k": "o200k_base"})
        monkeypatch.setitem(REGISTRY, name, wrong)
        monkeypatch.setitem(PROVEN, name, wrong.proven)

    pose("rs_bpe")
    assert self_check(reference, load_encoder("rs_bpe", "o200k_base")) is not None
    with caplog.at_level(logging.WARNING, logger="ingest.tokenize.tokenizer"):
        tok = accelerate(reference, "cl100k", "rs_bpe")
    assert tok is reference
    assert any("differ from tiktoken's" in r.getMessage() and "rs_bpe" in r.getMessage()
               for r in caplog.records)
    # auto goes on to the next backend that passes (toktok, first, is not refused here).
    assert accelerate(reference, "cl100k", "auto").backend == "toktok"
    pose("toktok")
    assert accelerate(reference, "cl100k", "auto").backend == "bpe_openai"


def test_the_self_check_runs_once_per_machine_for_a_backend_and_vocabulary(tmp_path,
                                                                            monkeypatch):
    import ingest.tokenize.bpe_backend as bpe_backend

    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path))
    runs = []
    real = bpe_backend.self_check
    monkeypatch.setattr(bpe_backend, "self_check",
                        lambda *a, **k: runs.append(a[0].name) or real(*a, **k))
    reference = load_tokenizer("gpt2", "tiktoken")
    encoders = REGISTRY["riptoken"].load(reference, "gpt2")
    fast = FastBPETokenizer(reference, "riptoken", encoders.encode, encoders.encode_joined)
    assert checked(reference, "riptoken", "gpt2", fast) is None
    assert checked(reference, "riptoken", "gpt2", fast) is None  # read, not run again
    assert runs == ["gpt2"]
    # Another vocabulary, or another of the library's encodings, is checked on its own; a
    # verdict against is kept as well (and the backend refused each time).
    cl100k = load_tokenizer("cl100k", "tiktoken")
    wrong = FastBPETokenizer(cl100k, "rs_bpe", load_encoder("rs_bpe", "o200k_base"))
    for _ in range(2):
        assert checked(cl100k, "rs_bpe", "o200k_base", wrong) is not None
    assert runs == ["gpt2", "cl100k"]
    assert len(list((tmp_path / "backend-checks").iterdir())) == 2


def test_documents_a_backend_cannot_take_go_to_tiktoken():
    reference = load_tokenizer("cl100k", "tiktoken")
    fast = FastBPETokenizer(reference, "bpe_openai", load_encoder("bpe_openai",
                                                                   "cl100k_base"))
    long = "x" * 1_500_000 + " tail"  # past bpe_openai's input limit
    assert np.array_equal(fast.encode_batch([long])[0], reference.encode_batch([long])[0])
    assert fast.fallbacks == 1
    # A lone surrogate: the same error as tiktoken's (it is not text the feed can hold).
    with pytest.raises(UnicodeEncodeError):
        reference.encode_batch(["a\ud800b"])
    with pytest.raises(UnicodeEncodeError):
        load_tokenizer("cl100k", "rs_bpe").encode_batch(["a\ud800b"])
    for backend in ("riptoken", "tuetoken"):
        with pytest.raises(UnicodeEncodeError):
            load_tokenizer("gpt2", backend).encode_batch(["a\ud800b"])
        with pytest.raises(UnicodeEncodeError):
            load_tokenizer("gpt2", backend).encode_docs(["ok", "a\ud800b"])


def test_named_backends_are_checked():
    with pytest.raises(ValueError, match=r"proven on tokenizer \['cl100k', 'cl100k_base'\]"):
        load_tokenizer("gpt2", "rs_bpe")
    with pytest.raises(ValueError, match=r"tokenizer_backend='nope' is unknown"):
        load_tokenizer("cl100k", "nope")
    with pytest.raises(ConfigError, match=r"tokenizer_backend='nope' must be one of"):
        RuntimeOptions(tokenizer_backend="nope")
    # A backend not proven on the vocabulary is refused where the feed builds its tokenizer,
    # on the driver, before any stream runs.
    config = Config(sources=(SourceConfig(paths=("x",)),), tokenizer="gpt2",
                    runtime=RuntimeOptions(tokenizer_backend="rs_bpe"))
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    with pytest.raises(ValueError, match=r"tokenizer_backend='rs_bpe' is proven on tokenizer"):
        HostFeed(config, sharding=sharding, backend="local")


# -- the batches do not depend on the backend -----------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("backend_corpus")
    weird = [t for t in adversarial_texts(400, seed=5) if t.strip()][:240]
    paths = []
    for i in range(4):
        texts = make_texts(40, seed=70 + i, max_words=50) + weird[i::4]
        path = d / f"part-{i}.parquet"
        pq.write_table(pa.table({"text": texts}), str(path), row_group_size=20)
        paths.append(str(path))
    return paths


def run_digest(corpus, backend: str, feed_backend: str, tokenizer: str = "cl100k"
               ) -> tuple[str, int]:
    cfg = Config(sources=(SourceConfig(paths=tuple(corpus)),), tokenizer=tokenizer, seq_len=64,
                 global_batch_size=16, num_streams=8, unit_rows=10, seed=4,
                 runtime=RuntimeOptions(chunk_rows=8, tokenizer_backend=backend))
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    d = BatchDigest()
    with HostFeed(cfg, sharding=sharding, backend=feed_backend, get_timeout_s=60) as feed:
        for batch in feed:
            d.update({k: np.asarray(v) for k, v in batch.items()})
    return d.hexdigest(), d.steps


@pytest.mark.multidevice
@pytest.mark.parametrize("vocab", BUNDLED)
def test_digest_is_the_same_on_every_backend(corpus, vocab):
    want, steps = run_digest(corpus, "tiktoken", "local", vocab)
    assert steps >= 5
    backends = [b for b in FASTEST_FIRST if vocab in PROVEN[b]]
    assert backends
    for backend in backends:
        assert load_tokenizer(vocab, backend).backend == backend  # what the stream loads
        assert run_digest(corpus, backend, "local", vocab) == (want, steps), backend


@pytest.mark.ray
@pytest.mark.multidevice
def test_digest_on_ray_with_auto_equals_tiktoken_locally(ray_cluster, corpus):
    assert run_digest(corpus, "auto", "ray") == run_digest(corpus, "tiktoken", "local")
