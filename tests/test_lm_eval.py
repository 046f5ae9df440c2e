"""LoglikelihoodPair rows hold exactly the tokens lm-evaluation-harness feeds a causal model.

The reference is lm-eval's own ``TemplateLM.loglikelihood`` (and its ``_encode_pair``) with this
project's tokenizer as ``tok_encode``; the model input it leads to is
``(context_enc + continuation_enc)[-(max_length + 1):]``, the cut of lm-eval's causal models.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from ingest.evaluation.requests import EvalConfig, LoglikelihoodPair, tokenize_requests
from ingest.tokenize.tokenizer import load_tokenizer

# lm-eval's model API imports jinja2, requests, pyyaml and tqdm only (the `test` extra; `make
# test` installs lm-eval itself without its other requirements).
lm_model = pytest.importorskip("lm_eval.api.model")
lm_instance = pytest.importorskip("lm_eval.api.instance")

SEQ_LEN = 64
NUM_PAIRS = 400


class CapturingLM(lm_model.TemplateLM):
    """The smallest causal lm-eval model: its tokenizer is ours, and it records the
    (context, continuation) encodings lm-eval hands to the model instead of scoring them."""

    def __init__(self, tokenizer):
        super().__init__()
        self._tok = tokenizer
        self.seen: list[tuple[list[int], list[int]]] = []

    @property
    def eot_token_id(self) -> int:
        return self._tok.eos_id

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return [int(t) for t in self._tok.encode_batch([string])[0]]

    def _loglikelihood_tokens(self, requests, **kwargs):
        self.seen.extend((list(ctx), list(cont)) for _, ctx, cont in requests)
        return [(0.0, False)] * len(requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def _real_text() -> str:
    """Python's own standard library source: real text, code and prose, with every kind of
    whitespace."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((stdlib / name).read_text(encoding="utf-8")
                   for name in ("textwrap.py", "difflib.py", "json/decoder.py"))


def _random_pairs(rng: random.Random, text: str, n: int) -> list[LoglikelihoodPair]:
    """``n`` pieces of ``text`` split at a random character; some prefixes empty, some long
    enough to be cut, some ending in whitespace."""
    pairs = []
    while len(pairs) < n:
        length = rng.choice([rng.randint(2, 60), rng.randint(60, 600)])
        start = rng.randrange(len(text) - length)
        piece = text[start:start + length]
        split = 0 if rng.random() < 0.05 else rng.randint(1, len(piece) - 1)
        prefix, continuation = piece[:split], piece[split:][:rng.randint(1, 80)]
        if rng.random() < 0.2:
            prefix += rng.choice([" ", "  ", "\n", " \n\t"])  # whitespace lm-eval moves
        if prefix and not prefix.strip():
            continue  # refused: see test_whitespace_only_prefix_is_refused
        pairs.append(LoglikelihoodPair(prefix, continuation))
    return pairs


def test_pair_tokens_equal_lm_eval_harness_on_random_splits():
    tok = load_tokenizer("gpt2")
    pairs = _random_pairs(random.Random(0), _real_text(), NUM_PAIRS)
    lm = CapturingLM(tok)
    lm.loglikelihood([lm_instance.Instance("loglikelihood", {}, (p.prefix, p.continuation), i)
                      for i, p in enumerate(pairs)], disable_tqdm=True)
    want = []
    for ctx, cont in lm.seen:
        want.append((ctx + cont)[-(SEQ_LEN + 1):] if cont and len(cont) <= SEQ_LEN else None)
    scorable = [i for i, w in enumerate(want) if w is not None]
    assert len(scorable) > 0.9 * NUM_PAIRS
    got = tokenize_requests([pairs[i] for i in scorable], EvalConfig(seq_len=SEQ_LEN,
                                                                      padding_multiple=1),
                            tokenizer=tok)
    assert len(got.sequences) == len(scorable)
    differs_from_whole = cut = 0
    for i, seq in zip(scorable, got.sequences, strict=True):
        ctx, cont = lm.seen[i]
        assert seq.tokens.tolist() == want[i], f"pair {i}: {pairs[i]!r}"
        assert seq.length - seq.loss_start == len(cont), f"pair {i}: loss must cover cont"
        whole = lm.tok_encode(pairs[i].prefix + pairs[i].continuation)
        differs_from_whole += pairs[i].prefix != "" and whole != ctx + cont
        cut += len(ctx) + len(cont) > SEQ_LEN + 1
    # The cases this test exists for: prefixes whose own tokens are not the whole's first
    # tokens, and prefixes cut from the left.
    assert differs_from_whole >= 10 and cut >= 10, (differs_from_whole, cut)


def test_empty_prefix_is_eos_as_in_lm_eval_harness():
    tok = load_tokenizer("gpt2")
    pairs = [LoglikelihoodPair("", " yes"), LoglikelihoodPair("", "<|endoftext|>x")]
    lm = CapturingLM(tok)
    lm.loglikelihood([lm_instance.Instance("loglikelihood", {}, (p.prefix, p.continuation), i)
                      for i, p in enumerate(pairs)], disable_tqdm=True)
    got = tokenize_requests(pairs, EvalConfig(seq_len=SEQ_LEN, padding_multiple=1),
                            tokenizer=tok)
    for (ctx, cont), seq in zip(lm.seen, got.sequences, strict=True):
        assert seq.tokens.tolist() == ctx + cont
        assert seq.length - seq.loss_start == len(cont)
    assert got.sequences[0].tokens[0] == tok.eos_id


def test_whitespace_only_prefix_is_refused():
    with pytest.raises(ValueError, match=r"requests\[1\]: the prefix is whitespace only"):
        tokenize_requests([LoglikelihoodPair("a", " b"), LoglikelihoodPair("  ", "b")],
                          EvalConfig(seq_len=SEQ_LEN, padding_multiple=1))


def test_the_eval_rows_carry_the_pair_tokens(tmp_path):
    """The rows the plan builds hold the sequence: inputs, targets and loss columns."""
    from ingest.evaluation.batches import plan_batches  # noqa: PLC0415

    tok = load_tokenizer("gpt2")
    config = EvalConfig(seq_len=SEQ_LEN, padding_multiple=1, global_batch_size=2,
                        sort_by_length=False)
    seqs = tokenize_requests([LoglikelihoodPair("Hello wor", "ld and more")], config,
                             tokenizer=tok)
    rows = plan_batches(seqs, config).rows(0, 0, 1)
    toks = seqs.sequences[0].tokens
    n = len(toks) - 1
    np.testing.assert_array_equal(rows["inputs"][0, :n], toks[:-1])
    np.testing.assert_array_equal(rows["targets"][0, :n], toks[1:])
    np.testing.assert_array_equal(np.flatnonzero(rows["targets_segmentation"][0]),
                                  np.arange(seqs.sequences[0].loss_start, n))
