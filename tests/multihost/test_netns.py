"""The namespace hosts themselves: they reach each other only over the bridge, a link set down is a
partition, and `close()` leaves no namespace and no process behind."""
from __future__ import annotations

import socket
import subprocess
import time

import pytest

from kimi_pd.multihost.netns import Network, inside, leftover_namespaces

pytestmark = pytest.mark.timeout(120)


def reaches(net: Network, src: str, listener: socket.socket, timeout_s: float = 1.0) -> bool:
    """A TCP connect from host `src` to `listener` (bound inside another host) succeeds."""
    with inside(net.hosts[src].ns), socket.socket() as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(listener.getsockname())
            return True
        except OSError:
            return False


def test_hosts_meet_on_the_bridge_and_a_link_down_is_a_partition(namespaces):
    with Network() as net:
        net.add_host("a", 2)
        net.add_host("b", 3)
        assert "10.77.0.2/24" in net.hosts["a"].run(["ip", "-4", "addr", "show", "eth0"])
        with inside(net.hosts["b"].ns):
            listener = socket.create_server(("10.77.0.3", 0))
        with listener:
            assert reaches(net, "a", listener, timeout_s=5)
            net.set_link("b", up=False)
            assert not reaches(net, "a", listener), "a link set down is silence: the connect times out"
            net.set_link("b", up=True)
            assert reaches(net, "a", listener, timeout_s=5)


def test_close_kills_what_runs_inside_and_removes_every_namespace(namespaces):
    net = Network()
    try:
        net.add_host("a", 2)
        sleeper = subprocess.Popen(net.hosts["a"].argv(["sleep", "300"]))
        deadline = time.monotonic() + 30
        while str(sleeper.pid) not in net.hosts["a"].pids() and time.monotonic() < deadline:
            time.sleep(0.05)                    # `ip netns exec` has entered the host
    finally:
        net.close()
    assert sleeper.wait(10) != 0, "the process inside the host was killed"
    assert leftover_namespaces(net.prefix) == []


def test_a_thread_inside_a_host_sees_only_that_host(namespaces):
    with Network() as net:
        net.add_host("a", 2)
        with inside(net.hosts["a"].ns), socket.socket() as sock:
            sock.bind(("10.77.0.2", 0))                 # this address exists only inside host a
        with pytest.raises(OSError), socket.socket() as sock:
            sock.bind(("10.77.0.2", 0))
