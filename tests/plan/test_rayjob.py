"""rayjob.yaml: a KubeRay RayJob (ray.io/v1) sized from the plan, checked against the subset of the CRD it uses."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Literal

import pytest
import yaml
from plan_fixtures import A2_SPEC, A3_SPEC, CPU_SPEC, a2_plan, a3_plan, cpu_plan, spec_from
from pydantic import BaseModel, ConfigDict, Field

from rlc.compiler.emit import emit_plan_dir
from rlc.compiler.manifest import read_manifest
from rlc.compiler.node_setup import node_setup
from rlc.compiler.rayjob import PLAN_MOUNT, configmap_key
from rlc.schemas.plan import Plan


class Crd(BaseModel):
    """The RayJob fields rlc emits; extra="forbid" so a misspelt field fails here rather than in the operator."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class EnvVar(Crd):
    name: str
    value: str


class Mount(Crd):
    name: str
    mountPath: str
    readOnly: bool = False


class Port(Crd):
    name: str
    containerPort: int


class Resources(Crd):
    limits: dict[str, str]
    requests: dict[str, str]


class Container(Crd):
    name: str
    image: str
    env: list[EnvVar]
    volumeMounts: list[Mount]
    ports: list[Port]
    resources: Resources | None = None


class KeyPath(Crd):
    key: str
    path: str


class ConfigMapSource(Crd):
    name: str
    items: list[KeyPath]


class EmptyDir(Crd):
    medium: Literal["Memory"]


class Volume(Crd):
    name: str
    configMap: ConfigMapSource | None = None
    emptyDir: EmptyDir | None = None


class PodSpec(Crd):
    containers: list[Container] = Field(min_length=1)
    volumes: list[Volume]


class PodMeta(Crd):
    labels: dict[str, str]


class PodTemplate(Crd):
    metadata: PodMeta
    spec: PodSpec


class HeadGroup(Crd):
    rayStartParams: dict[str, str]
    template: PodTemplate


class WorkerGroup(Crd):
    groupName: str
    replicas: int
    minReplicas: int
    maxReplicas: int
    rayStartParams: dict[str, str]
    template: PodTemplate


class AuthOptions(Crd):
    mode: Literal["token", "disabled"]


class ClusterSpec(Crd):
    authOptions: AuthOptions
    rayVersion: str
    headGroupSpec: HeadGroup
    workerGroupSpecs: list[WorkerGroup]


class JobSpec(Crd):
    entrypoint: str
    metadata: dict[str, str]
    shutdownAfterJobFinishes: bool
    ttlSecondsAfterFinished: int
    submissionMode: Literal["K8sJobMode", "HTTPMode", "SidecarMode"]
    rayClusterSpec: ClusterSpec


class ObjectMeta(Crd):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    annotations: dict[str, str]
    labels: dict[str, str]


class RayJob(Crd):
    apiVersion: Literal["ray.io/v1"]
    kind: Literal["RayJob"]
    metadata: ObjectMeta
    spec: JobSpec


def _emit(tmp_path: Path, plan: Plan, spec_text: str) -> tuple[RayJob, dict, str]:
    out = tmp_path / "plan"
    emit_plan_dir(plan, spec_from(spec_text), out, provenance={})
    text = (out / "rayjob.yaml").read_text()
    manifest = read_manifest(out)
    assert manifest is not None
    return RayJob.model_validate(yaml.safe_load(text)), manifest, text


def _resources_param(value: str) -> dict:
    """What `ray start` receives after KubeRay splices the value into its shell command line."""
    (arg,) = shlex.split(f"--resources={value}")
    return json.loads(arg.removeprefix("--resources="))


def _gpu_plan() -> Plan:
    plan = a2_plan()
    plan.target, plan.target_kind, plan.platform = "h100", "gpu", "cuda"
    return plan


def test_a3_two_nodes(tmp_path: Path) -> None:
    plan = a3_plan()
    job, manifest, text = _emit(tmp_path, plan, A3_SPEC)
    cluster = job.spec.rayClusterSpec
    assert job.metadata.annotations["rlc.dev/plan-hash"] == manifest["plan_hash"]
    assert job.spec.metadata["rlc_plan_hash"] == manifest["plan_hash"]
    assert job.spec.shutdownAfterJobFinishes is True
    assert cluster.authOptions.mode == "token"  # KubeRay makes the token Secret and hands it to every pod
    assert tuple(int(x) for x in cluster.rayVersion.split(".")[:2]) >= (2, 52)  # token auth needs Ray 2.52+
    assert shlex.split(job.spec.entrypoint) == ["rlc", "run", PLAN_MOUNT]
    head_resources = _resources_param(cluster.headGroupSpec.rayStartParams["resources"])
    assert head_resources == {"NPU": 16, "rlc_node_n0": 1000}
    (workers,) = cluster.workerGroupSpecs  # one group per plan node after the head's: n1
    assert workers.groupName == "n1" and workers.replicas == workers.minReplicas == workers.maxReplicas == 1
    assert _resources_param(workers.rayStartParams["resources"]) == {"NPU": 16, "rlc_node_n1": 1000}
    assert 'resources: \'"{\\"NPU\\": 16, \\"rlc_node_n1\\": 1000}"\'' in text  # quoting older operators need
    for template in (cluster.headGroupSpec.template, workers.template):
        (container,) = template.spec.containers
        assert container.resources is not None
        assert container.resources.limits == {"huawei.com/Ascend910": "16"} == container.resources.requests
        env = {e.name: e.value for e in container.env}
        assert env == node_setup(plan).env
        assert env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
        assert any(m.mountPath == PLAN_MOUNT and m.readOnly for m in container.volumeMounts)
        (config,) = [v.configMap for v in template.spec.volumes if v.configMap is not None]
        assert config.name == job.metadata.annotations["rlc.dev/plan-configmap"]
        assert {item.path for item in config.items} == set(manifest["files"]) | {"manifest.json"}
        assert all(item.key == configmap_key(item.path) and "/" not in item.key for item in config.items)


def test_single_node_has_no_workers_and_cpu_has_no_devices(tmp_path: Path) -> None:
    job, _, _ = _emit(tmp_path, cpu_plan(), CPU_SPEC)
    cluster = job.spec.rayClusterSpec
    assert cluster.workerGroupSpecs == []
    assert _resources_param(cluster.headGroupSpec.rayStartParams["resources"]) == {"rlc_device": 2}
    assert cluster.headGroupSpec.template.spec.containers[0].resources is None


def test_gpu_uses_num_gpus(tmp_path: Path) -> None:
    plan = _gpu_plan()
    job, _, _ = _emit(tmp_path, plan, A2_SPEC)
    params = job.spec.rayClusterSpec.headGroupSpec.rayStartParams
    assert params["num-gpus"] == "8" and _resources_param(params["resources"]) == {"rlc_node_n0": 1000}
    container = job.spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0]
    assert container.resources is not None and container.resources.limits == {"nvidia.com/gpu": "8"}


@pytest.mark.parametrize("nodes", [1, 3, 4])
def test_replicas_follow_node_count(tmp_path: Path, nodes: int) -> None:
    job, _, _ = _emit(tmp_path, a2_plan(nodes), A2_SPEC)
    groups = job.spec.rayClusterSpec.workerGroupSpecs
    assert sum(g.replicas for g in groups) == nodes - 1
    # each worker pod declares the plan node it is, so the plan's placement bundles find their node
    declared = [_resources_param(g.rayStartParams["resources"]) for g in groups]
    assert [g.groupName for g in groups] == [f"n{k}" for k in range(1, nodes)]
    assert [next(k for k in d if k.startswith("rlc_node_n")) for d in declared] == [
        f"rlc_node_n{k}" for k in range(1, nodes)
    ]


def test_header_names_the_configmap_command(tmp_path: Path) -> None:
    _, manifest, text = _emit(tmp_path, a3_plan(), A3_SPEC)
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert manifest["plan_hash"] in header[0]
    command = next(line for line in header if "kubectl create configmap" in line)
    words = shlex.split(command.lstrip("# "))
    assert "--from-file=roles__teacher-math.json=roles/teacher-math.json" in words
