"""Helpers for the torch.distributed ranks tests start in processes of their own: a free loopback port for the
group, and a clean leave at the end."""

from __future__ import annotations

import socket

__all__ = ["free_port", "leave_together"]


def free_port() -> int:
    """A port nothing listens on now (the OS's pick; a test's group binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_together(worker: object) -> None:
    """Every rank reaches the end before any closes its connections: gloo aborts a process whose peer hangs up
    while it still exchanges (the product's trainers are ended by Ray instead)."""
    import torch.distributed as dist

    dist.barrier()
    worker.shutdown()  # type: ignore[attr-defined]
