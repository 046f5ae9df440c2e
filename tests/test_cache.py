"""The cache of derived files: reused while its inputs are unchanged, rebuilt otherwise."""

import os
import unicodedata

from ingest import cache
from ingest.tokenize.tokenizer import load_tokenizer


def test_a_cached_value_is_reused_until_its_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "vocab.txt"
    src.write_text("a b c")
    builds = []

    def build():
        builds.append(1)
        return src.read_text().split()

    assert cache.cached_by_files("words", [str(src)], build) == ["a", "b", "c"]
    assert cache.cached_by_files("words", [str(src)], build) == ["a", "b", "c"]
    assert len(builds) == 1
    src.write_text("a b c d")
    os.utime(src, ns=(1, 1))  # a new mtime even on coarse clocks
    assert cache.cached_by_files("words", [str(src)], build) == ["a", "b", "c", "d"]
    assert len(builds) == 2


def test_a_damaged_cache_file_is_rebuilt_and_an_unwritable_cache_is_skipped(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "vocab.txt"
    src.write_text("x")
    cache.cached_by_files("words", [str(src)], lambda: 1)
    (written,) = (tmp_path / "cache" / "words").iterdir()
    written.write_bytes(b"not a pickle")
    assert cache.cached_by_files("words", [str(src)], lambda: 2) == 2
    assert cache.cached_by_files("words", [str(src)], lambda: 3) == 2  # rewritten

    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("INGEST_CACHE_DIR", str(blocker))
    assert cache.cached_by_files("words", [str(src)], lambda: 4) == 4
    assert not list(tmp_path.glob("**/*.tmp"))


def test_gpt2_from_cached_ranks_encodes_like_a_fresh_parse(tmp_path, monkeypatch):
    text = "def f(x):\n    return x ** 2  # caf\u00e9 <|endoftext|>"
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    load_tokenizer.cache_clear()
    try:
        fresh = load_tokenizer("gpt2").encode_batch([text])[0]
        assert list((tmp_path / "cache" / "gpt2-ranks").iterdir())
        load_tokenizer.cache_clear()
        cached = load_tokenizer("gpt2").encode_batch([text])[0]
    finally:
        load_tokenizer.cache_clear()
    assert fresh.tolist() == cached.tolist()
    assert 50256 not in cached.tolist()  # the literal special token is ordinary text


def _made_once(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if ": made in " in r.getMessage()]


def test_a_first_use_logs_each_thing_it_makes_with_its_time_and_folder_and_a_second_none(
        tmp_path, monkeypatch, caplog, request):
    """A first run on a machine is slower by what it caches; it says what, how long and where,
    and a later run, reading them, says nothing of them."""
    from ingest.demo import write_demo_corpus
    from ingest.tokenize import bpe_tuetoken

    root = tmp_path / "cache"
    monkeypatch.setenv("INGEST_CACHE_DIR", str(root))
    caches = (load_tokenizer, bpe_tuetoken._guarded_tuetoken, bpe_tuetoken._tiktoken_only)

    def fresh_process():
        for c in caches:
            c.cache_clear()

    request.addfinalizer(fresh_process)
    caplog.set_level("INFO", logger="ingest")
    fresh_process()
    corpus = write_demo_corpus()
    tokenizer = load_tokenizer("gpt2")
    first = _made_once(caplog)
    kept = {m.split(" kept in ")[1].removesuffix(" for later runs") for m in first}
    assert {os.path.relpath(k, root).split(os.sep)[0] for k in kept} == {
        os.path.basename(corpus), "gpt2-ranks", "tuetoken", "backend-checks",
        f"tuetoken-guard-{unicodedata.unidata_version}"}, first
    assert all(os.path.isdir(k) and os.listdir(k) for k in kept), first
    assert any("writing the demo corpus" in r.getMessage() for r in caplog.records)

    caplog.clear()
    fresh_process()
    assert write_demo_corpus() == corpus
    again = load_tokenizer("gpt2")
    assert _made_once(caplog) == []
    assert not any("writing the demo corpus" in r.getMessage() for r in caplog.records)
    text = "def f(x):\n    return x  # caf\u00e9"
    assert again.encode_batch([text])[0].tolist() == tokenizer.encode_batch([text])[0].tolist()


def test_a_value_that_cannot_be_kept_is_not_said_to_be_kept(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("INGEST_CACHE_DIR", str(blocker))
    src = tmp_path / "vocab.txt"
    src.write_text("x")
    caplog.set_level("INFO", logger="ingest")
    assert cache.cached_by_files("words", [str(src)], lambda: 5, what="the words") == 5
    assert _made_once(caplog) == []
    monkeypatch.setenv("INGEST_CACHE_DIR", str(tmp_path / "cache"))
    assert cache.cached_by_files("words", [str(src)], lambda: 6, what="the words") == 6
    (line,) = _made_once(caplog)
    assert line.startswith("the words: made in ") and str(tmp_path / "cache" / "words") in line
