"""A Mooncake Store for tests: ``mooncake_master`` (with its HTTP metadata server) on leased
loopback ports, a holder process (Mooncake's standalone ``mooncake_client``), and scenarios
run in processes the test can kill. Not part of the product.

Each server is started, polled until it answers (with a deadline), and stopped at the end of
its context; their logs are kept in a temporary folder and shown when a start fails.
:func:`missing` names what this machine lacks for Mooncake (the tests skip with it):
``.ci/stack.sh`` installs both pieces into the current stack.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tests.support import child
from tests.support.ports import lease

START_DEADLINE_S = 60.0


def missing() -> str | None:
    """What is missing for Mooncake here (for a skip reason), or None. Imports nothing of
    mooncake (its package's ``__init__`` loads the native library)."""
    spec = importlib.util.find_spec("mooncake")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not any(name.startswith("store.") and name.endswith(".so")
               for folder in folders for name in os.listdir(folder)):
        return ("the mooncake package (pip install mooncake-transfer-engine-non-cuda; .ci/stack.sh "
                "installs it in the current stack)")
    for library, package in (("libibverbs.so.1", "libibverbs1"), ("libnuma.so.1", "libnuma1")):
        try:
            ctypes.CDLL(library)
        except OSError:
            return f"{library} (the Debian package {package}: apt-get install -y {package})"
    return None


def wait_for(what: str, ready: Callable[[], bool], deadline_s: float, *, alive: Callable[[], bool],
             log: str | None = None) -> None:
    """Poll ``ready()`` until it holds; raise when ``alive()`` stops holding or at the deadline."""
    end = time.monotonic() + deadline_s
    while not ready():
        if not alive():
            raise RuntimeError(f"{what}: the process exited before it was ready\n{_tail(log)}")
        if time.monotonic() > end:
            raise RuntimeError(f"{what}: not ready after {deadline_s:.0f} s\n{_tail(log)}")
        time.sleep(0.05)   # the polling interval, not a wait for the condition


def _tail(path: str | None, chars: int = 4000) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f"--- {path} ---\n" + f.read()[-chars:]


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@dataclass(frozen=True)
class Master:
    """A running ``mooncake_master`` on loopback."""

    rpc_port: int
    metadata_port: int
    admin_port: int
    pid: int
    log: str

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def settings(self, local_hostname: str | None = None, **overrides) -> dict:
        """A client's settings (a dict: it crosses to a scenario as JSON; build
        ``MooncakeSettings(**it)`` there). ``local_hostname`` defaults to a leased loopback
        name, unique to this client."""
        return {"master_address": self.master_address, "metadata_server": self.metadata_server,
                "local_hostname": local_hostname or f"127.0.0.1:{lease(1)}",
                "admin_url": self.admin_url, **overrides}

    def segments(self) -> list[str]:
        """The segments mounted now (the admin server's ``/get_all_segments``)."""
        with urllib.request.urlopen(self.admin_url + "/get_all_segments", timeout=5) as reply:
            return [s for s in reply.read().decode().splitlines() if s]


@contextlib.contextmanager
def running_master(*extra_flags: str, folder: str | None = None) -> Iterator[Master]:
    """``mooncake_master`` with its HTTP metadata server on three leased loopback ports,
    ready (its admin server reports it serving, its metadata server answers); stopped after."""
    from ascend_rl_plugins.transport.mooncake_store import package_binary
    first = lease(3)
    folder = folder or tempfile.mkdtemp(prefix="ascend-rl-mooncake-")
    log = os.path.join(folder, f"master-{first}.log")
    command = [package_binary("mooncake_master"), f"--rpc_port={first}", "--rpc_address=127.0.0.1",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={first + 1}", f"--metrics_port={first + 2}",
               "--metrics_host=127.0.0.1", "--rpc_thread_num=2", "--logtostderr", *extra_flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=folder,
                                start_new_session=True)
    master = Master(first, first + 1, first + 2, proc.pid, log)
    try:
        def ready() -> bool:
            return (_http_status(master.admin_url + "/health") == 200
                    and _http_status(master.metadata_server + "?key=ascend-rl-probe") is not None)
        wait_for("mooncake_master", ready, START_DEADLINE_S, alive=lambda: proc.poll() is None, log=log)
        yield master
    finally:
        _stop(proc)


@contextlib.contextmanager
def running_holder(master: Master, segment_size: int, folder: str | None = None) -> Iterator[str]:
    """A holder (``mooncake_client``, lending ``segment_size`` bytes) registered with
    ``master``; yields its segment name (the writers' ``holder_segment``); stopped after."""
    from ascend_rl_plugins.transport.mooncake_store import MooncakeSettings, holder_command
    settings = MooncakeSettings(**master.settings(segment_size=segment_size))
    folder = folder or tempfile.mkdtemp(prefix="ascend-rl-mooncake-")
    log = os.path.join(folder, f"holder-{settings.local_hostname.replace(':', '-')}.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(holder_command(settings, service_port=lease(1)), stdout=out,
                                stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)
    try:
        wait_for("mooncake_client (holder)", lambda: settings.local_hostname in master.segments(),
                 START_DEADLINE_S, alive=lambda: proc.poll() is None, log=log)
        yield settings.local_hostname
    finally:
        _stop(proc)


class LiveScenario:
    """A scenario function run in a child process that stays alive between steps, until killed.

    The function gets a folder; it reports each step's JSON result with :func:`report`
    (step 0, 1, ...), reads the test's commands with :func:`next_command` (a line on its
    standard input; None once the test closed it) and keeps its process alive with
    :func:`wait_until_killed`. The test reads step ``n`` with :meth:`result` (polled, with a
    deadline), sends commands with :meth:`send`, and kills the process with :meth:`kill`
    (SIGKILL: no clean-up runs); a test process that dies closes the pipe, and the scenario
    ends."""

    def __init__(self, module: str, function: str, *args, env: dict | None = None):
        self.folder = tempfile.mkdtemp(prefix="ascend-rl-live-")
        self.log = os.path.join(self.folder, "output.log")
        # tests/support/child.py's command and environment: the same runner as run_scenario
        command = child._command(module, function, (self.folder, *args), None, False)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(command, env=child._child_env(env), cwd=child.REPO,
                                         stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def result(self, step: int = 0, deadline_s: float = 180.0):
        path = _step_path(self.folder, step)
        wait_for(f"live scenario step {step} (pid {self.proc.pid})", lambda: os.path.exists(path),
                 deadline_s, alive=lambda: self.proc.poll() is None, log=self.log)
        with open(path) as f:
            return json.load(f)

    def send(self, command: dict) -> None:
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.stdin.close()

    def __enter__(self) -> "LiveScenario":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def _step_path(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}.json")


def report(folder: str, step: int, result) -> None:
    """Write a live scenario's result of ``step`` (atomically: the test polls for the file)."""
    path = _step_path(folder, step)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def next_command() -> dict | None:
    """The test's next command to a live scenario (blocks until it sends one), None once the
    test closed the pipe."""
    line = sys.stdin.readline()
    return json.loads(line) if line else None


def wait_until_killed() -> None:
    """Keep a live scenario's process (and its Mooncake client, and its segment) alive until
    the test kills it: block on standard input, which only the test's end closes."""
    sys.stdin.read()
