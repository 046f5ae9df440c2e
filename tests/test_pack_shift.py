"""Property tests for ingest.stream.pack, ingest.stream.shift and ingest.stream.chunk_format, and agreement with grain's packers."""

from __future__ import annotations

import grain
import numpy as np
import pytest
from helpers import F
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.stream.chunk_format import FIELDS, RowPieces, batch_groups, fields_of, layout_dtype
from ingest.stream.pack import assign_bins, concat_rows, fill_bins
from ingest.stream.pack import concat_fields as _concat_fields
from ingest.stream.shift import shift_rows as _shift_rows

EOS = 999
PROPERTY = settings(max_examples=50, deadline=None)

# Documents: ordinary ids 1..500 (never EOS); the packers see each followed by EOS.
documents = st.lists(st.lists(st.integers(1, 500), min_size=0, max_size=30), min_size=1,
                     max_size=12)


def concat_fields(*args, **kw) -> np.ndarray:
    """``ingest.stream.pack.concat_fields`` as one int32 ``[6, n, L]`` array."""
    return fields_of(*_concat_fields(*args, **kw))


def shift_rows(*args, **kw) -> np.ndarray:
    """``ingest.stream.shift.shift_rows`` as one int32 ``[6, n, L]`` array."""
    return fields_of(*_shift_rows(*args, **kw))


def flatten(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The stream's layout: documents back to back, each ending with EOS; starts marked."""
    tokens, starts = [], []
    for d in docs:
        tokens += d + [EOS]
        starts += [True] + [False] * len(d)
    return np.array(tokens, np.int32), np.array(starts, bool)


def pack_all(lengths: list[int], capacity: int, num_bins: int, best_fit: bool
             ) -> list[list[list[int]]]:
    """Drives `assign_bins` the way a stream does: each batch restarts at the first piece that
    fitted nowhere. Returns the batches, each a list of bins of (global) piece indices."""
    batches, at = [], 0
    while at < len(lengths):
        bins, consumed = assign_bins(np.array(lengths[at:], np.int64), capacity, num_bins,
                                     best_fit)
        assert consumed > 0, "a batch placed no piece: the stream would never advance"
        batches.append([[at + i for i in b] for b in bins])
        at += consumed
    return batches


def check_segments_and_positions(fields: np.ndarray, valid: np.ndarray, starts: np.ndarray):
    """Segment ids count segments per row from 1, 0 exactly on padding; positions restart at
    every segment start and at the row start.

    ``valid``/``starts`` are ``[n, seq_len]``: which inputs are real tokens, which begin a
    document (or a piece).
    """
    seg = fields[F["inputs_segmentation"]]
    pos = fields[F["inputs_position"]]
    np.testing.assert_array_equal(seg == 0, ~valid)
    np.testing.assert_array_equal(fields[F["targets_position"]], pos)
    n, seq_len = seg.shape
    for r in range(n):
        expect_seg, expect_pos = 0, 0
        for t in range(seq_len):
            if not valid[r, t]:
                assert seg[r, t] == 0 and pos[r, t] == 0
                continue
            if t == 0 or starts[r, t]:
                expect_seg, expect_pos = expect_seg + 1, 0
            else:
                expect_pos += 1
            assert seg[r, t] == expect_seg, (r, t)
            assert pos[r, t] == expect_pos, (r, t)


@PROPERTY
@given(docs=documents, seq_len=st.integers(1, 12), extra_rows=st.integers(0, 2),
       shift=st.sampled_from(["left", "right"]), across=st.booleans())
def test_concat_rows_keep_every_token_once_with_correct_fields(docs, seq_len, extra_rows, shift,
                                                               across):
    tokens, starts = flatten(docs)
    tokens_before, starts_before = tokens.copy(), starts.copy()
    n_rows = -(-len(tokens) // seq_len) + extra_rows
    width = seq_len + 1 if shift == "left" else seq_len
    fields = concat_fields(tokens, starts, n_rows, seq_len, shift=shift,
                           predict_across_documents=across, eos_id=EOS)
    # The fused pass the stream runs is the composition of the two readable steps.
    tok, st_, valid = concat_rows(tokens, starts, n_rows, seq_len, width)
    np.testing.assert_array_equal(
        fields, shift_rows(tok, st_, valid, shift=shift, predict_across_documents=across,
                           eos_id=EOS))
    np.testing.assert_array_equal(tokens, tokens_before)  # inputs are not mutated
    np.testing.assert_array_equal(starts, starts_before)

    assert fields.shape == (len(FIELDS), n_rows, seq_len) and fields.dtype == np.int32
    # Flat index of every input cell: row r, column t holds stream token r*seq_len + t.
    flat = np.arange(n_rows)[:, None] * seq_len + np.arange(seq_len)[None, :]
    is_token = flat < len(tokens)
    doc_start = np.zeros(n_rows * seq_len + 1, bool)
    doc_start[:len(starts)] = starts
    check_segments_and_positions(fields, is_token, doc_start[flat])

    inputs, targets = fields[F["inputs"]], fields[F["targets"]]
    seg, tseg = fields[F["inputs_segmentation"]], fields[F["targets_segmentation"]]
    if shift == "left":
        # No token lost or duplicated: the rows' inputs are the stream, in order.
        np.testing.assert_array_equal(inputs[is_token], tokens)
        # The target of every input is the next token of the stream, also across rows.
        has_next = flat + 1 < len(tokens)
        np.testing.assert_array_equal(targets[has_next], tokens[flat[has_next] + 1])
        assert not targets[~has_next].any()
        crosses = has_next & doc_start[flat + 1]
        np.testing.assert_array_equal(tseg[has_next & ~crosses], seg[has_next & ~crosses])
        assert not tseg[~has_next].any()
        if across:
            np.testing.assert_array_equal(tseg[crosses], seg[crosses])
            assert (tseg[crosses] > 0).all()
        else:
            assert not tseg[crosses].any()
        # targets[t] == inputs[t+1] inside a segment.
        same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
        np.testing.assert_array_equal(targets[:, :-1][same], inputs[:, 1:][same])
    else:
        np.testing.assert_array_equal(targets[is_token], tokens)
        real_rows = is_token[:, 0]
        assert (inputs[real_rows, 0] == EOS).all()
        both = is_token[:, 1:]
        np.testing.assert_array_equal(inputs[:, 1:][both], targets[:, :-1][both])
        np.testing.assert_array_equal(tseg, seg)
        assert not inputs[~is_token].any() and not targets[~is_token].any()


@PROPERTY
@given(docs=documents, seq_len=st.integers(1, 12), n_rows=st.integers(1, 4),
       shift=st.sampled_from(["left", "right"]), across=st.booleans())
def test_concat_fields_takes_the_rows_it_is_asked_for_from_a_longer_sequence(docs, seq_len,
                                                                            n_rows, shift,
                                                                            across):
    """A stream passes all the tokens it has loaded: the rows take their prefix (and a left
    shift one token more, for the last target); the rest waits for the next chunk."""
    tokens, starts = flatten(docs)
    width = seq_len + 1 if shift == "left" else seq_len
    got = concat_fields(tokens, starts, n_rows, seq_len, shift=shift,
                        predict_across_documents=across, eos_id=EOS)
    tok, st_, valid = concat_rows(tokens, starts, n_rows, seq_len, width)
    np.testing.assert_array_equal(got, shift_rows(tok, st_, valid, shift=shift,
                                                  predict_across_documents=across, eos_id=EOS))


@PROPERTY
@given(docs=st.lists(st.lists(st.integers(1, 500), min_size=0, max_size=11), min_size=1,
                     max_size=25),
       seq_len=st.just(12), num_bins=st.integers(1, 5), best_fit=st.booleans(),
       shift=st.sampled_from(["left", "right"]), across=st.booleans())
def test_bin_packing_places_every_piece_once_in_full_batches(docs, seq_len, num_bins, best_fit,
                                                             shift, across):
    pieces = [np.array(d + [EOS], np.int32) for d in docs]
    lengths = [len(p) for p in pieces]
    batches = pack_all(lengths, seq_len, num_bins, best_fit)

    placed = [i for batch in batches for b in batch for i in b]
    assert sorted(placed) == list(range(len(pieces)))  # no piece lost or duplicated
    for k, batch in enumerate(batches):
        assert 1 <= len(batch) <= num_bins
        used = [sum(lengths[i] for i in b) for b in batch]
        assert max(used) <= seq_len
        for b in batch:
            assert b == sorted(b)  # a bin keeps the reading order
        if k + 1 < len(batches):
            # A batch closes only when the next piece fits in no bin, so all bins are open.
            assert len(batch) == num_bins
            first_of_next = batches[k + 1][0][0]
            assert all(u + lengths[first_of_next] > seq_len for u in used)
            assert max(i for b in batch for i in b) + 1 == first_of_next

    width = seq_len + 1 if shift == "left" else seq_len
    all_tokens = []
    for batch in batches:
        tok, st_, valid = fill_bins(pieces, batch, width)
        fields = shift_rows(tok, st_, valid, shift=shift, predict_across_documents=across,
                            eos_id=EOS)
        assert fields.shape == (len(FIELDS), len(batch), seq_len)
        check_segments_and_positions(fields, valid[:, :seq_len], st_[:, :seq_len])
        carrier = F["inputs"] if shift == "left" else F["targets"]
        seg = fields[F["inputs_segmentation"]]
        tseg = fields[F["targets_segmentation"]]
        for r, b in enumerate(batch):
            for sid, i in enumerate(b, start=1):
                np.testing.assert_array_equal(fields[carrier, r][seg[r] == sid], pieces[i])
                all_tokens += pieces[i].tolist()
            if shift == "left":
                ends = np.cumsum([lengths[i] for i in b]) - 1  # last token of each piece
                for j, e in enumerate(ends):
                    into_next_piece = j + 1 < len(ends)
                    assert (tseg[r, e] > 0) == (into_next_piece and across), (r, e)
                inside = np.ones(seq_len, bool)
                inside[ends] = False
                inside &= seg[r] > 0
                np.testing.assert_array_equal(tseg[r][inside], seg[r][inside])
                same = (seg[r, 1:] == seg[r, :-1]) & (seg[r, 1:] > 0)
                np.testing.assert_array_equal(fields[F["targets"], r, :-1][same],
                                              fields[F["inputs"], r, 1:][same])
            else:
                assert fields[F["inputs"], r, 0] == EOS
                np.testing.assert_array_equal(tseg[r], seg[r])
    assert sorted(all_tokens) == sorted(t for p in pieces for t in p.tolist())


@PROPERTY
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=30), capacity=st.integers(1, 20),
       num_bins=st.integers(1, 6), best_fit=st.booleans())
def test_assign_bins_respects_capacity_and_reports_consumed_prefix(lengths, capacity, num_bins,
                                                                   best_fit):
    lengths = np.minimum(np.array(lengths, np.int64), capacity)
    before = lengths.copy()
    bins, consumed = assign_bins(lengths, capacity, num_bins, best_fit)
    np.testing.assert_array_equal(lengths, before)
    assert sorted(i for b in bins for i in b) == list(range(consumed))
    assert len(bins) <= num_bins
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    if consumed < len(lengths):
        used = [sum(lengths[i] for i in b) for b in bins] + [0] * (num_bins - len(bins))
        assert all(u + lengths[consumed] > capacity for u in used)


def grain_rows(pieces: list[np.ndarray], seq_len: int, num_bins: int, best_fit: bool):
    """grain's packer over the same token arrays, bins in order (``shuffle_bins=False``)."""
    ds = grain.MapDataset.source([{"tokens": p} for p in pieces]).to_iter_dataset()
    packer = (grain.experimental.BestFitPackIterDataset if best_fit
              else grain.experimental.FirstFitPackIterDataset)
    return list(packer(ds, length_struct={"tokens": seq_len}, num_packing_bins=num_bins,
                       shuffle_bins=False))


@pytest.mark.parametrize("best_fit", [False, True], ids=["first_fit", "best_fit"])
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=40),
       num_bins=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_assign_bins_matches_grain_packers(best_fit, lengths, num_bins, seed):
    seq_len = 10
    rng = np.random.default_rng(seed)
    pieces = [rng.integers(1, 1000, n).astype(np.int32) for n in lengths]
    expected = grain_rows(pieces, seq_len, num_bins, best_fit)

    got_tokens, got_starts, got_valid = [], [], []
    for batch in pack_all(lengths, seq_len, num_bins, best_fit):
        tok, st_, valid = fill_bins(pieces, batch, seq_len)
        got_tokens += list(tok)
        got_starts += list(st_)
        got_valid += list(valid)
    assert len(got_tokens) == len(expected)
    for r, row in enumerate(expected):
        np.testing.assert_array_equal(got_tokens[r], row["tokens"], err_msg=f"row {r}")
        fields = shift_rows(got_tokens[r][None], got_starts[r][None], got_valid[r][None],
                            shift="right", predict_across_documents=False, eos_id=EOS)
        np.testing.assert_array_equal(fields[F["inputs_segmentation"], 0],
                                      row["tokens_segment_ids"], err_msg=f"row {r}")
        np.testing.assert_array_equal(fields[F["inputs_position"], 0], row["tokens_positions"],
                                      err_msg=f"row {r}")


def test_shift_left_worked_example_from_module_docstring():
    # shift.py's drawing: tokens |a b E |c d, L=4.
    a, b, c, d = 11, 12, 13, 14
    tok = np.array([[a, b, EOS, c, d]], np.int32)
    starts = np.array([[True, False, False, True, False]])
    valid = np.ones((1, 5), bool)
    out = shift_rows(tok, starts, valid, shift="left", predict_across_documents=False,
                     eos_id=EOS)
    assert out[F["inputs"], 0].tolist() == [a, b, EOS, c]
    assert out[F["targets"], 0].tolist() == [b, EOS, c, d]
    assert out[F["inputs_segmentation"], 0].tolist() == [1, 1, 1, 2]
    assert out[F["targets_segmentation"], 0].tolist() == [1, 1, 0, 2]
    assert out[F["inputs_position"], 0].tolist() == [0, 1, 2, 0]
    across = shift_rows(tok, starts, valid, shift="left", predict_across_documents=True,
                        eos_id=EOS)
    assert across[F["targets_segmentation"], 0].tolist() == [1, 1, 1, 2]


def test_shift_right_puts_eos_first_and_keeps_targets():
    a, b, c = 11, 12, 13
    tok = np.array([[a, b, EOS, c]], np.int32)
    starts = np.array([[True, False, False, True]])
    out = shift_rows(tok, starts, np.ones((1, 4), bool), shift="right",
                     predict_across_documents=False, eos_id=EOS)
    assert out[F["inputs"], 0].tolist() == [EOS, a, b, EOS]
    assert out[F["targets"], 0].tolist() == [a, b, EOS, c]
    assert out[F["targets_segmentation"], 0].tolist() == [1, 1, 1, 2]


@pytest.mark.parametrize("seq_len", [65535, 65536])
def test_positions_and_segment_ids_are_exact_at_the_largest_seq_lens(seq_len):
    # Below 65536 a chunk keeps positions and segment ids as uint16, computed modulo 65536 over
    # cells past 65536; from 65536 on (a segment id could reach it) as int32.
    rng = np.random.default_rng(seq_len)
    docs = [rng.integers(1, 500, n).tolist() for n in (70_000, 2, 65_534, 0, 40_000, 1, 30_000)]
    tokens, starts = flatten(docs)
    n_rows = 3
    tok, layout = _concat_fields(tokens, starts, n_rows, seq_len, shift="left",
                                 predict_across_documents=False, eos_id=EOS)
    assert layout.dtype == layout_dtype(seq_len) == (np.uint16 if seq_len < 65536 else np.int32)
    fields = fields_of(tok, layout)
    cells = n_rows * seq_len
    pos, seg = [0] * cells, [1] * cells
    for i in range(1, cells):
        if i % seq_len:  # a row start keeps position 0 and segment 1
            pos[i] = 0 if starts[i] else pos[i - 1] + 1
            seg[i] = seg[i - 1] + int(starts[i])
    got_pos = fields[F["inputs_position"]].reshape(-1)
    assert got_pos.tolist() == pos
    assert fields[F["targets_position"]].reshape(-1).tolist() == pos
    assert fields[F["inputs_segmentation"]].reshape(-1).tolist() == seg
    assert int(got_pos.max()) == seq_len - 1  # the 70,000-token document fills row 0


def place_rows(out: np.ndarray, tok: np.ndarray, layout: np.ndarray, at: int, start: int,
               n: int) -> None:
    """Rows ``[start, start + n)`` of a chunk's arrays into rows ``[at, at + n)`` of an int32
    ``[6, rows, L]`` batch, field by field by name: the reference for ``RowPieces``."""
    for name, src in (("inputs", tok[0]), ("targets", tok[1]), ("inputs_position", layout[0]),
                      ("targets_position", layout[0]), ("inputs_segmentation", layout[1]),
                      ("targets_segmentation", layout[2])):
        out[F[name], at:at + n] = src[start:start + n]


@pytest.mark.parametrize("layout_type", [np.uint16, np.int32])
def test_row_pieces_put_each_field_of_a_chunks_rows_in_place_and_touch_no_others(layout_type):
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 50_000, (2, 5, 8), dtype=np.int32)
    layout = rng.integers(0, 60_000, (3, 5, 8)).astype(layout_type)
    out = np.full((len(FIELDS), 7, 8), -1, np.int32)
    pieces = RowPieces(8)
    pieces.add(tok, layout, 1, 3)
    pieces.copy_into(batch_groups(out))
    want = np.full_like(out, -1)
    place_rows(want, tok, layout, 0, 1, 3)
    for name in FIELDS:
        np.testing.assert_array_equal(out[F[name]], want[F[name]], err_msg=name)
    with pytest.raises(ValueError, match="C-contiguous"):
        batch_groups(out[:, ::2])  # its groups would be copies: the rows would be lost


@pytest.mark.parametrize("layout_type", [np.uint16, np.int32])
def test_row_pieces_write_each_piece_in_place_back_to_back_with_zero_padding(layout_type):
    rng = np.random.default_rng(1)
    L = 8
    chunks = [(rng.integers(0, 50_000, (2, rows, L), dtype=np.int32),
               rng.integers(0, 60_000, (3, rows, L)).astype(layout_type)) for rows in (5, 3, 6)]
    # (chunk, start, rows) in batch order; None: padding rows.
    pieces_asked = [(0, 1, 2), (1, 2, 1), (None, None, 2), (2, 0, 6), (0, 4, 1)]
    total = sum(n for _, _, n in pieces_asked)
    want = np.zeros((len(FIELDS), total + 2, L), np.int32)
    want[:, total:] = -1
    got = np.full_like(want, -1)
    pieces = RowPieces(L)
    at = 0
    for c, start, n in pieces_asked:
        if c is None:
            pieces.add_padding(n)
        else:
            place_rows(want, *chunks[c], at, start, n)
            pieces.add(*chunks[c], start, n)
        at += n
    assert pieces.rows == total
    pieces.copy_into(batch_groups(got))
    np.testing.assert_array_equal(got, want)  # the rows past the pieces stay untouched
    RowPieces(L).copy_into(batch_groups(got))  # no pieces: nothing to write
    np.testing.assert_array_equal(got, want)
