"""A whole fleet spread over namespace hosts: the store (Valkey with a password) on its own host, two
routers on two hosts behind HAProxy (deploy/lb/haproxy.cfg) on a fifth, prefill workers on two hosts
and decode workers on two more, plus a client host the caller talks from. Each role is started with
its compose file's command (`roles.role_argv`) and waited for over the bridge, never via 127.0.0.1.
"""
from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kimi_pd.multihost import roles
from kimi_pd.multihost.netns import Host, Network, inside
from kimi_pd.processes import Processes

REPO = Path(__file__).resolve().parents[2]
HAPROXY_CFG = REPO / "deploy" / "lb" / "haproxy.cfg"
# small caches and fast heartbeats: a tiny model on a small machine, bounded waits
WORKER_TUNING = ("--block-size", "4", "--kda-chunk-size", "8", "--cache-memory", "8MiB", "--heartbeat-s", "0.2",
                 "--max-num-seqs", "8", "--log-level", "warning")
ROUTER_TUNING = ("--health-check-interval", "0.3", "--refresh-interval", "0.2", "--connect-timeout", "1",
                 "--log-level", "warning")
OCTETS = {"store": 10, "router-1": 21, "router-2": 22, "lb": 30, "prefill-1": 41, "prefill-2": 42,
          "decode-1": 51, "decode-2": 52, "tp-node-1": 61, "tp-node-2": 62, "tp-node-3": 63, "client": 100}


@dataclass(frozen=True)
class FleetSpec:
    model_dir: Path
    workdir: Path
    prefill: int = 2
    decode: int = 2
    routers: int = 2
    worker_args: tuple[str, ...] = WORKER_TUNING
    router_args: tuple[str, ...] = ROUTER_TUNING
    ready_timeout_s: float = 180.0
    prefill_nodes: int = 1          # > 1: prefill-1 is a TP engine over this many hosts (tp-node-N run headless)
    master_port: int = 29500
    expert_parallel: bool = False   # with prefill_nodes > 1: --enable-expert-parallel too
    data_parallel: bool = False     # with prefill_nodes > 1: one DP rank per host (--data-parallel-*) instead of TP


@dataclass(frozen=True)
class Conn:
    """One TCP connection as `ss` shows it inside `host` (closed ones too, while in TIME-WAIT)."""
    host: str
    state: str
    local: str
    peer: str
    process: str

    @property
    def loopback(self) -> bool:
        return any(a.startswith(("127.", "[::1]", "[::ffff:127.")) for a in (self.local, self.peer))


@dataclass
class MultiHostFleet:
    spec: FleetSpec
    net: Network = field(default_factory=Network)
    procs: Processes = field(default_factory=Processes)
    password: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    secret: str = field(default_factory=lambda: secrets.token_hex(24), repr=False)
    admin: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    names: dict[str, str] = field(default_factory=dict)      # role host -> process name

    def __enter__(self) -> MultiHostFleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- addresses ----------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        return self.net.hosts[name]

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.password}@{self.host('store').addr}:{roles.STORE_PORT}/0"

    def url(self, name: str) -> str:
        port = {"prefill": roles.PREFILL_PORT, "decode": roles.DECODE_PORT, "router": roles.ROUTER_PORT,
                "lb": roles.LB_PORT}[name.split("-")[0]]
        return f"http://{self.host(name).addr}:{port}"

    def worker_id(self, name: str) -> str:
        role = name.split("-")[0]
        return f"{role}-{self.url(name).removeprefix('http://')}"

    def role_hosts(self, role: str) -> list[str]:
        count = {"prefill": self.spec.prefill, "decode": self.spec.decode, "router": self.spec.routers}[role]
        return [f"{role}-{i}" for i in range(1, count + 1)]

    def node_env(self, name: str) -> dict[str, str]:
        return roles.node_env(self.host(name).addr, self.redis_url, self.secret, self.admin, str(self.spec.model_dir))

    # ---- start / stop -------------------------------------------------------------------------
    def start(self) -> None:
        self.spec.workdir.mkdir(parents=True, exist_ok=True)
        names = ["store", *self.role_hosts("router"), "lb", *self.role_hosts("prefill"), *self.role_hosts("decode"),
                 *self.tp_nodes(), "client"]
        for name in names:
            self.net.add_host(name, OCTETS[name])
        self._start_store()
        for name in (*self.role_hosts("prefill"), *self.role_hosts("decode"), *self.role_hosts("router")):
            self.start_role(name)
        for node, name in enumerate(self.tp_nodes(), 1):
            self.start_tp_node(name, node)
        self._start_lb()
        deadline = time.monotonic() + self.spec.ready_timeout_s
        for name in (*self.role_hosts("prefill"), *self.role_hosts("decode")):
            self.wait_http(name, "/health", deadline)
        for name in (*self.role_hosts("router"), "lb"):
            self.wait_http(name, "/ready", deadline)
        while set(self.lb_servers().values()) != {"UP"} and time.monotonic() < deadline:
            time.sleep(0.3)                     # the LB's own checks: every router in rotation

    def spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.names[name] = name
        self.procs.spawn(name, self.host(name).argv(cmd), env, self.spec.workdir / f"{name}.log")

    def _start_store(self) -> None:
        from shared.store.embedded import find_server_binary
        env = {"PATH": f"{find_server_binary().parent}:/usr/sbin:/usr/bin:/bin",
               "KIMI_PD_STORE_PASSWORD": self.password}
        self.spawn("store", roles.store_argv("0.0.0.0", roles.STORE_PORT), env)

    def tp_nodes(self) -> list[str]:
        return [f"tp-node-{i}" for i in range(1, self.spec.prefill_nodes)]

    def tp_args(self, node: int) -> list[str]:
        """prefill-1's engine spread over `prefill_nodes` hosts, meeting at prefill-1's address."""
        n = self.spec.prefill_nodes
        if self.spec.data_parallel:
            return ["--data-parallel-size", str(n), "--data-parallel-size-local", "1", "--data-parallel-start-rank",
                    str(node), "--data-parallel-address", self.host("prefill-1").addr, "--data-parallel-rpc-port",
                    str(self.spec.master_port), "--enable-expert-parallel"]
        return ["--tensor-parallel-size", str(n), "--nnodes", str(n), "--node-rank", str(node),
                "--master-addr", self.host("prefill-1").addr, "--master-port", str(self.spec.master_port),
                *(["--enable-expert-parallel"] if self.spec.expert_parallel else [])]

    def start_role(self, name: str) -> None:
        role, env = name.split("-")[0], self.node_env(name)
        argv = roles.role_argv(role, env)
        tuning = self.spec.router_args if role == "router" else self.spec.worker_args
        if name == "prefill-1" and self.spec.prefill_nodes > 1:
            tuning = (*tuning, *self.tp_args(0))
        self.spawn(name, [*roles.KIMI_PD, *argv[1:], *tuning], roles.role_env(role, env))

    def start_tp_node(self, name: str, node: int) -> None:
        """A headless node of prefill-1's engine: the prefill command, its share of ranks, no server."""
        env = self.node_env(name)
        argv = roles.role_argv("prefill", env)
        self.spawn(name, [*roles.KIMI_PD, *argv[1:], *self.spec.worker_args, *self.tp_args(node), "--headless"],
                   roles.role_env("prefill", env))

    def _start_lb(self) -> None:
        routers = [f"{self.host(n).addr}:{roles.ROUTER_PORT}" for n in self.role_hosts("router")]
        cfg = self.spec.workdir / "haproxy.cfg"
        cfg.write_text(roles.haproxy_config(HAPROXY_CFG.read_text(), routers, stats_socket=str(self.lb_socket)))
        self.spawn("lb", ["haproxy", "-db", "-f", str(cfg)], {"PATH": "/usr/sbin:/usr/bin:/bin"})

    @property
    def lb_socket(self) -> Path:
        return self.spec.workdir / "haproxy.sock"

    def lb_servers(self) -> dict[str, str]:
        """Each router's state in the LB (UP, DOWN, ...), from HAProxy's stats socket."""
        import socket
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(5)
                sock.connect(str(self.lb_socket))
                sock.sendall(b"show stat\n")
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
        except OSError:
            return {}
        rows = [line.split(",") for line in data.decode().splitlines() if line and not line.startswith("#")]
        return {r[1]: r[17] for r in rows if len(r) > 17 and r[1].startswith("router-")}

    def stop(self, name: str) -> None:
        """Stop one role's process (SIGTERM, then SIGKILL)."""
        for child in self.procs.children:
            if child.name == name:
                Processes([child]).stop(grace_s=10)

    def close(self) -> None:
        try:
            self.procs.stop(grace_s=5)
        finally:
            self.net.close()

    def log(self, name: str, n: int = 40) -> str:
        child = next((c for c in self.procs.children if c.name == name), None)
        return child.tail(n) if child else ""

    # ---- talking to it ------------------------------------------------------------------------
    @contextlib.contextmanager
    def client(self) -> Iterator[httpx.Client]:
        """An HTTP client on the client host: what it connects to, it reaches over the bridge."""
        with inside(self.host("client").ns), httpx.Client(timeout=60) as http:
            yield http

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin}"}

    def wait_http(self, name: str, path: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            dead = self.procs.dead()
            if dead:
                raise RuntimeError(f"exited while starting: {dead}\n" +
                                   "\n".join(f"--- {d.split()[0]}:\n{self.log(d.split()[0])}" for d in dead))
            try:
                with self.client() as http:
                    if http.get(self.url(name) + path, timeout=2).status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{name} not ready at {path}:\n{self.log(name)}")

    def connections(self) -> list[Conn]:
        """Every TCP connection in every host, as `ss -tanp` lists it there: open ones and, for a minute
        after they closed, those in TIME-WAIT (short-lived KV pulls show up that way)."""
        out = []
        for name, host in list(self.net.hosts.items()):
            for line in host.run(["ss", "-tanpH"]).splitlines():
                parts = line.split()
                if len(parts) >= 5 and parts[0] != "LISTEN":
                    out.append(Conn(name, parts[0], parts[3], parts[4], " ".join(parts[5:])))
        return out

    def edges(self, conns: list[Conn]) -> set[tuple[str, str, int]]:
        """(client host, server host, server port) of each connection between two hosts of the fleet."""
        by_addr = {h.addr: n for n, h in self.net.hosts.items()}
        found = set()
        for c in conns:
            peer_addr, _, peer_port = c.peer.rpartition(":")
            local_port = int(c.local.rpartition(":")[2])
            if peer_addr not in by_addr:
                continue
            if local_port in _SERVER_PORTS:            # the server's end (it may be the one left in TIME-WAIT)
                found.add((by_addr[peer_addr], c.host, local_port))
            else:
                found.add((c.host, by_addr[peer_addr], int(peer_port)))
        return found


_SERVER_PORTS = {roles.PREFILL_PORT, roles.KV_PORT, roles.DECODE_PORT, roles.ROUTER_PORT, roles.STORE_PORT}


class ConnectionSampler:
    """Samples `fleet.connections()` in a thread while traffic runs (short-lived KV pulls too)."""

    def __init__(self, fleet: MultiHostFleet, every_s: float = 0.2) -> None:
        self.fleet, self.every_s = fleet, every_s
        self.seen: list[Conn] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.seen.extend(self.fleet.connections())

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.seen.extend(self.fleet.connections())
            self._stop.wait(self.every_s)
