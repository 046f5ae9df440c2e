"""Remote listings end in one line naming the URI, the cause and the fix, within a bounded
time, whether the storage refuses the connection or never answers."""

from __future__ import annotations

import socket
import threading

import pytest

from ingest.sources import paths
from ingest.sources.paths import list_files


def test_a_refused_connection_is_one_line_naming_the_uri():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    uri = f"s3://bucket/data/?endpoint_override=127.0.0.1:{port}&scheme=http"
    with pytest.raises(FileNotFoundError) as e:
        list_files((uri,))
    msg = str(e.value)
    assert msg.startswith(uri) and "\n" not in msg and "check" in msg


def test_storage_that_never_answers_ends_after_the_timeout(monkeypatch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # accepts connections and never answers
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    monkeypatch.setattr(paths, "REMOTE_TIMEOUT_S", 2.0)
    uri = f"s3://bucket/data/?endpoint_override=127.0.0.1:{server.getsockname()[1]}&scheme=http"
    try:
        with pytest.raises(FileNotFoundError, match=r"no answer from its storage in 2 s"):
            list_files((uri,))
    finally:
        stop.set()
        t.join(timeout=5)
        for c in held:
            c.close()
        server.close()


def test_an_offline_hub_glob_says_so(monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises((FileNotFoundError, OSError)) as e:
        list_files(("hf://datasets/org/name/data/*.parquet",))
    msg = str(e.value)
    assert "hf://datasets/org/name/data/*.parquet" in msg and "HF_HUB_OFFLINE" in msg
    assert "\n" not in msg
