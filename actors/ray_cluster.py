"""The Ray cluster a command runs on: its own local one, or the one it was given.

Without ``--address`` and ``$RAY_ADDRESS``, every command starts a cluster of its own: fresh
ports, a temporary directory of its own (so Ray's ``ray_current_cluster`` file, stale or live,
is never read), on 127.0.0.1, stopped and removed when the command exits. It never joins a
cluster it was not given: another user's ``ray start --head``, or a second ``ingest run``
starting beside it, stays apart. Given an address, it joins that cluster, and fails within
seconds, naming the address, when nothing answers there.

Ray connects to a loopback address (``127.0.0.1:PORT``, ``localhost:PORT``) through the
machine's own address instead, where a head that listens on 127.0.0.1 only does not answer, and
retries there for minutes. ``prepare_ray_environment`` keeps every Ray socket of the process on
127.0.0.1 for such a head, before Ray is imported; once Ray is imported without it,
``start_ray`` fails within seconds, naming the address and the fix.

Interrupts: ``exit_on_signals`` turns SIGINT and SIGTERM into one line and exit status
``128 + signal`` wherever they arrive.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator

__all__ = ["ClusterUnreachableError", "Interrupted", "RayStarter", "exit_on_signals",
           "import_ray", "prepare_ray_environment", "start_ray"]

log = logging.getLogger("ingest")

# How long a given cluster's GCS port may take to accept a TCP connection. ray.init itself
# retries a dead address for minutes without a word.
CONNECT_TIMEOUT_S = 5.0

# Ray's Unix sockets live under <temp dir>/session_<date>_<pid>/sockets/ (about 60 characters
# below the temp dir); a socket path may have at most 107 (Linux's sun_path).
_MAX_TEMP_ROOT_CHARS = 40


# Ray settings of a local cluster. Ray deletes the objects whose last reference is gone in
# batches, once a second or every 100 objects, so that the messages that free each object's
# copies on every node go out together. On a cluster of one node there are no such messages,
# and a batch is up to a second of chunks held beyond the feed's bound: each object is deleted
# as soon as it is released instead.
LOCAL_SYSTEM_CONFIG = {"free_objects_period_milliseconds": 0}


class ClusterUnreachableError(ConnectionError):
    """The Ray cluster named by ``--address`` or ``$RAY_ADDRESS`` does not answer."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


def _exit_now(signum: int, frame) -> None:
    # A second signal while the first one unwinds: leave at once. A local cluster ends with
    # this process all the same (Ray's fate sharing, and the reaper).
    os._exit(128 + signum)


_REDELIVER_AFTER_S = 0.05  # far longer than the hook takes to return, too short to notice


def _redeliver_swallowed(previous_hook):
    """A ``sys.unraisablehook`` that sends the signal again when Python swallowed the
    ``Interrupted`` it raised: a signal handled inside a garbage-collector callback (JAX has
    one) or a ``__del__`` raises there, and Python only prints "Exception ignored"."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, Interrupted):
            # From another thread, a moment later: a signal sent at once would be handled
            # inside this hook, which swallows too. Should it land in such a place again, it
            # comes back here.
            timer = threading.Timer(_REDELIVER_AFTER_S, os.kill,
                                    (os.getpid(), unraisable.exc_value.signum))
            timer.daemon = True
            timer.start()
            return
        previous_hook(unraisable)

    return hook


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Raises ``Interrupted`` on SIGINT and SIGTERM inside the block; a second signal exits.

    Used by the console script around everything it does, so that an interrupt at any point
    (importing JAX, starting Ray, feeding) unwinds through the cleanups once and the command
    exits with ``128 + signal`` and one line, no traceback. Must run on the main thread.
    """
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_swallowed(previous_hook)
    try:
        yield
    except Interrupted:
        for s in previous:
            signal.signal(s, _exit_now)  # atexit's Ray shutdown must not be interrupted
        raise
    finally:
        sys.unraisablehook = previous_hook
        if signal.getsignal(signal.SIGINT) is _raise_interrupted:
            for s, handler in previous.items():
                signal.signal(s, handler)


# Ray's switch that puts every socket of a process on 127.0.0.1; read when Ray is imported.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def prepare_ray_environment(address: str | None) -> None:
    """Process-wide settings that must precede ``import ray``: sets ``LOOPBACK_SWITCH=0``
    (unless already set) where ``stays_on_loopback(address)``, so that every Ray socket of this
    process (and of the processes it starts) uses 127.0.0.1. Ray reads it when it is imported:
    set later, it does nothing.

    Args:
      address: the address the command was given (``--address``, else ``$RAY_ADDRESS``), or
        None.
    """
    if stays_on_loopback(address):
        os.environ.setdefault(LOOPBACK_SWITCH, "0")


def stays_on_loopback(address: str | None) -> bool:
    """Whether Ray must keep to 127.0.0.1 for ``address``: a cluster of this command's own
    (None, ``local``), or a loopback ``host:port`` whose cluster answers there but not on this
    machine's own address, where Ray would connect instead. Imports nothing of Ray."""
    if not address or address == "local":
        return True
    if "://" in address or address == "auto":
        return False
    endpoint = _host_port(address)
    if endpoint is None or not _is_loopback(endpoint[0]):
        return False
    own = _own_address()
    return (own is not None and not _is_loopback(own) and _answers(*endpoint)
            and not _answers(own, endpoint[1]))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _own_address() -> str | None:
    """The address Ray gives this machine's node: the interface of its route to a public
    address (a UDP socket's connect sends nothing); None where there is no such route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 53))
        except OSError:
            return None
        return s.getsockname()[0]


def _answers(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def check_loopback_route(address: str) -> None:
    """Raises ``ClusterUnreachableError`` where Ray, already imported, would connect to the
    loopback ``address`` through this machine's own address and nothing answers there: it
    would retry for minutes.

    Args:
      address: as given to ``--address`` or ``$RAY_ADDRESS``, after ``check_reachable``.
    """
    import ray.util  # noqa: PLC0415

    endpoint = _host_port(address) if "://" not in address else None
    if endpoint is None or not _is_loopback(endpoint[0]):
        return
    own = ray.util.get_node_ip_address()  # where Ray connects for a loopback address
    if _is_loopback(own) or _answers(own, endpoint[1]):
        return
    host, port = endpoint
    raise ClusterUnreachableError(
        f"the Ray cluster at {host}:{port} ({_given(address)}) answers on 127.0.0.1 only, but "
        f"Ray connects to a loopback address through this machine's address {own}:{port}, where "
        f"nothing answers; set {LOOPBACK_SWITCH}=0 in the environment before Ray is imported "
        f"(`ingest` sets it itself for such an address; from Python, set it before `import "
        f"ray`), or start the head on {own} (`ray start --head --node-ip-address={own}`) and "
        f"give {own}:{port}")


def start_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Joins ``address`` (or ``$RAY_ADDRESS``), else starts a local cluster of its own.

    A local cluster listens on 127.0.0.1 (see ``prepare_ray_environment``) with ports Ray picks
    free, keeps its files in a fresh temporary directory, and is stopped and removed at exit.

    Args:
      address: a Ray address (``host:port``, ``ray://host:port``, ``auto``), or None.
      num_cpus: logical CPUs of a local cluster (default: the machine's); ignored when joining.

    Raises:
      ClusterUnreachableError: nothing answers at the address given, or where Ray would
        connect for it (``check_loopback_route``).
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "local":
        check_reachable(address)
        check_loopback_route(address)
        try:
            _init_keeping_handlers(address=address, log_to_driver=True)
        except ConnectionError as e:  # a port that answers, but no Ray cluster behind it
            raise ClusterUnreachableError(
                f"no Ray cluster answers at {_given(address)}: {e}; {_FIX}") from e
        return
    cpus = os.cpu_count() or 1
    if num_cpus is not None and num_cpus > cpus:
        # Each worker takes one CPU: a worker with none would never start.
        log.warning("%d workers on %d CPUs: the local Ray cluster gets %d CPUs so that every "
                    "worker starts, and they share the cores (on the demo, 3 workers on 2 CPUs "
                    "were no faster than 2)", num_cpus, cpus, num_cpus)
    from actors.private_api import init_local_ray  # noqa: PLC0415 (see the reaper)

    temp_dir = _make_temp_dir()
    _start_reaper(temp_dir)  # first: it must see the daemons while they are still descendants
    try:
        # address="local": a new cluster even where ray_current_cluster names one (alive or
        # not); temp_dir: its sessions, sockets and address file apart from every other.
        init_local_ray(_init_keeping_handlers, temp_dir=temp_dir,
                       system_config=LOCAL_SYSTEM_CONFIG, address="local",
                       num_cpus=num_cpus or cpus, include_dashboard=False,
                       logging_level=logging.WARNING, configure_logging=True)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    # Registered after ray's own atexit hook, so it runs first: stop, then remove.
    atexit.register(_stop_local_cluster, temp_dir)


def _init_keeping_handlers(**kwargs) -> None:
    """ray.init, keeping ``exit_on_signals``' SIGTERM handler (ray.init on the main thread
    replaces it with a silent ``sys.exit``)."""
    import ray

    before = signal.getsignal(signal.SIGTERM)
    ray.init(**kwargs)
    if before is _raise_interrupted and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, before)


def _make_temp_dir() -> str:
    root = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    if len(root) > _MAX_TEMP_ROOT_CHARS:
        root = "/tmp"  # a long $TMPDIR would overflow the socket paths below it
    return tempfile.mkdtemp(prefix="ingest-ray-", dir=root)


def _stop_local_cluster(temp_dir: str) -> None:
    import ray

    try:
        ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


_reapers: list[subprocess.Popen] = []


def _start_reaper(temp_dir: str) -> None:
    """Starts a process that ends this cluster's processes and removes ``temp_dir`` as soon as
    this process ends, however it ends (SIGKILL included).

    Ray's fate sharing ends the GCS and the raylet with the process that started them, and the
    workers follow their raylet within a second; its agents, though, wait 60 s on the dead GCS
    before they exit. The reaper notices the end of this process when the pipe it reads closes.
    """
    read_end, write_end = os.pipe()  # both non-inheritable: only the reaper's stdin is passed
    try:
        _reapers.append(subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), temp_dir],
            stdin=read_end, stdout=subprocess.DEVNULL, close_fds=True))
    except OSError as e:
        os.close(write_end)
        log.warning("could not start the reaper of the local Ray cluster (%s): if this process "
                    "is killed, Ray's agents linger for a minute", e)
    finally:
        os.close(read_end)
    # write_end stays open, unwritten, for the life of this process.


def _reap(driver_pid: int, temp_dir: str) -> None:
    """The reaper's loop: notes the driver's descendants until its stdin closes, then kills
    those still running and every process with a file open under ``temp_dir`` (Ray's daemons
    and workers keep their logs there), and removes ``temp_dir``. It looks twice a second
    while the cluster starts, then every 5 s (each look reads every process: 0.6 % of a core
    at twice a second); its stdin's end wakes it at once either way."""
    import select

    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's to take
    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        driver = None
    starting = time.monotonic() + 30
    while True:
        if driver is not None:
            try:
                for p in driver.children(recursive=True):
                    if p.pid != me:
                        seen.setdefault(p.pid, p)
            except psutil.Error:
                pass
        ready, _, _ = select.select([0], [], [], 0.5 if time.monotonic() < starting else 5.0)
        if ready and not os.read(0, 1):  # end of file: the driver has exited
            break
    for pid in _pids_using(temp_dir):
        if pid != me and pid not in seen:
            try:
                seen[pid] = psutil.Process(pid)
            except psutil.Error:
                pass
    for p in seen.values():
        try:
            p.kill()  # psutil checks the start time too: a reused pid is left alone
        except psutil.Error:
            pass
    psutil.wait_procs(list(seen.values()), timeout=10)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _pids_using(directory: str) -> list[int]:
    """Processes of this user with a file open under ``directory``, or in their command line."""
    prefix = os.path.join(directory, "")
    found = []
    try:
        entries = list(os.scandir("/proc"))
    except OSError:  # no /proc (macOS): the descendants noted are all there is
        return found
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if prefix.encode() in f.read():
                    found.append(int(entry.name))
                    continue
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path).startswith(prefix):
                    found.append(int(entry.name))
                    break
        except OSError:  # gone, or another user's
            pass
    return found


def _host_port(address: str) -> tuple[str, int] | None:
    """The TCP endpoint behind a Ray address, or None where it has none to check."""
    if address == "auto":
        from actors.private_api import ray_auto_address  # noqa: PLC0415 (see the reaper)

        address = ray_auto_address()
        if address is None:
            return None
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


_FIX = ("start that cluster (on its head node: `ray start --head --port=PORT`) or give the "
        "address of one that runs; without --address and $RAY_ADDRESS, ingest starts a local "
        "Ray cluster of its own")


def _given(address: str) -> str:
    """Where ``address`` came from, for messages: ``--address=X`` or ``$RAY_ADDRESS=X``."""
    return f"{'$RAY_ADDRESS' if os.environ.get('RAY_ADDRESS') == address else '--address'}" \
           f"={address}"


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raises ``ClusterUnreachableError`` unless the cluster at ``address`` accepts a TCP
    connection within ``timeout_s``.

    Args:
      address: as given to ``--address`` or ``$RAY_ADDRESS``.
      timeout_s: the wait for the connection.
    """
    where = _given(address)
    try:
        endpoint = _host_port(address)
    except ConnectionError as e:
        raise ClusterUnreachableError(f"no Ray cluster for {where}: {e}; {_FIX}") from e
    if endpoint is None:
        return
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            pass
    except OSError as e:
        stale = (" (the address of the last `ray start` on this machine, read from Ray's "
                 "ray_current_cluster file; `ray stop` clears it)" if address == "auto" else "")
        raise ClusterUnreachableError(
            f"cannot reach the Ray cluster at {endpoint[0]}:{endpoint[1]} ({where}{stale}): "
            f"{e.strerror or e}; {_FIX}") from e


def import_ray():
    """The ``ray`` module.

    Raises:
      RuntimeError: Ray does not import in this Python (a wheel built for another Python or
        platform, say), naming the interpreter and the fix, from the import's own error.
    """
    try:
        import ray  # noqa: PLC0415
    except Exception as e:
        raise RuntimeError(
            f"Ray does not import in this Python ({sys.executable}): {type(e).__name__}: {e}. "
            f"Reinstall it for this interpreter (pip install --force-reinstall ray), or run "
            f"without Ray: --backend local") from e
    return ray


class RayStarter:
    """Starts (or joins) Ray on a background thread.

    A local cluster takes 3-5 s to start on 2 CPUs, about a third of it with a CPU idle: the
    driver meanwhile reads the config, loads the tokenizer and plans the units.
    """

    def __init__(self, address: str | None, num_cpus: int | None = None):
        given = address or os.environ.get("RAY_ADDRESS")
        # A local cluster of this process's own (not one joined): nothing outside this process
        # needs it, and its reaper stops it however the process ends.
        self.starts_local = not given or given == "local"
        self._error: BaseException | None = None
        self._up = threading.Event()
        # Whether the thread went on to ray.init (True) or was called off before (False):
        # decided once, under the lock, by whichever of the thread and ``join(abandon=True)``
        # comes first.
        self._decided = threading.Lock()
        self._starting: bool | None = None
        self._thread = threading.Thread(target=self._run, args=(address, num_cpus),
                                        name="ray.init", daemon=True)
        self._thread.start()

    def _run(self, address: str | None, num_cpus: int | None) -> None:
        # ray.init warns that it cannot set its SIGTERM handler off the main thread;
        # exit_on_signals (or wait()) handles SIGTERM there.
        from actors.private_api import ray_worker_logger  # noqa: PLC0415 (see the reaper)

        ray_worker_logger().addFilter(_NotMainThreadWarning())
        # Starting the cluster forks (and execs at once) Ray's daemons while JAX's threads run:
        # JAX's fork warning does not apply.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                                category=RuntimeWarning)
        try:
            ray = import_ray()
        except BaseException as e:  # noqa: BLE001 -- re-raised by wait()
            self._error = e
            self._up.set()
            return

        with self._decided:
            if self._starting is None:
                self._starting = True
        if not self._starting:  # the command is already on its way out
            self._up.set()
            return
        starts_cluster = not ray.is_initialized() and self.starts_local
        try:
            start_ray(address, num_cpus)
        except BaseException as e:  # noqa: BLE001 -- re-raised by wait()
            self._error = e
            return
        finally:
            self._up.set()
        if starts_cluster:
            # Ray's daemons die with the *thread* that started them (PR_SET_PDEATHSIG, Ray's
            # fate sharing): this thread stays until the process exits.
            threading.Event().wait()

    def join(self, *, abandon: bool = False) -> None:
        """Returns once ray.init has returned or raised; raises nothing.

        With ``abandon`` (a command on its way out of an error): returns at once where the
        thread has not reached ray.init yet, which it then never calls. A signal that
        interrupts this process's imports can leave one of Python's module locks held (the
        import machinery is Python code, and the signal's exception may land inside it), and
        the thread, importing Ray beside it, then waits for good; nothing of Ray has started.
        """
        if abandon:
            with self._decided:
                if self._starting is None:
                    self._starting = False
            if not self._starting:
                return
        self._up.wait()

    def is_up(self) -> bool:
        """Whether ray.init has returned (or raised)."""
        return self._up.is_set()

    def wait(self) -> None:
        """Returns once Ray is up; raises what ray.init raised."""
        self._up.wait()
        if self._error is not None:
            raise self._error
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            # What ray.init does on the main thread: SIGTERM exits through atexit, so that
            # the local cluster is stopped.
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))


class _NotMainThreadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


if __name__ == "__main__":
    # The reaper (see _start_reaper), run as a script: stdlib and psutil only (this module
    # imports the rest of the package inside the functions that need it).
    _reap(int(sys.argv[1]), sys.argv[2])
