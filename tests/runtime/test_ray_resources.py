"""A plan for GPU targets names its device resource `GPU`, which Ray takes only as `num_gpus`: every actor and the
embedded Ray get their shares through `ray_options`, and Ray accepts what it returns."""

from __future__ import annotations

import pytest

from rlc.runtime.ray_resources import ray_options


def test_built_in_resources_move_to_their_keywords_and_others_stay() -> None:
    got = ray_options({"num_cpus": 0, "resources": {"GPU": 0.5, "rlc_node_n1": 1.0}, "name": "x"})
    assert got == {"num_cpus": 0, "num_gpus": 0.5, "resources": {"rlc_node_n1": 1.0}, "name": "x"}
    assert ray_options({"resources": {"NPU": 16.0}}) == {"resources": {"NPU": 16.0}}
    assert ray_options({"num_cpus": 1, "resources": {"CPU": 2.0}}) == {"num_cpus": 2.0}
    assert ray_options({"num_cpus": 1}) == {"num_cpus": 1}


def test_ray_accepts_a_gpu_share_only_through_ray_options() -> None:
    import ray

    class Actor:
        pass

    with pytest.raises(ValueError, match="num_gpus"):
        ray.remote(Actor).options(resources={"GPU": 1.0})
    ray.remote(Actor).options(**ray_options({"resources": {"GPU": 1.0}}))  # no error: options are only checked
