"""Colocated weight moves through each node's host memory: who writes for which engines, and when it cannot."""

from __future__ import annotations

import pytest

from rlc.runtime.host_moves import SHM_HEADROOM, HostMovesError, plan_host_moves

GIB = 2**30


def _ranks(*nodes: str, free: float = 8.0) -> list[dict]:
    return [{"rank": r, "node_id": n, "shm_free": free * GIB} for r, n in enumerate(nodes)]


def test_each_node_first_rank_writes_for_the_engines_on_its_node() -> None:
    # Two nodes, two trainer ranks and two engines each (what a colocated 2 x 2 plan places).
    moves = plan_host_moves(_ranks("a", "a", "b", "b"), [["a"], ["a"], ["b"], ["b"]], GIB, "t")
    assert moves.readers == {0: [0, 1], 2: [2, 3]}
    assert moves.dirs == {0: "/dev/shm/rlc-t-r0", 2: "/dev/shm/rlc-t-r2"}
    assert moves.folder_for(3) == moves.dirs[2] and moves.folder_for(0) == moves.dirs[0]
    assert "rank 2 → engine(s) 2, 3" in moves.describe()


def test_one_node_is_one_writer() -> None:
    moves = plan_host_moves(_ranks("a", "a"), [["a"]], GIB, "t")
    assert list(moves.dirs) == [0] and moves.readers == {0: [0]}


def test_an_engine_across_nodes_reads_every_node_under_one_folder_name() -> None:
    # Two engines each across nodes a and b (TP over both): every node's writer serves both engines, and one folder
    # name holds on every node, since each worker loads the path it is given from its own node's /dev/shm.
    moves = plan_host_moves(_ranks("a", "a", "b", "b"), [["a", "b"], ["a", "b"]], GIB, "t")
    assert moves.readers == {0: [0, 1], 2: [0, 1]}
    assert moves.dirs == {0: "/dev/shm/rlc-t", 2: "/dev/shm/rlc-t"}
    assert moves.folder_for(1) == "/dev/shm/rlc-t"
    with pytest.raises(HostMovesError, match="rollout engine 0 runs on a node without a trainer rank"):
        plan_host_moves(_ranks("a"), [["a", "b"]], GIB, "t")


def test_an_engine_without_a_trainer_rank_on_its_node_is_an_error() -> None:
    with pytest.raises(HostMovesError, match="rollout engine 1 runs on a node without a trainer rank"):
        plan_host_moves(_ranks("a"), [["a"], ["b"]], GIB, "t")


def test_a_small_dev_shm_is_an_error_with_what_to_do() -> None:
    need = 4 * GIB
    with pytest.raises(HostMovesError) as caught:
        plan_host_moves(_ranks("a", free=need * SHM_HEADROOM / GIB - 0.01), [["a"]], need, "t")
    text = str(caught.value)
    assert "/dev/shm on trainer rank 0's node" in text and "rollout.weight_sync: disk" in text
    # Exactly enough (with the headroom) is fine.
    plan_host_moves(_ranks("a", free=need * SHM_HEADROOM / GIB), [["a"]], need, "t")
