"""Loading a YAML config: keys given twice, files that are not mappings, misspelt fields, and
batch or chunk sizes that cannot fit in this machine's memory.

Each is refused with one message naming the file, the key or field, what arrived and the fix.
"""

from __future__ import annotations

import re
import resource
import subprocess
from pathlib import Path

import pytest
import yaml
from test_cli import cli_env, ingest_command

from ingest import ConfigError, load_config
from ingest.config import check_memory, machine_memory
from ingest.runtime import resolve_runtime

BASE = "sources:\n  - paths: [data]\nseq_len: 32\nglobal_batch_size: 8\nnum_streams: 4\n"
DEADLINE_S = 120


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "feed.yaml"
    path.write_text(text)
    return path


def test_keys_given_twice_are_refused_naming_both_lines(tmp_path):
    path = _write(tmp_path, "sources:\n"
                            "  - paths: [data]\n"
                            "    weight: 1\n"
                            "    weight: 2\n"          # line 4, in a source
                            "seq_len: 32\n"
                            "global_batch_size: 8\n"
                            "seq_len: 64\n"            # line 7, at the top
                            "batch_rampup: {0: 0.5, 0: 1.0}\n")  # line 8, twice on one line
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert sorted(e.value.problems) == sorted([
        "key 'weight' is given twice, at line 3 and line 4 (YAML would keep only the last); "
        "remove one",
        "key 'seq_len' is given twice, at line 5 and line 7 (YAML would keep only the last); "
        "remove one",
        "key 0 is given twice, at line 8 and line 8 (YAML would keep only the last); remove one",
    ])
    assert str(path) in str(e.value)


def test_a_merge_key_overridden_in_place_is_no_repeat(tmp_path):
    path = _write(tmp_path, "sources:\n  - &b {paths: [data], weight: 1}\n  - {<<: *b, weight: 3}\n"
                            "seq_len: 32\nglobal_batch_size: 8\nnum_streams: 4\n")
    config = load_config(str(path))
    assert [s.weight for s in config.sources] == [1, 3]


@pytest.mark.parametrize("text, holds", [
    ("- seq_len: 32\n- global_batch_size: 8\n", "a list of 2 item(s), the first {'seq_len': 32}"),
    ("1024\n", "the int 1024"),
    ("seq_len=32\n", "the str 'seq_len=32'"),
])
def test_a_file_that_is_not_a_mapping_is_refused_naming_what_it_holds(tmp_path, text, holds):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert e.value.problems == [f"{path} must be a mapping of fields (seq_len: 1024, sources: "
                                f"[...], ...), but it holds {holds}"]


def test_unknown_fields_suggest_the_closest_known_one(tmp_path):
    path = _write(tmp_path, "sources:\n  - paths: [data]\n    text_colum: body\n    zzz: 1\n"
                            "seq_length: 32\nglobal_batch_size: 8\nnum_stream: 4\nqqq: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    msgs = {p.split(";")[0]: p for p in e.value.problems}
    assert "; did you mean 'seq_len'?; known fields: [" in msgs["unknown field 'seq_length'"]
    assert "; did you mean 'num_streams'?" in msgs["unknown field 'num_stream'"]
    assert "; did you mean 'text_column'?" in msgs["sources[0]: unknown field 'text_colum'"]
    assert "did you mean" not in msgs["unknown field 'qqq'"]
    assert "did you mean" not in msgs["sources[0]: unknown field 'zzz'"]


def test_check_memory_passes_sizes_that_fit_and_names_the_machines_memory(tmp_path):
    total, what = machine_memory()
    assert total > 2**28 and ("physical memory" in what or "limit" in what)
    config = load_config(str(_write(tmp_path, BASE)))
    check_memory(config)  # 8 rows of 32 tokens
    # The same sizes against a memory just below their need: 6 batches of six int32 fields,
    # and 4 x 4 chunks of 14 bytes a token (two int32 token fields, three uint16 layout ones).
    need = (6 * 8 * 24 + 4 * 4 * resolve_runtime(config).chunk_rows * 14) * 32
    check_memory(config, memory=(need, "a test budget"))
    with pytest.raises(ConfigError, match=r"the batches \(36.0 KiB: 6 x 8 rows x seq_len=32 x 6 "
                                          r"fields x 4 bytes\) and chunks .* more than this "
                                          r"machine's .* of a test budget"):
        check_memory(config, memory=(need - 1, "a test budget"))


def _limited() -> None:
    # Should the check ever be skipped, the child fails with MemoryError instead of taking
    # the machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))


@pytest.mark.parametrize("command, fields, expect", [
    ("run", {"seq_len": 1_000_000_000},
     [r"global_batch_size=8: 8 rows on this host x seq_len=1,000,000,000 x 6 fields x 4 bytes "
      r"= 178.8 GiB per batch; the host keeps 6 .*: 1.0 TiB, more than this machine's "
      r".* Lower global_batch_size or seq_len",
      r"chunk_rows=1 \(automatic\) x seq_len=1,000,000,000 .* Lower prefetch or seq_len"]),
    ("run", {"global_batch_size": 400_000_000},
     [r"global_batch_size=400000000: 400,000,000 rows on this host x seq_len=32 .* 286.1 GiB "
      r"per batch"]),
    ("run", {"batch_rampup": {0: 1, 10: 50_000_000}},
     [r"batch_rampup step 10: global_batch_size=8 x 5e\+07 = 400000000 rows: 400,000,000 rows "
      r"on this host .* Lower that factor or seq_len"]),
    ("materialize", {"seq_len": 1_000_000_000, "num_epochs": 1},
     [r"chunk_rows=1 \(automatic\) x seq_len=1,000,000,000 x 20 bytes a token = 18.6 GiB per "
      r"chunk; 4 "
      r"stream\(s\) keep up to prefetch=2 \+ 2 chunks each"]),
])
def test_sizes_that_cannot_fit_in_memory_fail_at_start_naming_the_field(tmp_path, command,
                                                                        fields, expect):
    cfg = yaml.safe_load(BASE)
    cfg.update(fields)
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(cfg))
    extra = ["--out", str(tmp_path / "out")] if command == "materialize" else []
    done = subprocess.run(ingest_command() + [command, str(path), "--backend", "local",
                                              "--no-progress", *extra],
                          env=cli_env(tmp_path / "cache"), capture_output=True, text=True,
                          timeout=DEADLINE_S, stdin=subprocess.DEVNULL, preexec_fn=_limited)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    problems = done.stderr.split("problem(s) in config:\n")[1].split("\n  - ")
    assert len(problems) == len(expect), done.stderr
    for pattern in expect:
        assert any(re.search(pattern, p) for p in problems), (pattern, problems)


@pytest.mark.parametrize("batch, streams, expected", [
    (32, 5, [1, 2, 4, 8, 16, 32]),                  # few divisors: all of them
    (720, 7, [2, 3, 4, 5, 6, 8, 9, 10]),            # many: the ones closest to num_streams
    (2**40 * 3, 7, [1, 2, 3, 4, 6, 8, 12, 16]),     # over 10^12: found from sqrt(n) candidates
])
def test_a_batch_num_streams_does_not_divide_suggests_divisors(tmp_path, batch, streams,
                                                               expected):
    text = BASE.replace("global_batch_size: 8", f"global_batch_size: {batch}").replace(
        "num_streams: 4", f"num_streams: {streams}")
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    message = str(e.value)
    assert f"global_batch_size={batch} is not divisible by num_streams={streams}" in message
    assert str(expected) in message
    assert all(batch % d == 0 for d in expected)
