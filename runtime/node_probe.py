"""What one node of a cluster sees, asked by a Ray task pinned to it before any role starts.

A module of its own that imports neither torch nor anything that does (as `train/rendezvous.py`): the task's
worker imports it and then idles for the rest of the run.
"""

from __future__ import annotations

import os
import socket
from typing import Any

__all__ = ["interface_of", "probe_node"]

#: ioctl that reads an interface's IPv4 address (Linux).
SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str:
    """The name of this machine's network interface holding `address` (empty when none does, or off Linux)."""
    import fcntl
    import struct

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                raw = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return ""


def gloo_address() -> tuple[str, str]:
    """(the address gloo binds here without GLOO_SOCKET_IFNAME, the host name it resolves): gloo's default
    device takes what the host name resolves to, which on many machines is a loopback address."""
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host), host
    except OSError:
        return "", host


def probe_node(paths: list[str], shared: list[str]) -> dict[str, Any]:
    """This node's address, which of `paths` it lacks, which of `shared` (files just written on the driver's
    node) it cannot see, and how its collective sockets would bind."""
    import ray

    ip = ray.util.get_node_ip_address()
    bound, host = gloo_address()
    return {
        "ip": ip,
        "hostname": host,
        "missing": [p for p in paths if not os.path.exists(p)],
        "unshared": [p for p in shared if not os.path.exists(p)],
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
        "gloo_address": bound,
        "interface": interface_of(ip),
    }
