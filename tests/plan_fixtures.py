"""Small, valid plans and specs built by hand, for the emit/manifest/diff/launcher tests.

They stand in for the planner's output where a test needs exact control over a plan's content (hostile
strings, one changed field); golden tests use real specs through `build_plan` when the planner is present.
"""

from __future__ import annotations

from typing import Any

from rlc.compiler.load import load_spec_text
from rlc.schemas.layout import BF16, TrainLayout
from rlc.schemas.plan import (
    AlgorithmSettings,
    Candidate,
    Cluster,
    DataSettings,
    DistillSettings,
    Estimates,
    LoraSettings,
    Memory,
    ModelSettings,
    NodeDevices,
    OffloadStep,
    Parallel,
    Plan,
    RayPlacement,
    Role,
    Sampling,
    Schedule,
    TeacherSettings,
)
from rlc.schemas.spec import Spec

A2_SPEC = """\
name: qwen3-8b-math
target: a2
cluster: {nodes: 2}
model: {name: qwen3-8b, path: /models/Qwen3-8B}
mode: disaggregated
algorithm: {group_size: 8, batch_prompts: 64, max_staleness: 2, lr: 1.0e-6, steps: 200}
data: {train: /data/math.jsonl}
rollout: {max_prompt_len: 2048, max_response_len: 8192}
"""

A3_SPEC = """\
name: qwen3-8b-mopd-lora
target: a3
cluster: {nodes: 2}
model: {name: qwen3-8b, path: /models/Qwen3-8B}
mode: colocated
algorithm: {group_size: 8, batch_prompts: 32, steps: 100}
data: {train: /data/math_and_code.jsonl, domain_key: domain}
rollout: {max_prompt_len: 2048, max_response_len: 4096, mtp: {num_speculative_tokens: 2, method: ngram}}
lora: {rank: 16, alpha: 32}
train: {offload: {params: true, optimizer: true}}
distill:
  teachers:
    - {name: math, model: {name: qwen3-32b, path: /models/Qwen3-32B-math}, domain: math}
    - {name: code, model: {name: qwen3-32b, path: /models/Qwen3-32B-code}, domain: code}
"""

CPU_SPEC = """\
name: quickstart
target: cpu
model: {name: rlc-tiny}
mode: disaggregated
algorithm: {group_size: 8, batch_prompts: 16, max_staleness: 1, lr: 1.0e-3, steps: 80}
data: {train: arithmetic}
reward: {fn: exact_match}
rollout: {max_prompt_len: 8, max_response_len: 4}
"""


def spec_from(text: str, overrides: list[str] | None = None) -> Spec:
    loaded = load_spec_text(text, "<test>", overrides=overrides)
    assert loaded.spec is not None, loaded.report.diagnostics
    return loaded.spec


def _memory(items: dict[str, float], capacity: float, phase: str = "steady") -> Memory:
    return Memory(items=items, total_gib=round(sum(items.values()), 6), capacity_gib=capacity, phase=phase)


def _ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def _ray(group: str, resource: str, bundles: int, width: float = 1.0, share: float | None = None) -> RayPlacement:
    return RayPlacement(
        placement_group=group,
        bundles=[{resource: width}] * bundles,
        bundle_indices=_ids(bundles),
        actor_resources={resource: width if share is None else share},
    )


def _model(model_id: str, path: str | None, params_b: float = 8.19, build_tiny: bool = False) -> ModelSettings:
    return ModelSettings(
        id=model_id,
        path=path,
        hf_architecture="Qwen3ForCausalLM",
        params_b=params_b,
        vocab_size=151936,
        build_tiny=build_tiny,
    )


def _algorithm(lr: float = 1e-6) -> AlgorithmSettings:
    return AlgorithmSettings(
        name="grpo",
        decoupled_loss=True,
        clip=0.2,
        behave_imp_weight_cap=5.0,
        kl_coef=0.0,
        kl_estimator="k3",
        normalize_std=True,
        lr=lr,
        weight_decay=0.0,
        grad_clip=1.0,
        seed=0,
    )


def _vllm_engine(model: str, tp: int, memory_fraction: float, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "tensor_parallel_size": tp,
        "gpu_memory_utilization": memory_fraction,
        "max_model_len": 10240,
        "dtype": "bfloat16",
        "enable_prefix_caching": True,
        **extra,
    }


def a2_plan(nodes: int = 2, *, model_path: str = "/models/Qwen3-8B", data: str = "/data/math.jsonl") -> Plan:
    """Qwen3-8B GRPO, disaggregated: the trainer on the first half of the devices, vLLM on the rest."""
    per_node = 8
    total = nodes * per_node
    train_devices = total // 2
    rollout_devices = total - train_devices

    def spread(count: int, first_node: int) -> list[NodeDevices]:
        return [NodeDevices(node=first_node + i, local_ids=_ids(per_node)) for i in range(count // per_node)] or [
            NodeDevices(node=first_node, local_ids=_ids(count))
        ]

    weights = round(16.4 / train_devices, 6)
    optimizer = round(65.5 / train_devices, 6)
    actor = Role(
        name="actor",
        kind="train",
        devices=train_devices,
        placement=spread(train_devices, 0),
        parallel=Parallel(dp=train_devices),
        layout=TrainLayout(world_size=train_devices, recompute="full", micro_batch_tokens=16384, precision=BF16),
        ray=_ray("rlc-actor", "NPU", train_devices),
        backend="fsdp2",
        replicas=train_devices,
        memory=_memory(
            {"weights": weights, "grads": weights, "optimizer": optimizer, "activations": 9.5, "logits": 1.2},
            57.96,
            "train",
        ),
        engine={"model": model_path, "fsdp": {"reshard_after_forward": True}, "recompute": "selective", "lr": 1e-6},
        estimates={"train_s": round(96.0 * 8 / train_devices, 6)},
        notes=["fsdp2: dense 8B model fits with selective recompute"],
    )
    rollout = Role(
        name="rollout",
        kind="rollout",
        devices=rollout_devices,
        placement=spread(rollout_devices, train_devices // per_node if nodes > 1 else 0),
        parallel=Parallel(tp=2, dp=rollout_devices // 2),
        ray=_ray("rlc-rollout", "NPU", rollout_devices // 2, 2.0),
        backend="vllm-ascend",
        replicas=rollout_devices // 2,
        memory=_memory({"weights": 8.2, "kv_cache": 40.1, "engine_reserve": 2.0}, 57.96, "rollout"),
        engine=_vllm_engine(model_path, 2, 0.85, max_num_seqs=256),
        estimates={"rollout_s": 120.0},
        env={"VLLM_ASCEND_ENABLE_NZ": "0"},
    )
    return Plan(
        rlc_version="0.1.0",
        name="qwen3-8b-math",
        spec_hash="0" * 64,
        target="a2",
        target_kind="npu",
        platform="npu",
        cluster=Cluster(nodes=nodes, devices_per_node=per_node, total_devices=total, ray_resource="NPU"),
        model=_model("qwen3-8b", model_path),
        roles=[actor, rollout],
        schedule=Schedule(
            mode="disaggregated",
            steps=200,
            batch_prompts=64,
            group_size=8,
            batch_samples=512,
            micro_batch_tokens=16384,
            logprob_chunk_tokens=1024,
            packing=True,
            max_staleness=2,
            rollout_chunk_prompts=8,
            weight_sync="broadcast",
            checkpoint_every=50,
            keep_checkpoints=2,
        ),
        algorithm=_algorithm(),
        sampling=Sampling(max_prompt_len=2048, max_response_len=8192, temperature=1.0, top_p=1.0),
        data=DataSettings(
            train=data,
            builtin=False,
            prompt_key="prompt",
            answer_key="answer",
            domain_key=None,
            digits=1,
            reward="math_exact",
        ),
        run_dir="runs/qwen3-8b-math",
        loggers=["jsonl", "tensorboard"],
        env={"HCCL_CONNECT_TIMEOUT": "1800"},
        estimates=Estimates(
            step_time_s=130.5, rollout_s=120.0, train_s=96.0, weight_sync_s=4.5, tokens_per_s=0.1 + 0.2 + 30000
        ),
        runners_up=[
            Candidate(
                summary="train 4 / rollout 12 (TP 2)",
                tokens_per_s=25000.0,
                step_time_s=150.2,
                verdict="training-bound: 4 devices train too slowly",
            )
        ],
        warnings=["max_staleness 2: samples may lag two policy versions"],
    )


def a3_plan(*, teacher_paths: tuple[str, str] = ("/models/Qwen3-32B-math", "/models/Qwen3-32B-code")) -> Plan:
    """A3, colocated trainer+rollout on node 0, two MOPD teachers on node 1, LoRA, n-gram speculative decoding."""
    node0 = [NodeDevices(node=0, local_ids=_ids(16))]
    actor = Role(
        name="actor",
        kind="train",
        devices=16,
        placement=node0,
        parallel=Parallel(dp=16),
        layout=TrainLayout(world_size=16, micro_batch_tokens=8192, offload_params=True, offload_optimizer=True),
        backend="fsdp2",
        replicas=16,
        memory=_memory({"weights": 1.02, "lora_states": 0.3, "activations": 6.1, "logits": 0.9}, 57.96, "train"),
        engine={"model": "/models/Qwen3-8B", "lora": {"rank": 16, "alpha": 32.0}, "recompute": "none"},
        estimates={"train_s": 20.0},
    )
    rollout = Role(
        name="rollout",
        kind="rollout",
        devices=16,
        placement=node0,
        parallel=Parallel(tp=1, dp=16),
        backend="vllm-ascend",
        replicas=16,
        memory=_memory({"weights": 16.4, "kv_cache": 18.0, "lora_adapter": 0.1}, 57.96, "rollout"),
        engine=_vllm_engine(
            "/models/Qwen3-8B",
            1,
            0.6,
            enable_sleep_mode=True,
            enable_lora=True,
            max_lora_rank=16,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4},
        ),
        estimates={"rollout_s": 60.0},
    )
    teachers = []
    roles = [actor, rollout]
    for i, (name, path) in enumerate(zip(("math", "code"), teacher_paths, strict=True)):
        role = Role(
            name=f"teacher-{name}",
            kind="teacher",
            devices=8,
            placement=[NodeDevices(node=1, local_ids=_ids(8, 8 * i))],
            parallel=Parallel(tp=2, dp=4),
            backend="vllm-ascend",
            replicas=4,
            memory=_memory({"weights": 32.8, "kv_cache": 12.0}, 57.96, "rollout"),
            engine=_vllm_engine(path, 2, 0.8, max_logprobs=20),
            estimates={"score_s": 8.0},
        )
        roles.append(role)
        teachers.append(
            TeacherSettings(
                name=name, role=role.name, model=_model("qwen3-32b", path, params_b=32.8), domain=name, weight=1.0
            )
        )
    return Plan(
        rlc_version="0.1.0",
        name="qwen3-8b-mopd-lora",
        spec_hash="1" * 64,
        target="a3",
        target_kind="npu",
        platform="npu",
        cluster=Cluster(nodes=2, devices_per_node=16, total_devices=32, ray_resource="NPU"),
        model=_model("qwen3-8b", "/models/Qwen3-8B"),
        roles=roles,
        schedule=Schedule(
            mode="colocated",
            steps=100,
            batch_prompts=32,
            group_size=8,
            batch_samples=256,
            micro_batch_tokens=8192,
            logprob_chunk_tokens=1024,
            packing=True,
            max_staleness=0,
            rollout_chunk_prompts=8,
            weight_sync="inplace",
            offload=[
                OffloadStep(phase="before_rollout", action="offload", what="optimizer"),
                OffloadStep(phase="before_rollout", action="wake", what="rollout_weights"),
                OffloadStep(phase="before_train", action="sleep", what="kv_cache"),
                OffloadStep(phase="before_train", action="onload", what="optimizer"),
            ],
            checkpoint_every=50,
            keep_checkpoints=2,
        ),
        algorithm=_algorithm(),
        sampling=Sampling(
            max_prompt_len=2048,
            max_response_len=4096,
            temperature=1.0,
            top_p=1.0,
            speculative={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4},
        ),
        data=DataSettings(
            train="/data/math_and_code.jsonl",
            builtin=False,
            prompt_key="prompt",
            answer_key="answer",
            domain_key="domain",
            digits=1,
            reward="math_exact",
        ),
        lora=LoraSettings(rank=16, alpha=32.0, dropout=0.0, target_modules="all-linear", rollout="adapter"),
        distill=DistillSettings(routing="domain", loss="reverse_kl", coef=1.0, teachers=teachers),
        run_dir="runs/qwen3-8b-mopd-lora",
        loggers=["jsonl", "tensorboard"],
        estimates=Estimates(
            step_time_s=95.0, rollout_s=60.0, train_s=20.0, weight_sync_s=1.0, switch_s=14.0, tokens_per_s=11000.0
        ),
    )


def cpu_plan(
    *,
    model_path: str | None = "runs/quickstart/model",
    data: str = "arithmetic",
    run_dir: str = "runs/quickstart",
    teacher_path: str | None = None,
    build_tiny: bool = True,
) -> Plan:
    """The quickstart: one host, two logical devices (trainer and vLLM), optionally a teacher (for MOPD paths)."""
    builtin = data == "arithmetic"
    train = Role(
        name="actor",
        kind="train",
        devices=1,
        placement=[NodeDevices(node=0, local_ids=[0])],
        parallel=Parallel(),
        layout=TrainLayout(world_size=1, micro_batch_tokens=512),
        ray=_ray("rlc-actor", "rlc_device", 1),
        backend="fsdp2",
        memory=_memory({"weights": 0.01, "optimizer": 0.02, "activations": 0.1}, 3.25, "train"),
        engine={"model": model_path, "dtype": "float32"},
    )
    rollout = Role(
        name="rollout",
        kind="rollout",
        devices=1,
        placement=[NodeDevices(node=0, local_ids=[1])],
        parallel=Parallel(),
        ray=_ray("rlc-rollout", "rlc_device", 1),
        backend="vllm",
        memory=_memory({"weights": 0.01, "kv_cache": 1.0}, 3.25, "rollout"),
        engine=_vllm_engine(model_path or "", 1, 0.5, dtype="float32"),
    )
    distill = None
    if teacher_path is not None:
        distill = DistillSettings(
            routing="mixture",
            loss="reverse_kl",
            coef=1.0,
            teachers=[
                TeacherSettings(
                    name="t", role="rollout", model=_model("rlc-tiny", teacher_path, 0.001), domain=None, weight=1.0
                )
            ],
        )
    return Plan(
        rlc_version="0.1.0",
        name="quickstart",
        spec_hash="2" * 64,
        target="cpu",
        target_kind="cpu",
        platform="cpu",
        cluster=Cluster(nodes=1, devices_per_node=2, total_devices=2, ray_resource="rlc_device"),
        model=_model("rlc-tiny", model_path, 0.001, build_tiny=build_tiny),
        roles=[train, rollout],
        schedule=Schedule(
            mode="disaggregated",
            steps=80,
            batch_prompts=16,
            group_size=8,
            batch_samples=128,
            micro_batch_tokens=512,
            logprob_chunk_tokens=1024,
            packing=True,
            max_staleness=1,
            rollout_chunk_prompts=8,
            weight_sync="broadcast",
            checkpoint_every=20,
            keep_checkpoints=2,
        ),
        algorithm=_algorithm(1e-3),
        sampling=Sampling(max_prompt_len=8, max_response_len=4, temperature=1.0, top_p=1.0),
        data=DataSettings(
            train=data,
            builtin=builtin,
            prompt_key="prompt",
            answer_key="answer",
            domain_key=None,
            digits=1,
            reward="exact_match",
        ),
        distill=distill,
        run_dir=run_dir,
        loggers=["jsonl"],
        estimates=Estimates(step_time_s=0.5, rollout_s=0.3, train_s=0.2, weight_sync_s=0.06, tokens_per_s=2000.0),
    )
