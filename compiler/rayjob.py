"""The KubeRay `RayJob` for a plan (apiVersion ray.io/v1), built as data and dumped with yaml.safe_dump.

Building a dict instead of templating YAML text means no value from the spec can break the document's
quoting. The plan directory reaches the pods through a ConfigMap volume mounted read-only at
`PLAN_MOUNT`; ConfigMap keys cannot contain `/`, so each file is stored under its path with `/` → `__` and
mapped back to its path by the volume's `items`. The header comment prints the `kubectl create configmap`
command that builds it from the plan directory.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import yaml

from rlc.compiler.node_setup import K8S_DEVICE_RESOURCE, RAY_PORTS, NodeSetup
from rlc.schemas.cluster_nodes import NODE_RESOURCE_UNITS, node_resource
from rlc.schemas.plan import Plan

PLAN_MOUNT = "/rlc/plan"
PLAN_VOLUME = "rlc-plan"
#: The container image is cluster-specific; users replace this (e.g. with kustomize `images:`).
IMAGE_PLACEHOLDER = "rlc-runtime:{version}-{kind}"
ANNOTATION_PREFIX = "rlc.dev"
#: The Ray release the runtime image must carry; KubeRay reads it to enable token authentication (Ray >= 2.52).
RAY_VERSION = "2.60.0"


def k8s_name(*parts: str, limit: int = 63) -> str:
    """A DNS-1123 label from `parts`: lower case, [a-z0-9-], at most `limit` characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return name[:limit].rstrip("-") or "rlc"


def configmap_key(path: str) -> str:
    return path.replace("/", "__")


def configmap_name(plan: Plan, plan_hash: str) -> str:
    return k8s_name("rlc-plan", plan.name, plan_hash[:10])


def ray_start_resources(setup: NodeSetup, node: int = 0) -> dict[str, str]:
    """rayStartParams that declare the node's devices explicitly and, on several nodes, which node of the plan
    it is (`rlc_node_n<k>`, what the plan's placement bundles ask for, as launch.sh declares it).

    KubeRay splices the value into a shell command line, so the JSON must arrive double-quoted with its inner
    quotes escaped: resources: '"{\\"NPU\\": 16}"' (kuberay#1984 shows what happens otherwise).
    """
    params = {"num-gpus": str(setup.devices_per_node)} if setup.uses_num_gpus else {}
    resources = {} if setup.uses_num_gpus else {setup.ray_resource: setup.devices_per_node}
    if setup.nodes > 1:
        resources[node_resource(node)] = NODE_RESOURCE_UNITS
    if resources:
        inner = json.dumps(resources, sort_keys=True).replace("\\", "\\\\").replace('"', '\\"')
        params["resources"] = f'"{inner}"'
    return params


def _container(name: str, plan: Plan, setup: NodeSetup, image: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "env": [{"name": key, "value": value} for key, value in setup.env.items()],
        "volumeMounts": [
            {"name": PLAN_VOLUME, "mountPath": PLAN_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    device = K8S_DEVICE_RESOURCE.get(setup.kind)
    if device:
        count = str(setup.devices_per_node)
        container["resources"] = {"limits": {device: count}, "requests": {device: count}}
    ports = [("gcs", RAY_PORTS["port"]), ("dashboard", RAY_PORTS["dashboard-port"])] if name == "ray-head" else []
    ports.append(("metrics", RAY_PORTS["metrics-export-port"]))
    container["ports"] = [{"name": port_name, "containerPort": port} for port_name, port in ports]
    return container


def _pod_template(name: str, plan: Plan, setup: NodeSetup, image: str, files: list[str], cm: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"app.kubernetes.io/managed-by": "rlc", "rlc.dev/plan": k8s_name(plan.name)}},
        "spec": {
            "containers": [_container(name, plan, setup, image)],
            "volumes": [
                {
                    "name": PLAN_VOLUME,
                    "configMap": {
                        "name": cm,
                        "items": [{"key": configmap_key(f), "path": f} for f in sorted(files)],
                    },
                },
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }


def build_rayjob(plan: Plan, setup: NodeSetup, *, plan_hash: str, files: list[str], version: str) -> dict[str, Any]:
    """The RayJob object: one head pod (plan node n0) plus a worker group of one pod for each other node of the
    plan (n1, n2, ...), each holding one node's devices and declaring which node it is.

    `files` are the plan directory's relative paths (manifest included) that the ConfigMap must carry.
    """
    image = IMAGE_PLACEHOLDER.format(version=version, kind=setup.kind)
    cm = configmap_name(plan, plan_hash)
    head_params = {"dashboard-host": "0.0.0.0", "disable-usage-stats": "true", **ray_start_resources(setup, 0)}
    cluster: dict[str, Any] = {
        # KubeRay (>= 1.5.1) creates a random token in a Secret and sets RAY_AUTH_MODE / RAY_AUTH_TOKEN in every
        # pod and in the job submitter, so only holders of that Secret reach the dashboard, job API or GCS.
        "authOptions": {"mode": "token"},
        "rayVersion": RAY_VERSION,
        "headGroupSpec": {
            "rayStartParams": head_params,
            "template": _pod_template("ray-head", plan, setup, image, files, cm),
        },
        "workerGroupSpecs": [],
    }
    for node in range(1, setup.nodes):
        cluster["workerGroupSpecs"].append(
            {
                "groupName": f"n{node}",
                "replicas": 1,
                "minReplicas": 1,
                "maxReplicas": 1,
                "rayStartParams": {"disable-usage-stats": "true", **ray_start_resources(setup, node)},
                "template": _pod_template("ray-worker", plan, setup, image, files, cm),
            }
        )
    annotations = {
        f"{ANNOTATION_PREFIX}/plan-hash": plan_hash,
        f"{ANNOTATION_PREFIX}/rlc-version": version,
        f"{ANNOTATION_PREFIX}/plan-configmap": cm,
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {
            "name": k8s_name("rlc", plan.name),
            "annotations": annotations,
            "labels": {"app.kubernetes.io/managed-by": "rlc"},
        },
        "spec": {
            "entrypoint": shlex.join(["rlc", "run", PLAN_MOUNT]),
            "metadata": {"rlc_plan_hash": plan_hash, "rlc_version": version},
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 3600,
            "submissionMode": "K8sJobMode",
            "rayClusterSpec": cluster,
        },
    }


def configmap_command(plan: Plan, plan_hash: str, files: list[str]) -> str:
    """The kubectl command that turns the plan directory into the ConfigMap the RayJob mounts."""
    args = ["kubectl", "create", "configmap", configmap_name(plan, plan_hash)]
    args += [f"--from-file={configmap_key(f)}={f}" for f in sorted(files)]
    return shlex.join(args)


def render_rayjob(plan: Plan, setup: NodeSetup, *, plan_hash: str, files: list[str], version: str) -> str:
    """rayjob.yaml text: a comment header (how to apply it) and the RayJob, keys sorted."""
    job = build_rayjob(plan, setup, plan_hash=plan_hash, files=files, version=version)
    header = [
        f"# KubeRay RayJob generated by rlc {version} from plan {plan_hash}; do not edit, re-run `rlc compile`.",
        f"# The plan directory is mounted read-only at {PLAN_MOUNT} from a ConfigMap. From the plan directory:",
        f"#   {configmap_command(plan, plan_hash, files)}",
        "#   kubectl apply -f rayjob.yaml",
        f"# A stopped run continues from its newest checkpoint with the entrypoint `rlc run {PLAN_MOUNT} --resume`",
        "# (edit spec.entrypoint, delete the finished RayJob, apply again); the run directory must be on a volume",
        "# every pod mounts at the same path (`rlc run` checks each node before it starts).",
        f"# Replace the image {json.dumps(image_of(job))} with your rlc runtime image "
        f"(torch_npu/vLLM-Ascend matching CANN on npu; Ray {RAY_VERSION}).",
        "# Ray token authentication is on (authOptions, KubeRay >= 1.5.1): the operator keeps the token in a Secret",
        "# and hands it to every pod; `kubectl get secret` shows it for clients outside the cluster.",
    ]
    body = yaml.safe_dump(job, sort_keys=True, default_flow_style=False, allow_unicode=True, width=10_000)
    return "\n".join(header) + "\n" + body


def image_of(job: dict[str, Any]) -> str:
    return job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
