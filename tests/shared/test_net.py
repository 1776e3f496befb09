"""Port hand-out: below the kernel's ephemeral range, bind-checked, never given twice (cheap; no servers)."""
from __future__ import annotations

import socket
import subprocess
import sys

from shared.net import PLAN, PortPlan, ephemeral_low, free_port


def test_ports_are_outside_the_ephemeral_range_and_never_given_twice():
    plan = PortPlan()
    firsts = [plan.block(40) for _ in range(20)] + [plan.block() for _ in range(50)]
    given = [p for first in firsts[:20] for p in range(first, first + 40)] + firsts[20:]
    assert len(given) == len(set(given)) == 850
    assert max(given) < ephemeral_low()
    assert min(given) >= plan.low


def test_a_port_held_by_a_listener_is_not_given():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        plan = PortPlan(low=port - 1, high=port + 2)
        for _ in range(5):
            assert plan.block() != port
            plan.given.clear()


def test_free_port_uses_the_plan_and_the_port_can_be_bound():
    port = free_port()
    assert port in PLAN.given and port < ephemeral_low()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernel(tmp_path):
    narrow = tmp_path / "range"
    narrow.write_text("20100\t60999\n")
    assert ephemeral_low(narrow) == 20100
    assert not PortPlan(high=ephemeral_low(narrow) - 1).usable
    assert ephemeral_low(tmp_path / "missing") == 32768


def test_two_processes_planning_at_once_draw_different_ports():
    script = "from shared.net import free_port; print(*[free_port() for _ in range(200)])"
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    ports = [set(map(int, run.communicate(timeout=60)[0].split())) for run in runs]
    assert all(len(each) == 200 for each in ports)
    assert len(ports[0] & ports[1]) <= 20          # independent random picks from ~12k ports: ~3 in common
