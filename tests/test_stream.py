"""Streams over small real corpora: exact resume, partition of the corpus, shuffling, the deal,
the plan fingerprint, and agreement across file formats and with grain."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import grain
import numpy as np
import pytest
from helpers import (
    F,
    all_streams,
    assert_resumes_identically,
    drain,
    make_config,
    make_texts,
    next_row,
    segments,
    split_documents,
    stream_tokens,
    tokenize,
    write_arrow,
    write_jsonl,
    write_parquet,
    write_parquet_corpus,
)

from ingest import Stream, build_plan
from ingest.plan.deal import deal_units
from ingest.runtime import resolve_runtime
from ingest.stream.chunk_format import RowPieces, batch_groups
from ingest.stream.rows import RowBuilder

EOS = 50256  # gpt2's <|endoftext|>
PACKINGS = ("concat", "first_fit", "best_fit", "none")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two Parquet files of 12 documents, row groups of 5 (units of 2-3 rows); some documents
    are several rows long at seq_len=16."""
    root = tmp_path_factory.mktemp("corpus")
    texts = write_parquet_corpus(root, n_files=2, docs_per_file=12, row_group_size=5, seed=3,
                                 max_words=40)
    return root, [t for per_file in texts for t in per_file]


def corpus_config(corpus, **overrides):
    root, _ = corpus
    kw = dict(num_streams=2, global_batch_size=2, unit_rows=3, seq_len=16, packing_bins=3)
    kw.update(overrides)
    return make_config([root], **kw)


@pytest.mark.parametrize("shift", ["left", "right"])
@pytest.mark.parametrize("packing", PACKINGS)
def test_resume_at_every_row_matches_unbroken_stream(corpus, packing, shift):
    config = corpus_config(corpus, packing=packing, shift=shift, num_epochs=2)
    plan = build_plan(config)
    run = assert_resumes_identically(lambda: Stream(config, plan, 1))
    states = run.states
    # The states compared above include the hard places to resume from.
    assert any(s["offset"] > 0 for s in states[:-1]), "no state saved mid-document"
    assert any(s["epoch"] == 1 for s in states[:-1]), "the stream never reached epoch 1"
    epochs = [s["epoch"] for s in states[:-1]]
    assert epochs == sorted(epochs) and epochs[0] == 0
    if packing in ("first_fit", "best_fit"):
        assert any(s["batch_rows_taken"] > 0 for s in states), "no state mid packing batch"
    assert states[-1]["exhausted"] and states[-1]["rows_emitted"] == len(run.outputs)


@pytest.mark.parametrize("packing", PACKINGS)
def test_resume_across_epoch_boundary_keeps_the_carried_partial_row(corpus, packing):
    # One stream holds every unit, and packing carries over the epoch boundary; resuming
    # just before and after it must not change anything.
    config = corpus_config(corpus, packing=packing, num_streams=1, num_epochs=2)
    plan = build_plan(config)
    run = assert_resumes_identically(lambda: Stream(config, plan, 0))
    first_epoch1 = next(i for i, s in enumerate(run.states) if s["epoch"] == 1)
    assert 0 < first_epoch1 < len(run.outputs)
    _, texts = corpus
    if packing == "concat":
        # An epoch is not a whole number of rows, so one row holds both epochs' tokens.
        assert sum(map(len, tokenize(texts))) % config.seq_len != 0
        # The stream's documents are both epochs', each epoch a permutation of the corpus.
        docs = split_documents(stream_tokens(np.stack(run.outputs, axis=1)), EOS)
        expected = sorted(map(tuple, tokenize(texts)))
        assert sorted(map(tuple, docs[:len(texts)])) == expected
        assert sorted(map(tuple, docs[len(texts):])) == expected


@pytest.mark.parametrize("shift", ["left", "right"])
@pytest.mark.parametrize("packing", PACKINGS)
def test_a_chunk_keeps_its_fields_in_the_bytes_the_object_store_bound_counts(corpus, packing,
                                                                            shift):
    config = corpus_config(corpus, packing=packing, shift=shift, chunk_rows=4)
    runtime = resolve_runtime(config)
    chunk = Stream(config, build_plan(config), 0).produce(runtime.chunk_rows)
    assert chunk.num_rows == runtime.chunk_rows == 4
    assert chunk.tokens.dtype == np.int32 and chunk.layout.dtype == np.uint16
    assert chunk.tokens.nbytes + chunk.layout.nbytes == runtime.chunk_bytes
    fields = chunk.fields
    out = np.full((len(F), 7, config.seq_len), -1, np.int32)
    pieces = RowPieces(config.seq_len)
    pieces.add(chunk.tokens, chunk.layout, 1, 3)
    pieces.copy_into(batch_groups(out))
    np.testing.assert_array_equal(out[:, :3], fields[:, 1:4])
    assert (out[:, 3:] == -1).all()

@pytest.mark.parametrize("packing", PACKINGS)
def test_resume_with_different_rows_per_produce_gives_identical_rows(corpus, packing):
    config = corpus_config(corpus, packing=packing, num_epochs=2)
    plan = build_plan(config)
    one_by_one = drain(Stream(config, plan, 0), n_rows=1)
    assert one_by_one.shape[1] > 10
    for sizes in ([3], [5, 2, 7], [64]):
        np.testing.assert_array_equal(drain(Stream(config, plan, 0), n_rows=sizes), one_by_one)
    # Save after an odd-sized chunk, resume with another size.
    s = Stream(config, plan, 0)
    head = s.produce(5)
    resumed = Stream(config, plan, 0)
    resumed.set_state(json.loads(json.dumps(head.state_after)))
    rest = drain(resumed, n_rows=[2, 3])
    np.testing.assert_array_equal(np.concatenate([head.fields, rest], axis=1), one_by_one)


@pytest.mark.parametrize("shift", ["left", "right"])
def test_streams_partition_the_corpus_into_documents(tmp_path, shift):
    texts = [t for f in write_parquet_corpus(tmp_path, n_files=3, docs_per_file=9,
                                             row_group_size=4, seed=11, max_words=40)
             for t in f]
    config = make_config([tmp_path], num_streams=3, global_batch_size=3, unit_rows=2,
                         shift=shift, packing="concat")
    outs = all_streams(config)
    docs = []
    for fields in outs:
        assert fields.shape[1] > 0, "a stream got no rows"
        if shift == "left":
            carried = stream_tokens(fields)
        else:
            carried = [int(t) for t in fields[F["targets"]][fields[F["inputs_segmentation"]] > 0]]
        docs += split_documents(carried, EOS)
    assert Counter(map(tuple, docs)) == Counter(map(tuple, tokenize(texts)))


@pytest.mark.parametrize("seq_len", [16, 2, 1])
@pytest.mark.parametrize("packing", ["first_fit", "best_fit", "none"])
def test_streams_partition_the_corpus_into_pieces_when_bin_packing(tmp_path, packing, seq_len):
    texts = [t for f in write_parquet_corpus(tmp_path, n_files=2, docs_per_file=10,
                                             row_group_size=4, seed=12, max_words=40)
             for t in f]
    config = make_config([tmp_path], num_streams=2, unit_rows=2, seq_len=seq_len,
                         packing=packing)
    got = Counter(tuple(s) for fields in all_streams(config) for s in segments(fields))
    expected = Counter(tuple(doc[i:i + seq_len]) for doc in tokenize(texts)
                       for i in range(0, len(doc), seq_len))
    assert got == expected


@pytest.mark.parametrize("packing", ["first_fit", "best_fit", "none"])
def test_bin_packing_makes_pieces_in_proportion_to_the_rows_it_makes(tmp_path, packing,
                                                                    monkeypatch):
    # Long documents in one large unit, cut into many row-sized pieces: a packing batch must
    # make the pieces it places (and the one that starts the next batch), not every piece of
    # the rest of the unit again for each batch.
    write_parquet_corpus(tmp_path, n_files=1, docs_per_file=40, row_group_size=40, seed=13,
                         min_words=60, max_words=120)
    config = make_config([tmp_path], seq_len=4, unit_rows=40, packing=packing, packing_bins=3)
    made = 0
    original = RowBuilder._pieces

    def counting(pieces):
        nonlocal made
        for item in pieces:
            made += 1
            yield item

    def counted(self, *args, **kwargs):
        nonlocal made
        got = original(self, *args, **kwargs)
        if isinstance(got, tuple):  # a list of pieces at once
            made += len(got[0])
            return got
        return counting(got)

    monkeypatch.setattr(RowBuilder, "_pieces", counted)
    rows = drain(Stream(config, build_plan(config), 0), n_rows=64).shape[1]
    assert rows > 500
    # A row holds at most seq_len pieces; each batch (at least one row) also makes the piece
    # that starts the next one.
    assert made <= (config.seq_len + 1) * rows, (made, rows)


def test_bin_packed_stream_rows_equal_grain_packing_of_the_documents(tmp_path):
    texts = make_texts(30, seed=5, max_words=12)
    write_parquet(tmp_path / "a.parquet", texts, row_group_size=7)
    seq_len = 24
    for packing, packer in (("first_fit", grain.experimental.FirstFitPackIterDataset),
                            ("best_fit", grain.experimental.BestFitPackIterDataset)):
        config = make_config([tmp_path], seq_len=seq_len, unit_rows=3, packing=packing,
                             packing_bins=4, shuffle=False, long_documents="truncate")
        fields = drain(Stream(config, build_plan(config), 0), n_rows=3)
        pieces = [np.array(d[:seq_len], np.int32) for d in tokenize(texts)]
        ds = grain.MapDataset.source([{"tokens": p} for p in pieces]).to_iter_dataset()
        rows = list(packer(ds, length_struct={"tokens": seq_len}, num_packing_bins=4,
                           shuffle_bins=False))
        assert fields.shape[1] == len(rows)
        for r, row in enumerate(rows):
            np.testing.assert_array_equal(fields[F["inputs"], r], row["tokens"])
            np.testing.assert_array_equal(fields[F["inputs_segmentation"], r],
                                          row["tokens_segment_ids"])
            np.testing.assert_array_equal(fields[F["inputs_position"], r],
                                          row["tokens_positions"])


def epoch_documents(tmp_path, **overrides) -> tuple[list[str], list[tuple[int, ...]]]:
    """Texts in file order and the documents one concat stream reads over two epochs."""
    texts = [t for f in write_parquet_corpus(tmp_path, n_files=2, docs_per_file=10,
                                             row_group_size=5, seed=21) for t in f]
    config = make_config([tmp_path], num_epochs=2, unit_rows=5, **overrides)
    docs = split_documents(stream_tokens(drain(Stream(config, build_plan(config), 0), 8)), EOS)
    return texts, [tuple(d) for d in docs]


def test_shuffle_changes_order_per_epoch_but_not_content(tmp_path):
    texts, docs = epoch_documents(tmp_path, shuffle=True)
    in_file_order = [tuple(d) for d in tokenize(texts)]
    n = len(texts)
    assert len(docs) == 2 * n
    epoch0, epoch1 = docs[:n], docs[n:]
    assert sorted(epoch0) == sorted(epoch1) == sorted(in_file_order)
    assert epoch0 != epoch1
    assert epoch0 != in_file_order and epoch1 != in_file_order
    # Documents inside a unit are shuffled too, not only the units.
    by_text = {d: i for i, d in enumerate(in_file_order)}
    unit_of = [by_text[d] // 5 for d in epoch0]
    runs = [list(g) for _, g in itertools.groupby(zip(unit_of, epoch0, strict=True),
                                                  key=lambda x: x[0])]
    assert any([by_text[d] for _, d in run] != sorted(by_text[d] for _, d in run)
               for run in runs)


def test_without_shuffle_every_epoch_reads_in_file_order(tmp_path):
    texts, docs = epoch_documents(tmp_path, shuffle=False)
    in_file_order = [tuple(d) for d in tokenize(texts)]
    assert docs == in_file_order * 2


def test_different_seeds_give_different_orders(tmp_path):
    _, docs_a = epoch_documents(tmp_path / "a", shuffle=True, seed=1)
    _, docs_b = epoch_documents(tmp_path / "b", shuffle=True, seed=2)
    assert docs_a != docs_b and sorted(docs_a) == sorted(docs_b)


def test_deal_gives_every_stream_units_and_similar_bytes(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(4):
        # Files of very different document lengths, so unit byte counts differ a lot.
        texts = make_texts(int(rng.integers(5, 30)), seed=i, min_words=1 + 20 * i,
                           max_words=2 + 40 * i)
        write_parquet(tmp_path / f"f{i}.parquet", texts, row_group_size=6)
    num_streams = 5
    config = make_config([tmp_path], num_streams=num_streams, global_batch_size=5, unit_rows=3)
    plan = build_plan(config)
    nbytes = [u.nbytes for u in plan.units]
    deals = []
    for epoch in range(3):
        dealt = [d.tolist() for d in deal_units(plan, num_streams=num_streams, seed=config.seed,
                                                epoch=epoch, shuffle=True)]
        assert sorted(u for units in dealt for u in units) == list(range(len(plan.units)))
        assert all(dealt), f"epoch {epoch}: a stream got no unit"
        loads = [sum(nbytes[u] for u in units) for units in dealt]
        # Greedy dealing to the lightest stream keeps the spread within one unit.
        assert max(loads) - min(loads) <= max(nbytes), (epoch, loads)
        deals.append(dealt)
        assert dealt == [d.tolist() for d in deal_units(  # a pure function
            plan, num_streams=num_streams, seed=config.seed, epoch=epoch, shuffle=True)]
    assert deals[0] != deals[1] != deals[2]


def test_streams_of_one_plan_share_each_epochs_deal(tmp_path):
    """A process's streams over one plan deal each epoch once, and read what deal_units says;
    another plan object (equal, or of another corpus) gets a deal of its own."""
    from ingest.stream.unit_reader import _dealt

    write_parquet(tmp_path / "a.parquet", make_texts(40, 0), row_group_size=10)
    config = make_config([tmp_path], num_streams=4, global_batch_size=4, unit_rows=3)
    plan = build_plan(config)
    streams = [Stream(config, plan, s) for s in range(config.num_streams)]
    for epoch in range(3):
        want = deal_units(plan, num_streams=4, seed=config.seed, epoch=epoch, shuffle=True)
        assert [s.reader.units(epoch).tolist() for s in streams] == [w.tolist() for w in want]
        # Every stream's list is the one deal's: made once for the four.
        shared = _dealt(plan, num_streams=4, seed=config.seed, epoch=epoch, shuffle=True,
                        source=None)
        assert all(s.reader.units(epoch) is shared[s.stream_id] for s in streams)
    twin = build_plan(config)  # equal, but another object
    again = _dealt(twin, num_streams=4, seed=config.seed, epoch=0, shuffle=True, source=None)
    assert [a.tolist() for a in again] == [d.tolist() for d in deal_units(
        plan, num_streams=4, seed=config.seed, epoch=0, shuffle=True)]
    assert again is not _dealt(plan, num_streams=4, seed=config.seed, epoch=0, shuffle=True,
                               source=None)
    # Other parameters are other deals.
    other = _dealt(plan, num_streams=4, seed=config.seed + 1, epoch=0, shuffle=True,
                   source=None)
    assert [a.tolist() for a in other] == [d.tolist() for d in deal_units(
        plan, num_streams=4, seed=config.seed + 1, epoch=0, shuffle=True)]
    assert [a.tolist() for a in other] != [a.tolist() for a in again]


def test_plan_with_fewer_rows_than_streams_says_so(tmp_path):
    # Units are cut down to one row to give every stream one; three rows cannot feed four.
    write_parquet(tmp_path / "a.parquet", make_texts(3, 0), row_group_size=4)
    config = make_config([tmp_path], unit_rows=2, num_streams=4, global_batch_size=4)
    with pytest.raises(ValueError, match=r"unit\(s\) for num_streams=4: the corpus has 3 "
                                         r"row\(s\), fewer than the streams"):
        build_plan(config)


def test_plan_fingerprint_changes_when_a_file_changes(tmp_path):
    texts = make_texts(12, 0)
    path = write_parquet(tmp_path / "a.parquet", texts, row_group_size=4)
    write_parquet(tmp_path / "b.parquet", make_texts(6, 1))
    config = make_config([tmp_path], unit_rows=2)
    fp = build_plan(config).fingerprint
    write_parquet(path, texts, row_group_size=4)
    assert build_plan(config).fingerprint == fp, "rewriting the same data changed it"

    write_parquet(path, texts + ["one more document"], row_group_size=4)
    assert build_plan(config).fingerprint != fp, "a file grew by a row"
    write_parquet(path, texts, row_group_size=6)
    assert build_plan(config).fingerprint != fp, "the row groups changed"
    write_parquet(path, [t + " and more" for t in texts], row_group_size=4)
    assert build_plan(config).fingerprint != fp, "the texts changed"
    write_parquet(path, texts, row_group_size=4)
    assert build_plan(config.replace(unit_rows=3)).fingerprint != fp, "unit_rows changed"
    (tmp_path / "b.parquet").unlink()
    assert build_plan(config).fingerprint != fp, "a file was removed"


def format_paths(tmp_path, texts, batch_size=None):
    return {
        "parquet": write_parquet(tmp_path / "t.parquet", texts, row_group_size=batch_size),
        "arrow": write_arrow(tmp_path / "t.arrow", texts, batch_size=batch_size),
        "feather": write_arrow(tmp_path / "t.feather", texts, batch_size=batch_size),
        "jsonl": write_jsonl(tmp_path / "t.jsonl", texts),
    }


def test_arrow_and_jsonl_sources_give_the_rows_of_the_same_texts_in_parquet(tmp_path):
    texts = make_texts(23, seed=8, max_words=25)
    texts[3] = "Ünïcödé text — naïve café, 日本語のテキスト, emoji 🙂 and \"quotes\"."
    texts[9] = "a line with\nan embedded newline and a\ttab"
    results = {}
    for fmt, path in format_paths(tmp_path, texts).items():
        for packing in ("concat", "best_fit"):
            config = make_config([path], unit_rows=4, packing=packing, num_epochs=2)
            results[fmt, packing] = drain(Stream(config, build_plan(config), 0), 4)
    for (fmt, packing), fields in results.items():
        np.testing.assert_array_equal(fields, results["parquet", packing],
                                      err_msg=f"{fmt} {packing}")
    docs = split_documents(stream_tokens(results["jsonl", "concat"]), EOS)
    assert Counter(map(tuple, docs)) == Counter(map(tuple, tokenize(texts) * 2))


def test_arrow_record_batches_split_units_like_parquet_row_groups(tmp_path):
    texts = make_texts(20, seed=9)
    paths = format_paths(tmp_path, texts, batch_size=6)
    del paths["jsonl"]  # a JSONL file is one row group
    outs = {}
    for fmt, path in paths.items():
        config = make_config([path], unit_rows=4, packing="first_fit")
        plan = build_plan(config)
        assert [(u.group, u.row_start, u.row_end) for u in plan.units] == [
            (0, 0, 3), (0, 3, 6), (1, 0, 3), (1, 3, 6), (2, 0, 3), (2, 3, 6), (3, 0, 2)]
        outs[fmt] = drain(Stream(config, plan, 0), 2)
        # With several streams the deal follows each format's byte estimates, so only the
        # content over all streams is the same.
        two = config.replace(num_streams=2)
        outs[fmt, 2] = Counter(tuple(s) for f in all_streams(two) for s in segments(f))
    for fmt in paths:
        np.testing.assert_array_equal(outs[fmt], outs["parquet"], err_msg=fmt)
        assert outs[fmt, 2] == outs["parquet", 2], fmt


def test_stream_counts_documents_and_rows_in_its_state(corpus):
    config = corpus_config(corpus, num_epochs=1)
    plan = build_plan(config)
    states = []
    for i in range(2):
        s = Stream(config, plan, i)
        fields = drain(s, 3)
        states.append(s.get_state())
        assert states[-1]["rows_emitted"] == fields.shape[1]
        assert states[-1]["exhausted"]
        assert s.produce(4).num_rows == 0, "an exhausted stream produced rows"
    assert sum(s["documents"] for s in states) == len(corpus[1])


@pytest.mark.parametrize(("packing", "long_documents"), [
    ("concat", "split"), ("first_fit", "split"), ("best_fit", "truncate"), ("none", "split")])
def test_chunks_count_documents_by_row_as_the_state_would_after_each_row(tmp_path, packing,
                                                                          long_documents):
    # The state is saved at chunk ends; a chunk's documents[i] must be what the state would
    # say after its row i, so the feed can report documents exactly at any step.
    texts = make_texts(40, 5, max_words=60)
    for i in (0, 7, 8, 21, 39):  # skipped documents at a unit's start, inside, and at the end
        texts[i] = None
    path = write_parquet(tmp_path / "a.parquet", texts, row_group_size=7)
    config = make_config([path], unit_rows=3, seq_len=16, packing=packing, packing_bins=3,
                         long_documents=long_documents, on_bad_document="skip", num_epochs=2)
    plan = build_plan(config)
    one_by_one = Stream(config, plan, 0)
    after_each_row = []
    while not one_by_one.get_state()["exhausted"]:
        if one_by_one.produce(1).num_rows:
            after_each_row.append(one_by_one.get_state()["documents"])
    assert after_each_row[-1] == 2 * 35, "every good document is counted once an epoch"
    assert len(set(after_each_row)) > 20, "the count moves within chunks, not only at ends"
    for sizes in ([len(after_each_row)], [1, 5, 2], [7]):
        stream = Stream(config, plan, 0)
        by_row = []
        for i in itertools.count():
            chunk = stream.produce(sizes[i % len(sizes)])
            by_row += chunk.documents.tolist()
            if chunk.exhausted:
                break
        assert by_row == after_each_row, sizes


def test_resume_of_an_endless_stream_matches_unbroken_stream(corpus):
    config = corpus_config(corpus, num_epochs=None, packing="best_fit")
    plan = build_plan(config)
    run = assert_resumes_identically(lambda: Stream(config, plan, 0), next_row, max_steps=60)
    assert len(run.outputs) == 60 and run.states[-1]["epoch"] >= 2


def test_jsonl_file_rewritten_in_place_is_read_afresh(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["first version one", "first version two"])
    config = make_config([path], unit_rows=2)
    drain(Stream(config, build_plan(config), 0))
    new = ["second file now", "entirely different"]
    write_jsonl(path, new)
    docs = split_documents(stream_tokens(drain(Stream(config, build_plan(config), 0))), EOS)
    assert sorted(docs) == sorted(tokenize(new))
