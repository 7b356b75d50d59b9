"""The trainer group's rendezvous address, found by a Ray task on the node that will host rank 0.

A module of its own, importing neither torch nor anything that does: Ray's worker imports the module a task's
function lives in, and the task's worker stays alive (idle) for the rest of the run. Probed from the trainer
group's module, that import pulled in torch (about 3 CPU-seconds of start-up, on cores the engines and
trainers were starting on).
"""

from __future__ import annotations

__all__ = ["probe_address"]


def probe_address() -> tuple[str, int]:
    """This node's address and a port free on it now (the group's ranks meet there)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port
