"""A source folder's entries the listing cannot read (a folder without permission, a link that
leads nowhere) are errors naming them, or counted skips under ``on_bad_file: skip``: never
left out silently."""

from __future__ import annotations

import json
import os
import pwd
import select
import shutil
import signal
import tempfile

import pytest

from ingest import BadInputError, build_plan
from tests.helpers import make_config, make_texts, write_parquet


def _plan_as_nobody(path: str, on_bad_file: str) -> dict:
    """``build_plan`` over ``path`` in a forked child that has dropped root for the user
    nobody (root reads a folder of mode 000 anyway): the files, the skips, or the error."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the listing as the user nobody")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody to run the listing as")
    config = make_config([path], on_bad_file=on_bad_file, num_streams=1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            try:
                plan = build_plan(config)
                out = {"files": [f.path for f in plan.files],
                       "skipped": [list(s[:2]) for s in plan.skipped_files]}
            except BadInputError as e:
                out = {"error": str(e), "reason": e.reason}
            os.write(write, json.dumps(out).encode())
        except BaseException as e:  # noqa: BLE001  (reported to the parent)
            os.write(write, json.dumps({"crash": repr(e)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        ready, _, _ = select.select([f], [], [], 120)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        data = f.read() if ready else b'{"crash": "no answer in 120 s"}'
    os.waitpid(pid, 0)
    got = json.loads(data)
    assert "crash" not in got, got
    return got


@pytest.fixture
def corpus_with_a_locked_folder():
    top = tempfile.mkdtemp(prefix="ingest-locked-")
    try:
        os.chmod(top, 0o755)
        write_parquet(os.path.join(top, "a.parquet"), make_texts(20, 1))
        locked = os.path.join(top, "locked")
        os.mkdir(locked)
        write_parquet(os.path.join(locked, "b.parquet"), make_texts(20, 2))
        for p in (os.path.join(top, "a.parquet"), os.path.join(locked, "b.parquet")):
            os.chmod(p, 0o644)
        os.chmod(locked, 0)
        yield top, locked
    finally:
        os.chmod(os.path.join(top, "locked"), 0o755)
        shutil.rmtree(top, ignore_errors=True)


def test_a_folder_the_user_cannot_list_fails_naming_it(corpus_with_a_locked_folder):
    top, locked = corpus_with_a_locked_folder
    got = _plan_as_nobody(top, "error")
    assert got.get("reason") == "corrupt_file", got
    assert locked in got["error"] and "cannot list this folder" in got["error"]


def test_a_folder_the_user_cannot_list_is_a_counted_skip_when_asked(corpus_with_a_locked_folder):
    top, locked = corpus_with_a_locked_folder
    got = _plan_as_nobody(top, "skip")
    assert got["files"] == [os.path.join(top, "a.parquet")]
    assert got["skipped"] == [[locked, "corrupt_file"]]


@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_a_data_file_link_that_leads_nowhere_is_named(tmp_path, link):
    write_parquet(tmp_path / "a.parquet", make_texts(20, 1))
    bad = tmp_path / "b.parquet"
    os.symlink(tmp_path / "gone.parquet" if link == "dangling" else bad, bad)
    (tmp_path / "notes.txt").symlink_to(tmp_path / "nowhere")  # not data: ignored
    with pytest.raises(BadInputError, match=r"b\.parquet.*symbolic link") as e:
        build_plan(make_config([tmp_path], num_streams=1))
    assert e.value.reason == "corrupt_file"
    plan = build_plan(make_config([tmp_path], num_streams=1, on_bad_file="skip"))
    assert [f.path for f in plan.files] == [str(tmp_path / "a.parquet")]
    assert [s[0] for s in plan.skipped_files] == [str(bad)]
