"""The embedded Ray stops at once at the end of a run and leaves none of its processes behind."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow


def test_the_embedded_ray_and_every_process_it_started_are_gone() -> None:
    import ray

    from rlc.runtime.local_ray_stop import _family, stop_local_ray
    from rlc.runtime.run_end import stop_left_to_this_process

    with stop_left_to_this_process():  # as the run starts it: its processes ignore a plain SIGTERM
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Probe:
        def ping(self) -> int:
            return 1

    probe = Probe.remote()
    assert ray.get(probe.ping.remote()) == 1
    node = ray._private.worker._global_node
    family = _family([info.process.pid for infos in node.all_processes.values() for info in infos])
    assert len(family) >= 3  # the raylet and GCS at least, and what the raylet started
    stop_local_ray()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 10
    while (left := _family(family)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
