"""A free TCP port on loopback, for the torch.distributed groups tests start in their own processes."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port nothing listens on now (the OS's pick; a test's group binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
