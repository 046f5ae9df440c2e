"""Evaluation sequences: requests -> tokenized sequences (``ingest.evaluation.batches``: -> a plan of
length-sorted global batches).

Three kinds of request, each cut into one or more *sequences* (``n`` input tokens, ``n``
targets with ``targets[t] = tokens[t + 1]``, and a loss on the targets from ``loss_start``)::

    Document("a b c")        the training view: tokens a b c E, every pair within them
                             inputs  a b c        (longer than seq_len: cut into pieces of
                             targets b c E         seq_len pairs, like concat rows)
                             loss    1 1 1
    LoglikelihoodPair(       lm-eval-harness loglikelihood: loss only on the continuation
      "p q", " r s")         inputs  p q r        (an empty prefix becomes E; a prefix too
                             targets q r s         long for seq_len is cut from the left and
                             loss    0 1 1         counted)
    RollingDocument("a..i")  lm-eval-harness loglikelihood_rolling, seq_len=4: every token
                             predicted exactly once, windows of seq_len inputs
                             window 0  inputs E a b c    targets a b c d    loss 1 1 1 1
                             window 1  inputs d e f g    targets e f g h    loss 1 1 1 1
                             window 2  inputs e f g h    targets f g h i    loss 0 0 0 1
                             (the last window keeps a full seq_len of context;
                             ``rolling_context``, lm-eval's ``context_len``, is the fewest
                             context tokens any later window has)

The plan sorts all sequences by length, longest first (the first batch is the largest, so an
out-of-memory error shows at once and the padded last batch is the smallest; stable: ties keep
request order, then window order), and cuts the sorted list into global batches of
``global_batch_size`` consecutive sequences::

    sorted lengths   9 8 8 | 6 5 5 | 3 2 -      B=3, padding_multiple=4
    batch widths      12   |   8   |   4        each batch: its longest, rounded up
    last batch              3 2 + one empty row (document_idx = -1)

Rows carry ``document_idx`` (the request's index) and ``sequence_idx`` (its piece or window,
0 for a pair), so per-token scores map back to requests (``sum_by_request``). Field names and
conventions are those of ``ingest.stream.chunk_format``: segment 1 on a sequence's tokens, 0 on padding;
``targets_segmentation == 0`` wherever no loss is taken (prefix, context, padding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ingest.errors import ConfigError
from ingest.tokenize.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "INDEX_FIELDS", "Document", "EvalConfig", "EvalSequence", "EvalSequences",
    "LoglikelihoodPair", "Request", "RollingDocument", "rolling_windows", "sum_by_request",
    "tokenize_requests",
]

# Per-row fields ([rows]) beside the six [rows, width] token fields of ingest.stream.chunk_format.FIELDS.
INDEX_FIELDS = ("document_idx", "sequence_idx")
_PROBLEMS_SHOWN = 10  # a long list of bad requests is cut to its first few, with the count


@dataclasses.dataclass(frozen=True)
class Document:
    """Scores a whole text as training sees it: ``tokens(text) + [eos]``, every next-token pair
    within them (the first token is not predicted, as in training without
    ``predict_across_documents``). Texts over ``seq_len`` pairs are cut into pieces of
    ``seq_len`` pairs each, without overlap."""

    text: str


@dataclasses.dataclass(frozen=True)
class LoglikelihoodPair:
    """Scores ``continuation`` given ``prefix`` (lm-eval-harness ``loglikelihood``): trailing
    whitespace of the prefix moves to the continuation; the inputs are ``tokens(prefix)``
    (encoded alone) followed by ``tokens(prefix + continuation)`` past its first
    ``len(tokens(prefix))`` tokens, cut from the left to ``seq_len + 1`` tokens; an empty
    prefix becomes ``[eos]``. The loss covers the continuation's tokens only."""

    prefix: str
    continuation: str


@dataclasses.dataclass(frozen=True)
class RollingDocument:
    """Scores every token of a text exactly once (lm-eval-harness ``loglikelihood_rolling``):
    the first token is predicted from ``eos``; windows of up to ``seq_len`` inputs."""

    text: str


Request = Document | LoglikelihoodPair | RollingDocument


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """How requests become batches.

    Attributes:
      tokenizer: a ``load_tokenizer`` spec (``gpt2``, ``cl100k``, a file).
      seq_len: the most input tokens a row holds.
      global_batch_size: rows per global batch (B), over all hosts.
      padding_multiple: each batch's width is its longest sequence rounded up to a multiple of
        this. Must divide ``seq_len``. 128 by default: TPU matrix units and vector lanes are
        128 wide, and at most ``seq_len / padding_multiple`` distinct widths (compilations)
        arise.
      sort_by_length: sort sequences longest first before batching (else request order).
      rolling_context: lm-eval-harness's ``context_len`` for ``RollingDocument`` windows: each
        window after the first predicts at most ``seq_len - rolling_context + 1`` new tokens,
        so it sees at least ``rolling_context`` tokens of context. 1 is lm-eval's choice.
    """

    tokenizer: str = "gpt2"
    seq_len: int = 1024
    global_batch_size: int = 32
    padding_multiple: int = 128
    sort_by_length: bool = True
    rolling_context: int = 1

    def __post_init__(self):
        problems = []
        for name in ("seq_len", "global_batch_size", "padding_multiple", "rolling_context"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{name}={v!r} must be a positive integer")
        if not problems:
            if self.seq_len % self.padding_multiple:
                problems.append(
                    f"padding_multiple={self.padding_multiple} does not divide "
                    f"seq_len={self.seq_len}; choose a padding_multiple dividing {self.seq_len} "
                    f"(so that no width rounds past seq_len)")
            if self.rolling_context > self.seq_len:
                problems.append(f"rolling_context={self.rolling_context} exceeds "
                                f"seq_len={self.seq_len}; choose 1 <= rolling_context <= seq_len")
        if not isinstance(self.sort_by_length, bool):
            problems.append(f"sort_by_length={self.sort_by_length!r} must be true or false")
        if problems:
            raise ConfigError(problems, where="EvalConfig")


@dataclasses.dataclass(frozen=True, eq=False)
class EvalSequence:
    """One row's worth of a request.

    Attributes:
      document_idx: the request's index in the list given.
      sequence_idx: the piece (``Document``) or window (``RollingDocument``) within it; 0 for
        a ``LoglikelihoodPair``.
      tokens: int32 ``[n + 1]``: inputs are ``tokens[:-1]``, targets ``tokens[1:]``.
      loss_start: the loss covers targets ``[loss_start, n)``.
    """

    document_idx: int
    sequence_idx: int
    tokens: np.ndarray
    loss_start: int

    @property
    def length(self) -> int:
        """Input tokens (n)."""
        return len(self.tokens) - 1


@dataclasses.dataclass(frozen=True)
class EvalSequences:
    """Every request's sequences, in request order, then piece/window order.

    Attributes:
      sequences: the sequences.
      num_requests: requests given.
      truncated_prefixes: ``LoglikelihoodPair`` prefixes cut from the left to fit ``seq_len``.
      truncated_prefix_tokens: tokens those cuts removed.
    """

    sequences: tuple[EvalSequence, ...]
    num_requests: int
    truncated_prefixes: int
    truncated_prefix_tokens: int


def rolling_windows(tokens: np.ndarray, *, prefix_id: int, seq_len: int,
                    context: int = 1) -> list[tuple[np.ndarray, int]]:
    """lm-eval-harness's ``get_rolling_token_windows`` + ``make_disjoint_window`` in this
    module's form: windows ``(window_tokens, loss_start)`` whose targets from ``loss_start``
    cover ``tokens`` exactly once, in order.

    The first window predicts ``tokens[:seq_len]`` from ``[prefix_id] + tokens[:seq_len-1]``.
    Each later one ends at the next unpredicted stretch of at most ``seq_len - context + 1``
    tokens and takes ``seq_len`` inputs ending just before its last prediction.
    """
    n = len(tokens)
    if n == 0:
        return []
    first = min(seq_len, n)
    out = [(np.concatenate([np.array([prefix_id], np.int32), tokens[:first]]), 0)]
    predicted = first
    pred_len = seq_len - context + 1
    while predicted < n:
        new = min(n - predicted, pred_len)
        end = predicted + new
        # end > seq_len here (predicted >= seq_len), so the window holds seq_len + 1 tokens.
        out.append((tokens[end - seq_len - 1:end], seq_len - new))
        predicted = end
    return out


def _encode_pairs(tok: Tokenizer, pairs: list[LoglikelihoodPair]) -> list[tuple[np.ndarray,
                                                                                np.ndarray]]:
    """lm-eval-harness's tokenization for ``loglikelihood`` (``TemplateLM.loglikelihood`` and
    its causal ``_encode_pair``): (prefix ids, continuation ids), the model's input being
    their concatenation::

        prefix "The answer is ", continuation "yes"
        move trailing whitespace   "The answer is" + " yes"
        prefix ids                 tokens("The answer is")             encoded alone
        continuation ids           tokens("The answer is yes")[len(prefix ids):]

    An empty prefix is ``[eos]`` before ``tokens(continuation)``, or the continuation's first
    token when that already is ``eos``.
    """
    prefixes, wholes = [], []
    for p in pairs:
        prefix, continuation = p.prefix, p.continuation
        spaces = len(prefix) - len(prefix.rstrip())
        if spaces:
            continuation = prefix[-spaces:] + continuation
            prefix = prefix[:-spaces]
        prefixes.append(prefix)
        wholes.append(prefix + continuation)
    prefix_ids = tok.encode_batch(prefixes)
    whole_ids = tok.encode_batch(wholes)
    eos = np.array([tok.eos_id], np.int32)
    out = []
    for prefix, pid, wid in zip(prefixes, prefix_ids, whole_ids, strict=True):
        if prefix:
            out.append((np.asarray(pid, np.int32), wid[len(pid):]))
        elif len(wid) and wid[0] == tok.eos_id:
            out.append((wid[:1], wid[1:]))
        else:
            out.append((eos, wid))
    return out


def _check_requests(requests: Sequence[Any]) -> None:
    bad_types = [f"requests[{i}] is a {type(r).__name__}" for i, r in enumerate(requests)
                 if not isinstance(r, Document | LoglikelihoodPair | RollingDocument)]
    if bad_types:
        raise TypeError("every request must be a Document, LoglikelihoodPair or "
                        "RollingDocument: " + _listing(bad_types))
    problems = []
    for i, r in enumerate(requests):
        if isinstance(r, LoglikelihoodPair):
            if not isinstance(r.prefix, str) or not isinstance(r.continuation, str):
                problems.append(f"requests[{i}]: prefix and continuation must be str")
            elif not r.continuation:
                problems.append(f"requests[{i}]: empty continuation (nothing to score)")
            elif r.prefix and not r.prefix.strip():
                # lm-eval-harness moves it onto the continuation and scores after no token.
                problems.append(f"requests[{i}]: the prefix is whitespace only; give prefix "
                                f"'' (scored after eos) or put the whitespace in the "
                                f"continuation")
        elif not isinstance(r.text, str):
            problems.append(f"requests[{i}]: text must be str, got {type(r.text).__name__}")
        elif not r.text:
            problems.append(f"requests[{i}]: empty text (nothing to score)")
    if problems:
        raise ValueError(f"{len(problems)} request(s) cannot be scored: {_listing(problems)}; "
                         f"drop them or give them text")


def _listing(items: list[str]) -> str:
    shown = "; ".join(items[:_PROBLEMS_SHOWN])
    more = len(items) - _PROBLEMS_SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def tokenize_requests(requests: Sequence[Request], config: EvalConfig, *,
                      tokenizer: Tokenizer | None = None) -> EvalSequences:
    """Tokenizes every request and cuts it into sequences of at most ``config.seq_len``.

    Args:
      requests: the requests, in the order whose indices rows carry as ``document_idx``.
      config: the eval config.
      tokenizer: overrides ``config.tokenizer`` (already loaded).

    Raises:
      TypeError: a request of another type (listing them).
      ValueError: empty texts or continuations, or a continuation longer than ``seq_len``
        tokens (listing them all, by index).
    """
    _check_requests(requests)
    tok = tokenizer or load_tokenizer(config.tokenizer)
    L = config.seq_len
    eos = np.array([tok.eos_id], np.int32)
    by_kind: dict[type, list[int]] = {Document: [], LoglikelihoodPair: [], RollingDocument: []}
    for i, r in enumerate(requests):
        by_kind[type(r)].append(i)
    per_request: list[list[EvalSequence]] = [[] for _ in requests]
    texts = [requests[i].text for i in by_kind[Document]]
    for i, ids in zip(by_kind[Document], tok.encode_batch(texts), strict=True):
        toks = np.concatenate([ids, eos])
        n_pairs = len(toks) - 1  # >= 1: a non-empty text has at least one token
        per_request[i] = [EvalSequence(i, j, toks[s:s + L + 1], 0)
                          for j, s in enumerate(range(0, n_pairs, L))]
    texts = [requests[i].text for i in by_kind[RollingDocument]]
    for i, ids in zip(by_kind[RollingDocument], tok.encode_batch(texts), strict=True):
        windows = rolling_windows(ids, prefix_id=tok.eos_id, seq_len=L,
                                  context=config.rolling_context)
        per_request[i] = [EvalSequence(i, j, w, start) for j, (w, start) in enumerate(windows)]
    truncated = truncated_tokens = 0
    too_long = []
    pairs = [requests[i] for i in by_kind[LoglikelihoodPair]]
    for i, (prefix, cont) in zip(by_kind[LoglikelihoodPair], _encode_pairs(tok, pairs),
                                 strict=True):
        if len(cont) > L:
            too_long.append(f"requests[{i}]: {len(cont)} continuation tokens > seq_len={L}")
            continue
        if len(cont) == 0:
            # A continuation of whitespace only merged into the prefix's last token.
            too_long.append(f"requests[{i}]: the continuation encodes to no token of its own")
            continue
        whole = np.concatenate([prefix, cont])
        cut = max(0, len(whole) - (L + 1))
        if cut:
            truncated += 1
            truncated_tokens += cut
        toks = whole[cut:]
        per_request[i] = [EvalSequence(i, 0, toks, len(toks) - 1 - len(cont))]
    if too_long:
        raise ValueError(
            f"{len(too_long)} continuation(s) cannot be scored: {_listing(too_long)}; raise "
            f"seq_len, shorten them, or give them text of their own")
    return EvalSequences(tuple(s for seqs in per_request for s in seqs), len(requests),
                         truncated, truncated_tokens)


def sum_by_request(document_idx: np.ndarray, values: np.ndarray, num_requests: int
                   ) -> np.ndarray:
    """Adds per-row values (e.g. each row's masked log-likelihood) into per-request totals,
    ignoring empty rows (``document_idx == -1``).

    Args:
      document_idx: int ``[rows]`` from the batches.
      values: ``[rows]`` per-row values.
      num_requests: requests given.

    Returns:
      float64 ``[num_requests]``.
    """
    idx = np.asarray(document_idx).reshape(-1)
    vals = np.asarray(values, np.float64).reshape(-1)
    if idx.shape != vals.shape:
        raise ValueError(f"document_idx has {idx.size} rows but values has {vals.size}; give "
                         f"one value per row")
    keep = idx >= 0
    out = np.zeros(num_requests, np.float64)
    np.add.at(out, idx[keep], vals[keep])
    return out
