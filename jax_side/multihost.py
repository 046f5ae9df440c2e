"""Several JAX hosts: collectives between them, agreeing on the last step of finite data, one
summary for all (``jax_side.host_join`` joins them; ``jax_side.local_hosts`` launches them on
one machine).

Every host runs its own ``HostFeed`` for the streams whose rows land on its devices; hosts do
not coordinate to feed a step. Only the end of finite data needs agreement: a host whose
streams are exhausted keeps delivering all-padding blocks for them while any other host still
has rows, and every host stops after the same step, the last one with a row anywhere.

The agreement is a tiny allgather of each host's *claim*, the last step it knows to have a
row: the step it just assembled plus what the rows already in hand (the current chunk of each
stream, the batches assembled ahead) cover. Rows of a stream never come back once it is
exhausted, so a claim of step c vouches for every step up to c, and every host may deliver up
to the largest claim without asking again::

    step              1   2   3   4   5   6
    host 0 has rows   y   y   y   -   -   -        (- : all its streams are exhausted)
    host 1 has rows   y   y   y   y   y   -
    sync at step 1:   claims (2, 3) -> steps 1..3 go ahead without asking
    sync at step 4:   claims (3, 5) -> steps 4..5 go ahead; host 0 pads them
    sync at step 6:   claims (3, 5) -> 5 < 6: every host stops after step 5

With ``drop_remainder`` a claim is instead the last step a host knows to be *full* (every
owned stream has its rows), and the hosts go on through the smallest claim: the first step in
which any host would pad is dropped everywhere. A host claims at least the step it just
assembled while that step is full, so a claim below the step asked about is final::

    step              1   2   3   4
    host 0 full       y   y   y   -                (- : a stream of host 0 has run out)
    host 1 full       y   y   y   y
    sync at step 1:   claims (3, 4) -> min 3: steps 1..3 go ahead without asking
    sync at step 4:   claims (3, 4) -> 3 < 4: every host stops after step 3

Every host makes the same decisions from the same gathered claims, so the steps delivered do
not depend on timing, only on (config, corpus, seed), exactly as on one host. The allgather is
made from the consumer's thread, which waits for it, in program order with the training step's
own collectives. A peer that died makes it fail: at once when its sockets close, within 30 s
(gloo's connection timeout) when it died before the first collective; the error names what was
awaited. A peer that stalls without dying (a hung step, a debugger) would hold the others in the
collective for good, and a collective cannot be cancelled: it runs on a helper thread, and the
consumer gives up after ``agreement_timeout_s`` (``AGREEMENT_TIMEOUT_S`` by default), naming the
processes that never arrived (each marks its arrival in the key-value store of JAX's
coordination service).
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_side.private_api import coordination_client

__all__ = ["AGREEMENT_TIMEOUT_S", "EndAgreement", "PeerError", "allgather", "allgather_json",
           "bounded_allgather", "combine_stats", "global_batch"]

log = logging.getLogger("ingest.multihost")

# How long a host waits for the others at the end-of-data agreement. Hosts reach it a training
# step apart at most, unless one is stuck: twice HostFeed's get_timeout_s (300 s), so that a
# peer waiting on its own slow chunk fails first, with the error that names it.
AGREEMENT_TIMEOUT_S = 600.0


class PeerError(RuntimeError):
    """A collective between the JAX processes failed: a peer died, left or broke off.

    Attributes:
      what: what this process waited for.
    """

    def __init__(self, message: str, *, what: str):
        super().__init__(message)
        self.what = what


def _peer_error(what: str, e: Exception) -> PeerError:
    n = jax.process_count()
    return PeerError(
        f"process {jax.process_index()} of {n} waited for {what} from every process and the "
        f"allgather failed: {e}. Another process has probably died or left (see its log). "
        f"Restart all {n} processes and restore the last feed checkpoint (ingest run: "
        f"--resume)", what=what)


def allgather(x: np.ndarray, what: str) -> np.ndarray:
    """``x`` from every process, stacked along a new first axis (process order).

    Args:
      x: a small array of the same shape and dtype on every process.
      what: what the processes exchange, for the error message.

    Raises:
      PeerError: the collective failed, naming ``what`` and this process.
    """
    try:
        return np.asarray(multihost_utils.process_allgather(x))
    except jax.errors.JaxRuntimeError as e:
        raise _peer_error(what, e) from e


def bounded_allgather(x: np.ndarray, what: str, *, timeout_s: float, key: str,
                      setting: str, how: str) -> np.ndarray:
    """``allgather``, giving up after ``timeout_s``: a peer that stalls without dying holds an
    XLA collective for good, and it cannot be cancelled. The collective runs on a helper thread
    (this thread waits for it, so program order is kept); each process marks its arrival under
    ``key`` in the coordination service's key-value store, so the error names those that never
    came. After a timeout the helper thread stays blocked: the process should exit
    (``host_join.leave``), as after any ``PeerError``.

    Args:
      x: a small array of the same shape and dtype on every process.
      what: what the processes exchange, for the error message.
      timeout_s: the longest wait for every process.
      key: unique to this exchange and the same on every process.
      setting: the name of the setting ``timeout_s`` comes from, for the error message.
      how: where the user changes it, for the error message.

    Raises:
      PeerError: the collective failed, or did not finish within ``timeout_s``.
    """
    client = coordination_client()
    me, n = jax.process_index(), jax.process_count()
    if client is not None:
        try:
            client.key_value_set(f"{key}/{me}", "arrived")
        except Exception as e:  # noqa: BLE001 -- process 0, which holds the store, may be gone
            log.debug("cannot mark the arrival %s/%d: %s", key, me, e)
            client = None
    done: queue.Queue = queue.Queue()

    def gather() -> None:
        try:
            done.put(allgather(x, what))
        except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
            done.put(e)

    threading.Thread(target=gather, name="allgather", daemon=True).start()
    try:
        out = done.get(timeout=timeout_s)
    except queue.Empty:
        missing = _not_arrived(client, key, n)
        who = (f"process(es) {missing} of {n} never arrived: stalled without dying (a hung "
               f"or very slow step, a debugger) or cut off" if missing else
               "another process never arrived")
        raise PeerError(
            f"process {me} of {n} waited {timeout_s:g} s for {what} from every process; "
            f"{who}. That is the limit {setting}={timeout_s:g}: raise it ({how}) if a host's "
            f"steps may take that long, else restart all {n} processes and restore the last "
            f"feed checkpoint (ingest run: --resume)", what=what) from None
    if isinstance(out, BaseException):
        raise out
    if client is not None:
        # Every process has arrived: the mark is not needed any more (one per exchange).
        try:
            client.key_value_delete(f"{key}/{me}")
        except Exception as e:  # noqa: BLE001 -- a leftover mark costs a few bytes
            log.debug("cannot delete the arrival mark %s/%d: %s", key, me, e)
    return out


def _not_arrived(client, key: str, n: int) -> list[int]:
    """The processes without an arrival mark under ``key`` ([] when that cannot be told)."""
    if client is None:
        return []
    try:
        marks = client.key_value_dir_get(f"{key}/")
    except Exception as e:  # noqa: BLE001 -- the service may be gone with its process
        log.warning("cannot read the arrival marks under %s: %s", key, e)
        return []
    arrived = {int(k.rsplit("/", 1)[1]) for k, _ in marks}
    return [i for i in range(n) if i not in arrived]


def global_batch(batch: dict[str, jax.Array], step: int) -> dict[str, np.ndarray]:
    """The global batch as numpy on this process, rows in global order (for digests).

    A collective when the arrays span several processes: every process must call it.
    """
    if all(a.is_fully_addressable for a in batch.values()):
        return {k: np.asarray(v) for k, v in batch.items()}
    what = f"the global batch of step {step} (for --digest / --digest-log)"
    try:
        gathered = multihost_utils.process_allgather(batch, tiled=True)
    except jax.errors.JaxRuntimeError as e:
        raise _peer_error(what, e) from e
    return {k: np.asarray(v) for k, v in gathered.items()}


def allgather_json(obj: Any, what: str) -> list[Any]:
    """A JSON-serializable value from every process, in process order (two tiny allgathers:
    the lengths, then the padded UTF-8 bytes)."""
    data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), dtype=np.uint8)
    sizes = allgather(np.array([data.size], np.int32), what).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    everything = allgather(buf, what)
    return [json.loads(everything[i, :n].tobytes()) for i, n in enumerate(sizes)]


class EndAgreement:
    """The hosts' agreement on the last step of finite data (see the module docstring).

    One per ``HostFeed`` when several JAX processes feed a mesh. Every host calls
    ``continues`` for every step it is about to deliver, in the same order.

    Args:
      drop_remainder: claims name the last step known to be full, and the hosts go on through
        the smallest claim (else: the last step known to have a row, through the largest).
      timeout_s: the longest wait for the other hosts at one comparison (``PeerError`` after).

    Attributes:
      syncs: allgathers made so far (fewer than the steps: a claim covers several steps).
    """

    def __init__(self, *, drop_remainder: bool = False,
                 timeout_s: float = AGREEMENT_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"agreement_timeout_s={timeout_s} must be positive")
        self._agreed_through = 0
        self._drop_remainder = drop_remainder
        self._timeout = timeout_s
        # The same on every process: every process makes the same agreements, in order.
        self._id = next(EndAgreement._made)
        self.syncs = 0

    _made = itertools.count()

    def continues(self, step: int, claim: int) -> bool:
        """Whether ``step`` goes ahead on every host.

        Args:
          step: the step about to be delivered (steps count from 1; resumed runs go on).
          claim: the last step this host knows to have a row (< ``step`` once its streams are
            exhausted: the last step it had a row); with ``drop_remainder``, the last step it
            knows to be full (``step - 1`` when ``step`` is not).

        Raises:
          PeerError: a peer died or left while the hosts compared claims, or did not come
            within ``timeout_s``.
        """
        if step <= self._agreed_through:
            return True
        kind = "full step" if self._drop_remainder else "step with rows"
        claims = bounded_allgather(
            np.array([claim], np.int32),
            f"the end-of-data agreement at step {step} (every process's last {kind})",
            timeout_s=self._timeout, key=f"ingest/agreement/{self._id}/{self.syncs}",
            setting="agreement_timeout_s",
            how="HostFeed(agreement_timeout_s=...), ingest run --agreement-timeout SECONDS")
        self.syncs += 1
        self._agreed_through = int(claims.min() if self._drop_remainder else claims.max())
        return self._agreed_through >= step


# -- one summary for every host ----------------------------------------------------------------

_SUMMED = ("tokens", "padding_rows", "padding_tokens", "dropped_rows", "dropped_tokens",
           "documents", "truncated_documents",
           "truncated_tokens", "workers", "pending_workers", "restarts", "cpu_waits", "streams",
           "workers_killed", "tokens_per_s",
           "steady_tokens_per_s", "object_store_bytes_bound", "object_store_bytes_peak")
_PER_KEY = ("rows_per_s_by_worker", "rows_per_s_by_stream")
_WORST = ("stall_fraction", "steady_stall_fraction", "startup_s", "wait_s", "wait_max_s",
          "cpu_wait_s")


def combine_stats(per_host: list[dict[str, Any]]) -> dict[str, Any]:
    """One run summary from every host's ``HostFeed.stats()`` summary.

    Counts add up over hosts (tokens, padding, documents, workers; ``tokens_per_s`` is the
    hosts' rates added); times take the worst host (``startup_s``, ``stall_fraction``, waits);
    per-worker and per-stream rates are merged (a worker name two hosts use gets the host index
    as a prefix, ``1/w0``); any other value is host 0's. Steps,
    digest and backend are the same on every host, which is checked.

    Raises:
      RuntimeError: the hosts disagree on a value that must be the same (a bug).
    """
    out = dict(per_host[0])
    for key in ("steps", "first_step", "last_step", "digest", "backend"):
        values = [h.get(key) for h in per_host]
        if len(set(map(json.dumps, values))) > 1:
            raise RuntimeError(f"the hosts disagree on {key!r}: {values}; the multi-host "
                               f"end-of-data agreement should prevent this; this is a bug in "
                               f"jax_side.multihost")
    for key in _SUMMED:
        if key in out:
            out[key] = sum(h[key] for h in per_host)
    for key in _WORST:
        if key in out:
            out[key] = max(h[key] for h in per_host)
    skipped: dict[str, dict[str, int]] = {}
    skipped_rows: dict[str, int] = {}
    for h in per_host:
        for reason, per_file in h.get("skipped_documents", {}).items():
            for path, n in per_file.items():
                skipped.setdefault(reason, {})
                skipped[reason][path] = skipped[reason].get(path, 0) + n
        for path, n in h.get("skipped_rows_of_bad_files", {}).items():
            skipped_rows[path] = skipped_rows.get(path, 0) + n
    for key in _PER_KEY:
        if key not in out:
            continue
        names = [name for h in per_host for name in h[key]]
        out[key] = {(name if names.count(name) == 1 else f"{i}/{name}"): v
                    for i, h in enumerate(per_host) for name, v in h[key].items()}
    out["skipped_documents"] = skipped
    out["skipped_rows_of_bad_files"] = skipped_rows
    out["skipped_files"] = sorted({p for h in per_host for p in h.get("skipped_files", [])})
    out["hosts"] = len(per_host)
    return out
