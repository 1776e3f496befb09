"""Which network interface gloo uses: the one that reaches the rendezvous host.

gloo picks its interface from the machine's hostname unless $GLOO_SOCKET_IFNAME names one; across
hosts that can be an address the other ranks cannot reach (or loopback). Resolving it from the
route to `master_addr` makes `--master-addr` the only setting a multi-host TP worker needs.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name` (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def source_address(peer: str) -> str | None:
    """The local address this host uses to reach `peer` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer, 9))
        except OSError:
            return None
        return str(sock.getsockname()[0])


def interface_towards(peer: str) -> str | None:
    """The name of the interface that carries traffic to `peer`; None for loopback or no route."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(peer).is_loopback:
            return None
    local = source_address(socket.gethostbyname(peer))
    if local is None or ipaddress.ip_address(local).is_loopback:
        return None
    for _, name in socket.if_nameindex():
        if interface_address(name) == local:
            return name
    return None


def pin_gloo_interface(master_addr: str) -> None:
    """Set $GLOO_SOCKET_IFNAME to the interface towards `master_addr` unless it is set already."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_towards(master_addr)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
