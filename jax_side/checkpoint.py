"""The feed's state beside the model checkpoint: an orbax handler, its arguments and checks.

Every JAX process writes its ``HostFeed`` state as one JSON file into the ``feed`` item of an
orbax step directory. Restoring reads *every* process file and merges their streams, so a
checkpoint written by two hosts restores on one (or on four)::

    ckpt/21/model/...                    the model, through any orbax handler
    ckpt/21/feed/process_0-of-2.json     {"step": 21, "streams": {"0": .., "1": ..}, ...}
    ckpt/21/feed/process_1-of-2.json     {"step": 21, "streams": {"2": .., "3": ..}, ...}
    restore                           -> {"step": 21, "streams": {"0", "1", "2", "3"}, ...}

With one ``ocp.CheckpointManager`` for both::

    manager = checkpoint.open_manager(directory)
    manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(params), feed=checkpoint.FeedSave(feed.get_state())))
    state = checkpoint.restore_latest_feed(manager)   # falls back past unreadable steps
    feed.set_state(state)                              # checks config and corpus

JSON only: a checkpoint never holds pickled objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from ingest.dirlock import exclusive
from ingest.stream.state_check import describe, short
from jax_side.host_state import check_compatible, validate_state

__all__ = [
    "FEED_ITEM", "FeedCheckpointError", "FeedCheckpointHandler", "FeedRestore", "FeedSave",
    "check_compatible", "check_step_folders", "lock_directory", "open_manager", "restore_feed", "restore_latest_feed",
    "save_feed", "validate_state",
]

log = logging.getLogger(__name__)

FEED_ITEM = "feed"
"""The item name the feed state is saved under inside each orbax step directory."""

_PROCESS_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")
# Keys every process file holds; all but "streams" must agree between the processes.
_SHARED_KEYS = ("version", "step", "config_fingerprint", "corpus_fingerprint", "config")
# Shared by every process file where present (older checkpoints lack them).
_OPTIONAL_SHARED_KEYS = ("corpus_content",)
CHECKSUM_KEY = "sha256"
"""The key of a process file that holds the SHA-256 of the rest of it (``_checksum``)."""
# Orbax writes one of these into a step directory once every item of the step is saved.
_FINALIZED_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt")


class FeedCheckpointError(ValueError):
    """A feed checkpoint that cannot be read: missing, corrupt, truncated or inconsistent files.

    Attributes:
      path: the offending file or item directory, when one is to blame.
      step: the checkpoint step, when known.
    """

    def __init__(self, message: str, *, path: str | None = None, step: int | None = None):
        super().__init__(message)
        self.path = path
        self.step = step


def _process_file_name(process_index: int, process_count: int) -> str:
    """``process_{i}-of-{n}.json``: the file process ``i`` of ``n`` writes."""
    return f"process_{process_index}-of-{process_count}.json"


class FeedCheckpointHandler(ocp.CheckpointHandler):
    """Saves this process's feed state; restores the merged state of every process.

    Used through ``FeedSave`` / ``FeedRestore`` (registered with orbax's args mechanism), never
    directly.
    """

    def save(self, directory: epath.Path, item: Any = None, args: FeedSave | None = None) -> None:
        """Writes ``args.state`` to ``directory/process_{i}-of-{n}.json``.

        Args:
          directory: the item directory orbax created for this step.
          item: unused (the legacy orbax API); pass ``args``.
          args: ``FeedSave(state)``.

        Raises:
          TypeError: ``args`` is not a ``FeedSave`` or the state is not plain JSON data.
          ValueError: the state is not a HostFeed state.
        """
        del item
        if not isinstance(args, FeedSave):
            raise TypeError(f"FeedCheckpointHandler.save expects args=FeedSave(state), got "
                            f"{type(args).__name__}; save with "
                            f"ocp.args.Composite(feed=FeedSave(feed.get_state()))")
        state = args.state
        if not isinstance(state, dict) or "streams" not in state or "step" not in state:
            raise ValueError(f"FeedSave expects a HostFeed state (a dict with 'step' and "
                             f"'streams', from HostFeed.get_state()), got "
                             f"{describe(state)}")
        if CHECKSUM_KEY in state:
            raise ValueError(f"the feed state has a key {CHECKSUM_KEY!r}, which the process "
                             f"file keeps for its checksum; pass HostFeed.get_state() unchanged")
        try:
            digest = _checksum(state)
        except (TypeError, ValueError) as e:
            raise TypeError(f"the feed state is not plain JSON data ({e}); pass "
                            f"HostFeed.get_state() unchanged") from e
        text = json.dumps({**state, CHECKSUM_KEY: digest}, sort_keys=True, allow_nan=False)
        name = _process_file_name(jax.process_index(), jax.process_count())
        (epath.Path(directory) / name).write_text(text)

    def restore(self, directory: epath.Path, item: Any = None,
                args: FeedRestore | None = None) -> dict[str, Any]:
        """Reads every ``process_{i}-of-{n}.json`` in ``directory`` and merges them.

        Args:
          directory: the ``feed`` item directory of one step.
          item: unused (the legacy orbax API).
          args: ``FeedRestore()`` (no options).

        Returns:
          One host state holding the streams of every process that saved.

        Raises:
          FeedCheckpointError: a file is missing, not JSON, truncated, not a feed state, or the
            files disagree on the step, config or corpus.
        """
        del item, args
        directory = epath.Path(directory)
        return _merge_process_states(_read_process_files(directory))


def _read_process_files(directory: epath.Path) -> dict[str, dict[str, Any]]:
    """The parsed process files of one feed item directory, by path, in process order.

    Raises:
      FeedCheckpointError: no files, files from different process counts, a missing process,
        or a file that is not a JSON feed state (corrupt or truncated).
    """
    found: dict[int, tuple[int, epath.Path]] = {}
    counts: set[int] = set()
    try:
        names = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    except OSError as e:  # not a directory, or not readable
        raise FeedCheckpointError(
            f"{directory} cannot be listed ({type(e).__name__}: {e}); restore another step",
            path=str(directory)) from e
    for name in names:
        m = _PROCESS_FILE.fullmatch(name)
        if m:
            i, n = int(m.group(1)), int(m.group(2))
            found[i] = (n, directory / name)
            counts.add(n)
    if not found:
        raise FeedCheckpointError(
            f"{directory} holds no process_{{i}}-of-{{n}}.json files (found {names or 'nothing'})"
            f"; the feed was not saved at this step or its files were deleted",
            path=str(directory))
    if len(counts) > 1:
        raise FeedCheckpointError(
            f"{directory} mixes files of different process counts {sorted(counts)}: "
            f"{[p.name for _, p in found.values()]}; a step directory holds the files of one "
            f"save. Remove the stray files or restore another step", path=str(directory))
    (count,) = counts
    missing = [_process_file_name(i, count) for i in range(count) if i not in found]
    extra = [p.name for i, (_, p) in found.items() if i >= count]
    if missing or extra:
        raise FeedCheckpointError(
            f"{directory} is incomplete: expected {count} files process_0-of-{count}.json .. "
            f"process_{count - 1}-of-{count}.json; missing {missing}, unexpected {extra}. "
            f"A host's save did not finish; restore another step", path=str(directory))
    states = {}
    for i in range(count):
        path = found[i][1]
        try:
            state = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FeedCheckpointError(
                f"{path} is not valid JSON ({e}): the file is corrupt or was truncated; "
                f"restore another step", path=str(path)) from e
        except OSError as e:  # a directory in its place, no permission to read, an I/O error
            raise FeedCheckpointError(
                f"{path} cannot be read ({type(e).__name__}: {e}); restore another step",
                path=str(path)) from e
        missing_keys = [k for k in (*_SHARED_KEYS, "streams")
                        if not isinstance(state, dict) or k not in state]
        if missing_keys or not isinstance(state["streams"], dict):
            raise FeedCheckpointError(
                f"{path} is not a HostFeed state: expected a JSON object with keys "
                f"{[*_SHARED_KEYS, 'streams']}, got {describe(state)}; the file is corrupt or "
                f"was written by something else", path=str(path))
        state = _verify_checksum(path, state)
        bad_streams = [sid for sid, entry in state["streams"].items() if not _is_stream_entry(
            sid, entry)]
        if bad_streams:
            raise FeedCheckpointError(
                f"{path} holds malformed entries for stream(s) {bad_streams[:5]}: expected "
                f"\"<stream id>\": {{\"state\": <stream state or null>, \"taken\": <rows>}}; "
                f"the file is corrupt or was written by something else", path=str(path))
        states[str(path)] = state
    return states


def _checksum(state: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``state`` (sorted keys, no spaces, no NaN)."""
    canonical = json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _verify_checksum(path: epath.Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without its checksum, which must match the rest of it.

    A file without a checksum (saved by an ingest version that wrote none) passes: its fields
    are still checked against the plan on restore (``validate_state``).

    Raises:
      FeedCheckpointError: the checksum is not the rest's (the file was edited or corrupted).
    """
    if CHECKSUM_KEY not in state:
        return state
    state = dict(state)
    saved = state.pop(CHECKSUM_KEY)
    try:
        actual = _checksum(state)
    except (TypeError, ValueError):
        actual = None
    if saved != actual:
        raise FeedCheckpointError(
            f"{path} fails its checksum ({CHECKSUM_KEY} {short(saved, 80)} saved, "
            f"{actual} computed): the file was edited or corrupted after it was saved; "
            f"restore another step", path=str(path))
    return state


def _is_stream_entry(sid: Any, entry: Any) -> bool:
    return (isinstance(sid, str) and sid.isdigit() and isinstance(entry, dict)
            and (entry.get("state") is None or isinstance(entry.get("state"), dict))
            and isinstance(entry.get("taken"), int) and entry["taken"] >= 0)


def _merge_process_states(states: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Merges per-process states (by file path) into one: the union of their streams.

    Raises:
      FeedCheckpointError: the files disagree on step, version, config or corpus, or two of
        them hold different states for one stream.
    """
    (first_path, first), *rest = states.items()
    merged = {k: first[k] for k in (*_SHARED_KEYS, *_OPTIONAL_SHARED_KEYS) if k in first}
    merged["streams"] = dict(first["streams"])
    owner = dict.fromkeys(first["streams"], first_path)
    for path, state in rest:
        for k in (*_SHARED_KEYS, *_OPTIONAL_SHARED_KEYS):
            if state.get(k) != merged.get(k):
                raise FeedCheckpointError(
                    f"the process files of one step disagree on {k!r}: {first_path} has "
                    f"{short(merged.get(k))}, {path} has {short(state.get(k))}; every host "
                    f"must save the same step of the same run. Restore another step", path=path)
        for sid, entry in state["streams"].items():
            if sid in merged["streams"] and merged["streams"][sid] != entry:
                raise FeedCheckpointError(
                    f"stream {sid} is saved differently in {owner[sid]} and {path}; each stream "
                    f"belongs to one host. Restore another step", path=path)
            merged["streams"][sid] = entry
            owner.setdefault(sid, path)
    merged["streams"] = dict(sorted(merged["streams"].items(), key=lambda kv: int(kv[0])))
    return merged


@ocp.args.register_with_handler(FeedCheckpointHandler, for_save=True)
@dataclasses.dataclass
class FeedSave(ocp.args.CheckpointArgs):
    """Saves a feed state: ``ocp.args.Composite(feed=FeedSave(feed.get_state()), ...)``.

    Attributes:
      state: ``HostFeed.get_state()`` of this process.
    """

    state: dict[str, Any]


@ocp.args.register_with_handler(FeedCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class FeedRestore(ocp.args.CheckpointArgs):
    """Restores the merged feed state of all processes: ``Composite(feed=FeedRestore())``."""


def open_manager(directory: str | epath.Path, max_to_keep: int | None = None
                 ) -> ocp.CheckpointManager:
    """A checkpoint manager for ``directory`` (created if missing), for the feed and a model.

    Args:
      directory: local path (relative to the working directory, or absolute) or any URI orbax
        accepts.
      max_to_keep: keep this many most recent steps; None keeps all.

    Returns:
      An ``ocp.CheckpointManager``; save items with ``ocp.args.Composite``.
    """
    if max_to_keep is not None and (isinstance(max_to_keep, bool) or max_to_keep <= 0):
        raise ValueError(f"max_to_keep={max_to_keep!r} must be a positive integer or None")
    if "://" not in str(directory):
        # orbax takes a relative path for a URI and refuses it: made absolute here.
        directory = os.path.abspath(os.fspath(directory))
    check_step_folders(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(epath.Path(directory), options=options)


def check_step_folders(directory: str | epath.Path) -> None:
    """Refuses step folders (named by a number) that orbax did not finish writing.

    orbax takes every such folder for a step: one left behind (``mkdir ckpt/99``, a copy
    stopped half way) would make it decline every later save at or below that step.

    Raises:
      FeedCheckpointError: naming the folders and what to do.
    """
    directory = epath.Path(directory)
    if not directory.exists():
        return
    bad = sorted((p for p in directory.iterdir() if p.name.isdigit() and p.is_dir()
                  and not any((p / m).exists() for m in _FINALIZED_MARKERS)),
                 key=lambda p: int(p.name))
    if bad:
        raise FeedCheckpointError(
            f"{directory} holds step folder(s) {[p.name for p in bad]} that are not complete "
            f"checkpoints (no {' or '.join(_FINALIZED_MARKERS)} in them); orbax would decline "
            f"every save at or below step {bad[-1].name}. Remove them (or move them out of "
            f"{directory}), or choose another checkpoint directory", path=str(bad[0]))


def lock_directory(directory: str | epath.Path) -> contextlib.AbstractContextManager[None]:
    """Holds ``directory/.lock`` so that one run at a time saves there (created if missing).

    A local directory only; other URIs (``gs://...``) are not locked.

    Raises:
      ingest.dirlock.DirectoryInUseError: another live process holds it, naming its host and
        pid.
    """
    path = str(directory)
    if "://" in path:
        log.info("%s is not a local directory: not locked against a second run", path)
        return contextlib.nullcontext()
    os.makedirs(path, exist_ok=True)
    return exclusive(path, job="ingest run",
                     fix="choose another --checkpoint-dir (or checkpoint directory)")


def save_feed(manager: ocp.CheckpointManager, step: int, state: dict[str, Any]) -> bool:
    """Saves only the feed state as ``step`` (use ``Composite`` to save a model with it).

    orbax declines a step at or before the latest saved one; that is logged as a warning.

    Returns:
      Whether orbax saved the step.
    """
    saved = manager.save(step, args=ocp.args.Composite(**{FEED_ITEM: FeedSave(state)}))
    if not saved:
        log.warning("feed checkpoint step %d was not saved to %s: orbax saves only steps after "
                    "the latest one there (%s)", step, manager.directory, manager.latest_step())
    return saved


def restore_feed(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The merged feed state saved at ``step``.

    Raises:
      FeedCheckpointError: the step has no readable feed state (naming the file and step).
      FileNotFoundError: there is no such step.
    """
    if step not in manager.all_steps():
        raise FileNotFoundError(f"no checkpoint step {step} in {manager.directory}; it holds "
                                f"steps {sorted(manager.all_steps())}")
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**{FEED_ITEM: FeedRestore()}))
    except FeedCheckpointError as e:
        raise FeedCheckpointError(f"checkpoint step {step}: {e}", path=e.path, step=step) from e
    except KeyError as e:
        # orbax names the items present when the step has no "feed" item.
        raise FeedCheckpointError(
            f"checkpoint step {step} in {manager.directory} has no {FEED_ITEM!r} item ({e}); it "
            f"was saved without the feed state", step=step) from e
    return restored[FEED_ITEM]


def restore_latest_feed(manager: ocp.CheckpointManager) -> dict[str, Any] | None:
    """The feed state of the latest step that reads cleanly; None if there are no steps.

    A step whose feed files are missing, corrupt or truncated is reported with a warning and
    the previous step is tried.

    Raises:
      FeedCheckpointError: steps exist but none holds a readable feed state.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    failures: list[FeedCheckpointError] = []
    for step in steps:
        try:
            state = restore_feed(manager, step)
        except FeedCheckpointError as e:
            failures.append(e)
            log.warning("%s -- falling back to the previous checkpoint", e)
            continue
        if failures:
            log.warning("restored the feed from checkpoint step %d in %s, skipping unreadable "
                        "step(s) %s", step, manager.directory, [f.step for f in failures])
        return state
    if failures:
        raise FeedCheckpointError(
            f"none of the {len(steps)} checkpoint steps in {manager.directory} holds a readable "
            f"feed state: " + "; ".join(str(f) for f in failures)
            + ". Start without --resume (or from a fresh checkpoint directory)")
    return None
