"""How a cluster's nodes are told apart: the custom Ray resource each plan node declares.

launch.sh and the KubeRay RayJob start each node with its resource; the runtime's placement bundles ask for it, so
Ray puts every role on the node the plan gives it.
"""

from __future__ import annotations

__all__ = ["NODE_RESOURCE_PREFIX", "NODE_RESOURCE_UNITS", "node_resource"]

#: On a cluster of several nodes, node k declares `rlc_node_n<k>` (NODE_RESOURCE_UNITS of it) and every placement
#: bundle of the plan's node k asks for one unit, so Ray puts each role on the node the plan gives it.
NODE_RESOURCE_PREFIX = "rlc_node_n"
NODE_RESOURCE_UNITS = 1000


def node_resource(node: int) -> str:
    """The custom Ray resource that marks plan node `node` (`rlc_node_n1`)."""
    return f"{NODE_RESOURCE_PREFIX}{node}"
