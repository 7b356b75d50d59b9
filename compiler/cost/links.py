"""Communication terms: collective latency and link bandwidth inside a node and across nodes, expert-parallel width."""

from __future__ import annotations

from math import log2

from rlc.schemas.target import TargetProfile

__all__ = [
    "COLLECTIVE_LATENCY_S",
    "EP_WIDTH_BANDWIDTH",
    "NET_HOP_LATENCY_S",
    "ep_width_bandwidth",
]

#: Latency of one small collective (ring start-up), seconds. HCCL small-message all-reduce on A2 measures in
#: the tens of microseconds (research notes §1.3: 18 GB/s bus bandwidth for a 2-NPU all-reduce); NCCL ~10 µs.
#: cpu: measured 0.72 ms, the median gloo all-reduce of 16 KB between two processes on a two-core machine.
COLLECTIVE_LATENCY_S = {"npu": 30e-6, "gpu": 10e-6, "cpu": 720e-6}
#: Latency one scale-out hop adds to a collective whose group spans nodes, seconds. NCCL's own cost model
#: (src/graph/tuning.cc, hwLat[NET][Tree][LL] = 5 µs) prices a tree all-reduce at
#: baseLat + 2 · (intra-node hops · intra latency + log2(nodes) · network latency): a group over n nodes pays
#: 2 · log2(n) network hops on top of its in-node latency. HCCL over RoCE has no published figure; the same RDMA
#: hop is assumed. cpu: 0 (the cpu target is one host).
NET_HOP_LATENCY_S = {"npu": 5e-6, "gpu": 5e-6, "cpu": 0.0}
#: Achieved all-to-all bandwidth of an expert-parallel group that spans n nodes, as a fraction of what a group
#: over two nodes achieves. Each rank's tokens split into smaller messages to more peers as the group widens,
#: so per-message costs and incast take a growing share: DeepEP's published low-latency kernels (deepseek-ai/DeepEP
#: README, H800 with one CX7 400 Gb/s InfiniBand NIC per GPU, 128 tokens, hidden 7168, top-8) reach per-rank RDMA
#: bandwidths, mean of dispatch and combine, of 68.5 GB/s at EP 16 (2 nodes), 50.5 at EP 32, 44.5 at EP 64, 39 at
#: EP 128 and 39.5 at EP 256: the ratios below. A group inside one node uses the intra-node link and no entry; a
#: group between two listed widths takes the wider one's entry, one wider than the table the last. HCCL's
#: all-to-all over RoCE has no published width series; the same shape is assumed.
EP_WIDTH_BANDWIDTH = {2: 1.0, 4: 0.74, 8: 0.65, 16: 0.57, 32: 0.58}


def collective_s(
    target: TargetProfile, num_bytes: float, bandwidth_gbps: float, count: float = 1.0, nodes: int = 1
) -> float:
    """α–β model: count × latency + bytes / (link bandwidth × collective efficiency). The latency of a group that
    spans `nodes` nodes grows by 2 · log2(nodes) scale-out hops (NET_HOP_LATENCY_S, NCCL's tree model)."""
    bw = bandwidth_gbps * 1e9 * target.efficiency.collective_efficiency
    alpha = COLLECTIVE_LATENCY_S[target.kind]
    if nodes > 1:
        alpha += 2 * log2(nodes) * NET_HOP_LATENCY_S[target.kind]
    return count * alpha + num_bytes / bw


def nodes_spanned(group: int, devices_per_node: int) -> int:
    """Nodes a group of consecutive devices spans (groups are placed from node boundaries)."""
    return max(1, -(-group // max(1, devices_per_node)))


def ep_width_bandwidth(nodes: int) -> float:
    """Share of the scale-out all-to-all bandwidth an EP group over `nodes` nodes achieves (EP_WIDTH_BANDWIDTH,
    DeepEP's published width series); 1 for a group inside one node or over two."""
    if nodes <= 2:
        return 1.0
    wider = [k for k in sorted(EP_WIDTH_BANDWIDTH) if k >= nodes]
    return EP_WIDTH_BANDWIDTH[wider[0]] if wider else EP_WIDTH_BANDWIDTH[max(EP_WIDTH_BANDWIDTH)]


def link_gbps(target: TargetProfile, group: int, devices_per_node: int) -> float:
    """Intra-node bandwidth when a group fits in one node, else the scale-out bandwidth."""
    return target.intra_node_bandwidth_gbps if group <= devices_per_node else target.inter_node_bandwidth_gbps
