"""One rank of the FSDP2 policy trainer: it builds the plan's layout, computes log-probs and takes steps.

A ``TrainerWorker`` is one process (a Ray actor per device). ``TrainerGroup`` creates ``world_size`` of
them and fans calls out; every public method here is collective, so all ranks must be called.

The layout (``schemas/layout.TrainLayout``) decides the device mesh (dp × cp × tp), precision, recompute and
offload (``parallelize``); micro-batches are built by ``micro_batches`` (packed, padded, or this rank's
context-parallel slice), the optimizer by ``optimizer``; weights out, checkpoints and colocated phase moves
are mixins in their own files. After construction ``built_layout()`` reports what was really built and the
peak memory of each phase (``memory_probe``), which ``rlc run`` compares with the plan.

Batches are dicts of per-sequence lists. ``input_ids`` holds full sequences (prompt + response) and
``loss_mask`` marks the response tokens. Per-token arrays (``behaviour_logprobs``, ``proximal_logprobs``,
``ref_logprobs``, ``teacher_logprobs``, ``advantages``) are aligned with ``input_ids``: entry ``t`` is about
token ``t``, i.e. log p(x_t | x_<t); entry 0 is unused. ``advantages`` may also be one number per sequence.
Ranks that differ only in their cp or tp coordinate receive the same share of a batch. An MoE batch may carry
``routed_experts``: per sequence, the experts the rollout engine's routers chose for each token
(``[tokens - 1, decoder layers, top_k]``, or None), which the routers compare with their own choice and, with
``routing_replay: rollout``, replay (`router`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlc.schemas.layout import TrainLayout

from ..algo.policy import PolicyLoss, aggregation_weights
from ..nonfinite import nonfinite_code
from ..packing import padded_micro_batches
from ..platform import Platform, get_platform
from ..rollout.weight_sync import SyncSender, preload_sync_group
from . import lora as lora_lib
from .checkpoints import TrainerCheckpoints
from .expert_parallel import install_expert_kernel
from .linear_attention import install_packed_linear_attention
from .memory_probe import PeakMemory, measured
from .micro_batches import MicroBatch, MicroBatcher
from .optimizer import UnitOptimizer, clip_grad_norm, grad_square_norm, scale_grads
from .packed_forward import LOGPROB_METHOD, attn_implementation_for, install_logprob_forward, pack_rank_sequences
from .parallelize import (
    apply_layout,
    attention_layers,
    build_mesh,
    decoder_layers,
    describe_built,
    sum_partial_grads,
)
from .phases import PhaseMoves
from .pipeline import BODY_METHOD, Pipeline, find_root, split_model
from .router import RoutedTokens, install_routing
from .weights_out import WeightExport

__all__ = ["DEFAULT_TRAIN_CFG", "TrainerWorker", "default_layout"]

DEFAULT_TRAIN_CFG: dict[str, Any] = {
    "lr": 1e-5,
    "weight_decay": 0.0,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "max_grad_norm": 1.0,
    "packing": True,  # token-budget packed micro-batches; False = padded ones under the same token budget
    "micro_batch_size": None,  # padded: at most this many sequences per forward too (benchmarks' fixed sizes)
    "logprob_chunk_tokens": 1024,  # tokens per chunk of the log-prob head (both paths)
    "packing_algorithm": "ffd",  # "ffd" (fewest bins) or "kk" (balanced bins), see runtime/packing.py
    "packed_attention": "varlen",  # "varlen" (per-sequence kernels) or "mask" (O(L²) CPU reference)
    "temperature": 1.0,  # log-probs are of softmax(logits / T), matching the engines' sampling
    "seed": 0,
    "deterministic": False,  # torch.use_deterministic_algorithms(True): the plan's reproducibility switch
    "local_rank": 0,  # device index inside this process's visible devices
    "lora": None,  # the plan's lora block (rank, alpha, dropout, target_modules, rollout): train adapters only
    "weight_sync": None,  # the run's weight path (`weight_push.sync_method`); broadcast: rank 0 sends
    "router_aux_loss_coef": 0.0,  # MoE: the load-balancing loss's coefficient, over the global batch (`router`)
    # MoE: "off", "proximal" (the policy forward reuses the proximal pass's experts) or "rollout" (every forward of a
    # batch with the engine's routing uses its experts, R3); a bool from older plans: True is "proximal".
    "routing_replay": "off",
}

_PER_TOKEN_KEYS = (
    "behaviour_logprobs",
    "proximal_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "distill_weights",
    "advantages",
)


def default_layout(world_size: int, cfg: Mapping[str, Any]) -> TrainLayout:
    """Plain fp32 FSDP2 data parallelism, for trainers built without a plan (tests, benchmarks)."""
    return TrainLayout(
        world_size=world_size,
        micro_batch_tokens=int(cfg.get("micro_batch_tokens", 4096)),
        recompute="full" if cfg.get("gradient_checkpointing") else "none",
    )


class TrainerWorker(WeightExport, TrainerCheckpoints, PhaseMoves):
    """One rank of the policy trainer, holding its shard of the model and of the optimizer state."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str | None,
        master_port: int,
        model_path: str,
        platform: str | Platform = "cpu",
        train_cfg: Mapping[str, Any] | None = None,
        layout: TrainLayout | Mapping[str, Any] | None = None,
    ) -> None:
        """Join the trainer process group, load the HF model, build the layout, make the optimizer."""
        from transformers import AutoModelForCausalLM

        from rlc.runtime.raylet_watch import exit_with_raylet

        exit_with_raylet()  # a rank whose node's Ray is gone must not hold its devices and peers for minutes

        if master_addr is None and world_size != 1:
            raise ValueError(f"rank {rank} of {world_size} needs the group's rendezvous address")
        self.rank, self.world_size = rank, world_size
        self.platform = get_platform(platform)
        self.cfg = {**DEFAULT_TRAIN_CFG, **dict(train_cfg or {})}
        if layout is None:
            layout = default_layout(world_size, self.cfg)
        self.layout = layout if isinstance(layout, TrainLayout) else TrainLayout.model_validate(dict(layout))
        self.memory = PeakMemory(self.platform)  # baseline before anything is loaded
        self.memory.start()
        self.model_path = str(model_path)
        self.device = self.platform.set_device(int(self.cfg["local_rank"]))
        if not dist.is_initialized():
            # A group of one meets only itself: an in-process store, no address (`TrainerGroup` sends none).
            meet: dict[str, Any] = (
                {"store": dist.HashStore()}
                if master_addr is None
                else {"init_method": f"tcp://{master_addr}:{master_port}"}
            )
            dist.init_process_group(
                backend=self.platform.dist_backend,
                rank=rank,
                world_size=world_size,
                device_id=None if self.platform.name == "cpu" else self.device,
                **meet,
            )
        self.mesh = build_mesh(self.layout, self.platform, rank)
        torch.manual_seed(int(self.cfg["seed"]))
        if self.cfg["deterministic"]:
            torch.use_deterministic_algorithms(True)

        self.packing = bool(self.cfg["packing"])
        attn = attn_implementation_for(self.platform, self.packing, self.cfg["packed_attention"], self.layout.cp)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path,
            dtype=getattr(torch, self.layout.precision.param_dtype),
            **({"attn_implementation": attn} if attn else {}),
        )
        model.config.use_cache = False
        # Hybrid models: rlc's packed forward for the Gated-DeltaNet layers, with this platform's kernels.
        install_packed_linear_attention(model, self.platform)
        install_expert_kernel(model, self.platform.name)  # MoE: the platform's expert GEMMs, with or without EP
        for name, param in model.named_parameters():  # a speculative-decoding head stays frozen
            if lora_lib.is_draft_key(name):
                param.requires_grad_(False)
        # PEFT injects the adapters into `model` in place (before sharding, so FSDP2 sees them); the
        # PeftModel wrapper is kept only for disable_adapter() and its config.
        self.lora = dict(self.cfg["lora"]) if self.cfg["lora"] else None
        self.peft = None
        if self.lora:
            # MoE models: adapters on the attention, dense and shared-expert linears; routers and experts frozen.
            self.peft = lora_lib.inject(model, self.lora)
            self.lora_scaling = float(self.lora["alpha"]) / float(self.lora["rank"])
        # MoE routers count expert load, compare passes, replay and add the load-balancing loss (`router`). Installed
        # on the whole model, so every pipeline stage's `Routing` knows every MoE layer, holding some or none.
        self.routing = install_routing(
            model,
            float(self.cfg["router_aux_loss_coef"]),
            self.cfg["routing_replay"],
            self.mesh.shard_group if self.layout.shard_group > 1 else None,
            self.device,
        )
        # Pipeline parallelism: this rank keeps its stage's layers (`pipeline`), before anything shards them.
        self.pipeline: Pipeline | None = None
        if self.layout.pp > 1:
            _check_pipeline_layout(model)
            self.pipeline = split_model(model, self.mesh.pp)
        # The model stays on the host: `apply_layout` moves it to the device shard by shard.
        self._partial_grads = apply_layout(model, self.mesh, self.platform)
        install_logprob_forward(model)  # body + chunked head inside the root FSDP unit
        if self.pipeline is not None:
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(model, BODY_METHOD)  # a stage's layers inside the root FSDP unit
            self.pipeline.root = find_root(model)
            local = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
            self._stage_meta = self.pipeline.merge_across_stages(local)
        self.model = model
        self.pad_id = _pad_id(model.config)
        self._dummy = [self.pad_id, self.pad_id]  # the sequence of a dummy micro-batch
        coords = self.mesh.coords
        self.batcher = MicroBatcher(
            self.platform,
            self.device,
            self.pad_id,
            self.packing,
            self.cfg["packed_attention"],
            cp_group=self.mesh.cp_group if self.layout.cp > 1 else None,
            cp_rank=coords["cp"],
            cp_size=self.layout.cp,
            cp_kind=self.layout.cp_kind,
        )
        self.optimizer = UnitOptimizer(
            _fsdp_units(model),
            lr=float(self.cfg["lr"]),
            betas=tuple(self.cfg["betas"]),  # type: ignore[arg-type]
            eps=float(self.cfg["eps"]),
            weight_decay=float(self.cfg["weight_decay"]),
            device=self.device,
            # With parameter offload the parameters, and so the moments, already live on the host.
            offload=self.layout.offload_optimizer and not self.layout.offload_params,
        )
        self.step = 0
        self._offloaded: set[str] = set()
        self._sender: SyncSender | None = None
        self._sender_key: tuple[str, int, int] | None = None
        self._compute_dtype_seen: torch.dtype | None = None
        self._watch_compute_dtype()
        if self.rank == 0 and self.cfg["weight_sync"] == "broadcast":
            preload_sync_group()  # while the engines start, instead of inside the first step's sync
        self.memory.stop("load")

    # ---------------------------------------------------------------- the layout, as built

    def _watch_compute_dtype(self) -> None:
        """Record the dtype of a projection weight while a forward runs: FSDP2's all-gathered compute copy."""
        proj = attention_layers(self.model)[0].get_submodule("self_attn.o_proj")

        def seen(module: torch.nn.Module, args: Any) -> None:
            weight = module.weight
            self._compute_dtype_seen = (weight.to_local() if hasattr(weight, "to_local") else weight).dtype

        proj.register_forward_pre_hook(seen)

    def built_layout(self) -> dict[str, Any]:
        """What this rank built (read back from the model and mesh) and its measured peak memory per phase."""
        built = describe_built(
            self.model,
            self.mesh,
            self.rank,
            self.layout.cp_kind if self.layout.cp > 1 else None,
            self.optimizer.offload,
            self._compute_dtype_seen,
        )
        return {"built": vars(built), "memory": self.memory.report(), "platform": self.platform.name}

    # ---------------------------------------------------------------- forward

    def _forward_logprobs(
        self,
        mb: MicroBatch,
        with_entropy: bool,
        entropy_grad: bool = False,
        temperature: float | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) aligned with ``mb.local``: the whole row, or this rank's CP slice.

        Log-probs come from the final hidden states ``logprob_chunk_tokens`` tokens at a time, inside the root
        FSDP unit, so full ``[T, V]`` logits are never held.
        """
        lp, ent = getattr(self.model, LOGPROB_METHOD)(
            mb.input_ids,
            mb.body_kwargs,
            float(self.cfg["temperature"] if temperature is None else temperature),
            int(self.cfg["logprob_chunk_tokens"]),
            mb.labels,
            inputs_embeds,
        )
        if mb.packed is not None and mb.cp is None:  # a sequence's first token was "predicted" from the previous
            starts = mb.packed.cu_seqlens[:-1].to(device=lp.device, dtype=torch.long)
            lp, ent = lp.index_fill(1, starts, 0.0), ent.index_fill(1, starts, 0.0)
        if not with_entropy:
            return lp, None
        return lp, ent if entropy_grad and torch.is_grad_enabled() else ent.detach()

    def _micro_batches(self, seqs: Sequence[Sequence[int]]) -> list[list[int]]:
        """This rank's micro-batches as sequence-index lists, padded with empty ones to the group's count.

        Packed: bins of at most ``micro_batch_tokens`` tokens (the layout's budget, before the CP split);
        padded: as many sequences as fit the budget once padded to their longest (`padded_micro_batches`), at most
        ``micro_batch_size`` when set. FSDP2 all-gathers inside every forward, so all ranks
        must run the same number of them; an empty list stands for a dummy micro-batch that contributes nothing.
        """
        if self.packing:
            mine = pack_rank_sequences(
                [len(s) for s in seqs], self.layout.micro_batch_tokens, str(self.cfg["packing_algorithm"])
            )
        else:
            cap = self.cfg.get("micro_batch_size")
            mine = padded_micro_batches(
                [len(s) for s in seqs], self.layout.micro_batch_tokens, int(cap) if cap else None
            )
        count = torch.tensor([len(mine)], dtype=torch.long, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return mine + [[] for _ in range(int(count.item()) - len(mine))]

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _routed_tokens(self, mb: MicroBatch, batch: Mapping[str, Any], idx: Sequence[int]) -> RoutedTokens | None:
        """What the MoE routers need of micro-batch `mb` (sequences `idx` of `batch`; none: a dummy): which tokens
        count, and the engine's experts where the batch carries them (None for a model without routers)."""
        routing = self.routing
        if routing is None:
            return None
        tokens = RoutedTokens(mb.routing_tokens())
        arrays = batch.get("routed_experts")
        if arrays is not None and idx and any(arrays[i] is not None for i in idx):
            tokens.experts, tokens.captured = mb.routed_experts(
                [arrays[i] for i in idx], routing.columns, routing.top_k, routing.num_experts, idx
            )
        return tokens

    @measured("logprobs")
    @torch.no_grad()
    def compute_logprobs(
        self, batch: Mapping[str, Any], adapters: bool = True, temperature: float | None = None
    ) -> list[list[float]]:
        """Log-probs of each sequence's tokens under the current weights (proximal or reference).

        ``adapters=False`` scores with the LoRA adapters disabled, i.e. under the frozen base model: the
        KL reference of a LoRA run costs no extra weights. ``temperature`` overrides the sampling temperature
        (1.0: the raw model distribution, as engines score prompts). Returns one list per sequence, aligned with
        its ``input_ids`` (entry 0 is 0.0).
        """
        if not adapters and self.peft is not None:
            with self.peft.disable_adapter():
                return self._compute_logprobs(batch, temperature)
        return self._compute_logprobs(batch, temperature)

    def _compute_logprobs(
        self, batch: Mapping[str, Any], temperature: float | None = None, proximal_of: int | None = None
    ) -> list[list[float]]:
        """`proximal_of`: this is the proximal pass of minibatch `proximal_of`, whose experts MoE routers record."""
        self.model.eval()
        seqs = batch["input_ids"]
        out: list[list[float]] = [[] for _ in seqs]
        micro = self._micro_batches(seqs)
        built = [self.batcher.build([seqs[i] for i in idx] or [self._dummy]) for idx in micro]  # dummies keep step
        pipe = self.pipeline
        routed = lambda j: self._routed_tokens(built[j], batch, micro[j])  # noqa: E731

        def run(j: int, hidden: torch.Tensor | None) -> torch.Tensor | None:
            """Micro-batch j: its rows (the last or only stage), or the hidden states to pass on (other stages)."""
            mb, result = built[j], None
            if self.routing is not None:
                # Only the proximal and policy passes count (not behaviour, reference or probe scoring); with
                # rollout replay every pass over a batch carrying the engine's routing uses its experts.
                key = (proximal_of, j) if proximal_of is not None else None
                counted = bool(micro[j]) and key is not None
                self.routing.begin(key, record=key is not None, counted=counted, tokens=routed(j))
            if pipe is None or pipe.last:
                lp, _ = self._forward_logprobs(mb, with_entropy=False, temperature=temperature, inputs_embeds=hidden)
                for i, row in zip(micro[j], mb.split(mb.gather_logprobs(lp)), strict=False):
                    out[i] = row.float().cpu().tolist()
            else:
                result = getattr(self.model, BODY_METHOD)(mb.input_ids, mb.body_kwargs, hidden)
            if self.routing is not None:
                self.routing.end()
            return result

        if pipe is None:
            for j in range(len(built)):
                run(j, None)
        else:  # the stages in turn; a stage before the last returns empty rows
            pipe.forward_only(
                len(built), lambda j: self._hidden_shape(built[j]), self._hidden_dtype(), self.device, run
            )
        return out

    # ---------------------------------------------------------------- training

    @measured("train")
    def train_step(
        self, batch: Mapping[str, Any] | Sequence[Mapping[str, Any]], loss_fn_cfg: Mapping[str, Any] | None = None
    ) -> dict[str, float]:
        """One training step on this rank's share of a batch; returns group-wide stats.

        ``batch`` is this rank's share, or a list of its shares of the step's minibatches (the plan's
        `algorithm.minibatches`, split by `TrainerGroup`): one optimizer step each, in order. With more than one
        and the decoupled loss, the proximal log-probs of every minibatch are computed first, under the weights
        the step starts from, so later minibatches are clipped against the policy before the step (AReaL's
        recompute_logprob); with one, the train forward's own log-probs are the proximal ones (no extra pass).
        ``loss_fn_cfg``: ``kind`` ("ppo", default, AReaL's decoupled PPO; or "distill", reverse-KL
        to ``teacher_logprobs``), ``policy`` (a `PolicyLoss`: ratio, clipping, off-policy correction and loss
        aggregation; or its older keys ``clip``, ``behave_imp_weight_cap``, ``clip_higher``,
        ``dual_clip``, ``decoupled``), ``kl_coef`` (penalty to ``ref_logprobs``),
        ``kl_estimator`` (its estimator: "k1", "k2" or "k3", the plan's `algorithm.kl_estimator`),
        ``entropy_coef``, ``distill_coef`` (a "ppo" step then adds ``distill_coef`` × the reverse-KL
        distillation term to ``teacher_logprobs`` on the tokens of sequences whose ``distill_weights``
        is non-zero; on-policy distillation next to the RL loss). The loss aggregates each minibatch's masked
        tokens across the group (``policy.agg``, token mean by default); the returned loss and grad_norm are means
        over minibatches, the other statistics token-weighted over the whole step. A minibatch whose loss or gradient
        norm is not finite on any rank takes no optimizer step (``skipped_steps``, ``nonfinite``: `runtime.nonfinite`).
        """
        cfg = dict(loss_fn_cfg or {})
        minibatches = [batch] if isinstance(batch, Mapping) else list(batch)
        if not minibatches:
            raise ValueError("a train step needs at least one minibatch")
        t0 = time.perf_counter()
        policy = cfg.get("policy")
        decoupled = policy.decoupled if isinstance(policy, PolicyLoss) else bool(cfg.get("decoupled", True))
        recompute = len(minibatches) > 1 and cfg.get("kind", "ppo") == "ppo" and decoupled
        if self.routing is not None:
            self.routing.forget()
        if recompute:  # every minibatch's proximal log-probs under the weights before this step's first update
            with torch.no_grad():
                minibatches = [
                    mb
                    if "proximal_logprobs" in mb
                    else {**mb, "proximal_logprobs": self._compute_logprobs(mb, proximal_of=i)}
                    for i, mb in enumerate(minibatches)
                ]
        self.model.train()
        sums: dict[str, float] = {}
        maxima: dict[str, float] = {}
        norms: list[float] = []
        step_tokens = 0.0
        skipped, first_nonfinite = 0, 0
        for i, share in enumerate(minibatches):
            # The weights have moved after the first update; only proximal log-probs say what they were before.
            before_known = i == 0 or "proximal_logprobs" in share
            tokens, norm, nonfinite = self._optimizer_step(share, cfg, sums, maxima, before_known, minibatch=i)
            step_tokens += tokens
            norms.append(norm)
            if nonfinite:
                skipped += 1
                first_nonfinite = first_nonfinite or nonfinite
        self.step += 1

        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(vec, group=self.mesh.shard_group)
        out = {k: float(v) for k, v in zip(keys, vec.tolist(), strict=True)}
        # (A pipeline stage before the last computed only its layers' router loss; its other results are the last
        # stage's, broadcast below.)
        loss = out.pop("loss", 0.0)
        if self.pipeline is not None:  # the last stage's loss and the earlier stages' load-balancing shares
            loss = self.pipeline.sum_over_stages(loss, self.device)
        result = {"loss": loss / len(minibatches)}
        gap_tokens = out.pop("gap_tokens", 0.0)
        if "behaviour_gap" in out:  # over the tokens whose pre-step log-probs are known
            result["behaviour_gap"] = out.pop("behaviour_gap") / max(gap_tokens, 1.0)
        for k, v in out.items():
            result[k] = v / max(step_tokens, 1.0)
        max_keys = sorted(maxima)
        if max_keys:
            peaks = torch.tensor([maxima[k] for k in max_keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self.mesh.shard_group)
            result.update({k: max(float(v), 0.0) for k, v in zip(max_keys, peaks.tolist(), strict=True)})
        if self.routing is not None:  # every stage's layers together
            result.update(self.routing.take_stats(self.pipeline.group if self.pipeline is not None else None))
            self.routing.forget()  # the proximal experts are this step's only
        if self.pipeline is not None:  # the last stage computed the losses and statistics
            result = self.pipeline.broadcast_from_last(result)
        result.update(
            grad_norm=sum(norms) / len(norms),
            n_tokens=max(step_tokens, 1.0),
            optimizer_steps=float(len(minibatches)),
            # Optimizer steps skipped for a non-finite loss or gradient norm, and the first such quantity's code
            # (`nonfinite.QUANTITIES`); the statistics above include the skipped minibatches' values as they were.
            skipped_steps=float(skipped),
            nonfinite=float(first_nonfinite),
            step=float(self.step),
            lr=self.optimizer.lr,
            time_s=time.perf_counter() - t0,
        )
        return result

    def _optimizer_step(
        self,
        batch: Mapping[str, Any],
        loss_fn_cfg: Mapping[str, Any],
        sums: dict[str, float],
        maxima: dict[str, float],
        before_known: bool = True,
        minibatch: int = 0,
    ) -> tuple[float, float, int]:
        """Forward and backward over one minibatch share, then one optimizer step unless the loss or the gradient
        norm is not finite on any rank. Adds this rank's statistics to ``sums`` (token-weighted) and ``maxima``;
        returns the minibatch's group-wide token count, the gradient norm before clipping and the code of the
        first non-finite quantity (`nonfinite.nonfinite_code`; 0: the step was taken). ``before_known``: the
        log-probs under the step's first weights are at hand (given, or the weights have not moved yet), so the
        engine-trainer gap can be measured."""
        from ..algo import loss as L

        cfg = dict(loss_fn_cfg)
        kind = cfg.pop("kind", "ppo")
        kl_coef = float(cfg.pop("kl_coef", 0.0))
        kl_estimator = cfg.pop("kl_estimator", "k3")
        entropy_coef = float(cfg.pop("entropy_coef", 0.0))
        distill_coef = float(cfg.pop("distill_coef", 0.0))
        policy = PolicyLoss.from_cfg(cfg)
        if cfg:
            raise ValueError(f"unknown loss settings {sorted(cfg)}")
        if policy.needs_sequences and self.layout.cp > 1:
            raise ValueError(
                "a sequence-level ratio or correction needs whole sequences; context parallelism splits them"
            )
        seqs = batch["input_ids"]
        masks = batch["loss_mask"]
        # Statistics and the counts are sums over the dp·cp ranks: TP peers hold the same tokens.
        counts = [sum(1 for m in row[1:] if m) for row in masks]
        lead = self.mesh.coords["cp"] == 0
        local = [float(sum(counts)), float(sum(1 for n in counts if n))] if lead else [0.0, 0.0]
        total = torch.tensor(local, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.mesh.shard_group)
        global_tokens, global_seqs = max(float(total[0].item()), 1.0), max(float(total[1].item()), 1.0)
        # Each sequence's token weight fixes the aggregation's denominators over the whole minibatch, so every split
        # into micro-batches and ranks sums to the same loss (`policy.aggregation_weights`).
        seq_weight = aggregation_weights(counts, policy.agg, global_tokens, global_seqs, policy.agg_norm_tokens)
        # FSDP2 averages gradients over its dp·cp ranks; scaling by their number turns that into a global sum,
        # so the gradient is that of the token mean over every rank's tokens.
        scale = float(self.layout.shard_group)

        self.optimizer.zero_grad()
        own_loss = [0.0]  # this minibatch's loss alone: a running total stays NaN for every later minibatch
        micro = self._micro_batches(seqs)
        built = [self.batcher.build([seqs[i] for i in idx] if idx else [self._dummy]) for idx in micro]
        routed = [self._routed_tokens(mb, batch, idx) for mb, idx in zip(built, micro, strict=True)]
        if self.routing is not None:  # the load-balancing loss's global token count and expert shares
            self.routing.start_minibatch(minibatch, routed, [bool(idx) for idx in micro])  # type: ignore[arg-type]

        def loss_of(j: int, lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
            """Micro-batch j's loss (unscaled) from its log-probs and entropy; adds its statistics."""
            idx, mb = micro[j], built[j]
            real = bool(idx)
            # Entry 0 of each sequence has no prediction; a dummy micro-batch masks everything.
            mask = mb.local([[0.0, *masks[i][1:]] for i in idx] if real else [[0.0] * len(self._dummy)]) > 0
            tok = {k: mb.local(self._per_token(batch, k, idx, mb.seqs)) for k in _PER_TOKEN_KEYS if k in batch}
            weights = mb.local([[seq_weight[i]] * len(seqs[i]) for i in idx] if real else [[0.0] * len(self._dummy)])
            weights = torch.where(mask, weights, torch.zeros_like(weights))
            # Until this step's first update the weights are the proximal policy, so a single minibatch's forward
            # gives the proximal log-probs itself (no second pass over the batch).
            before = tok["proximal_logprobs"] if "proximal_logprobs" in tok else lp.detach()
            if kind == "ppo":
                seq_ids = None
                if policy.needs_sequences:  # 1.. per sequence of this micro-batch, 0 where none (padding)
                    rows = [[float(n + 1)] * len(seqs[i]) for n, i in enumerate(idx)] if real else [[0.0, 0.0]]
                    seq_ids = mb.local(rows).long()
                loss, stats = L.policy_loss(
                    lp, before, tok["behaviour_logprobs"], tok["advantages"], mask, policy, weights, seq_ids, len(idx)
                )
            elif kind == "distill":
                loss, stats = L.reverse_kl_distill(lp, tok["teacher_logprobs"], mask, token_count=global_tokens)
            else:
                raise ValueError(f"unknown loss kind {kind!r}; expected 'ppo' or 'distill'")
            if before_known and "behaviour_logprobs" in tok:  # engine vs trainer under the step's first weights
                gap = torch.where(mask, (before - tok["behaviour_logprobs"]).abs(), torch.zeros_like(lp))
                stats["behaviour_gap"] = gap.sum() / mask.sum().clamp(min=1)
                stats["behaviour_gap_max"] = gap.max() if mask.any() else torch.zeros(())
                sums["gap_tokens"] = sums.get("gap_tokens", 0.0) + float(mask.sum())
            if kind == "ppo" and distill_coef and "teacher_logprobs" in tok:
                routed = mask & (tok["distill_weights"] > 0) if "distill_weights" in tok else mask
                d_loss, d_stats = L.reverse_kl_distill(lp, tok["teacher_logprobs"], routed, token_count=global_tokens)
                loss = loss + distill_coef * d_loss
                stats["distill_reverse_kl"] = d_stats["reverse_kl"] * routed.sum() / mask.sum().clamp(min=1)
            # The KL and entropy terms use the policy term's aggregation (token-mean: the mean over global tokens).
            if kl_coef and "ref_logprobs" in tok:
                kl_tok = L.kl_penalty(lp, tok["ref_logprobs"], kl_estimator)
                loss = loss + kl_coef * (torch.where(mask, kl_tok, torch.zeros_like(kl_tok)) * weights).sum()
                stats["kl_ref"] = L.masked_mean(kl_tok.detach(), mask)
            if entropy_coef:
                loss = loss - entropy_coef * (torch.where(mask, ent, torch.zeros_like(ent)) * weights).sum()
            aux = self.routing.aux_loss() if self.routing is not None else None
            if aux is not None:  # this micro-batch's share of the global batch's load-balancing loss
                loss = loss + aux
            n = float(mask.sum())
            own_loss[0] += float(loss.detach())
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            sums["entropy"] = sums.get("entropy", 0.0) + float((ent.detach() * mask).sum())
            for k, v in stats.items():
                if k == "n_tokens" or not (torch.is_tensor(v) and v.numel() == 1):
                    continue
                if k.endswith("_max"):  # a maximum stays a maximum across micro-batches and ranks
                    maxima[k] = max(maxima.get(k, float("-inf")), float(v) if n > 0 else float("-inf"))
                else:
                    sums[k] = sums.get(k, 0.0) + float(v) * n  # token-weighted across micro-batches/ranks
            return loss

        entropy_grad = bool(entropy_coef)
        if self.pipeline is not None:
            stage_aux = self._pipeline_train(built, micro, routed, loss_of, scale, entropy_grad, minibatch)
            if stage_aux is not None:  # a stage before the last: its layers' load-balancing loss, part of the loss
                own_loss[0] += stage_aux
                sums["loss"] = sums.get("loss", 0.0) + stage_aux
        else:
            for j, idx in enumerate(micro):
                if self.routing is not None:  # compared with (or replaying) the proximal pass of the same micro-batch
                    self.routing.begin((minibatch, j), record=False, counted=bool(idx), tokens=routed[j])
                lp, ent = self._forward_logprobs(built[j], with_entropy=True, entropy_grad=entropy_grad)
                (loss_of(j, lp, ent) * scale).backward()
                if self.routing is not None:
                    self.routing.end()

        sum_partial_grads(self._partial_grads, self.mesh)
        if self.pipeline is not None:
            self.pipeline.sum_root_grads()
            grad_norm = self._pipeline_clip(float(self.cfg["max_grad_norm"]))
        else:
            grad_norm = clip_grad_norm(self._trainable(), float(self.cfg["max_grad_norm"]))
        nonfinite = self._nonfinite(own_loss[0], grad_norm)
        if nonfinite:  # no update: the weights and AdamW's moments and step count stay as they were
            self.optimizer.zero_grad()
        else:
            self.optimizer.step()
        return float(total[0].item()), float(grad_norm), nonfinite

    def _nonfinite(self, loss: float, grad_norm: float) -> int:
        """The first of this minibatch's loss and gradient norm that is not finite on some rank (its code, 0 for
        none), the same on every rank: the ranks' flags are summed over the whole group, since a pipeline's loss
        lives on its last stage and a data-parallel rank's NaN is its own."""
        local = [float(not math.isfinite(loss)), float(not math.isfinite(grad_norm))]
        flags = torch.tensor(local, dtype=torch.float64, device=self.device)
        dist.all_reduce(flags)
        return nonfinite_code([bool(flag) for flag in flags.tolist()])

    # ---------------------------------------------------------------- pipeline parallelism

    def _hidden_shape(self, mb: MicroBatch) -> tuple[int, ...]:
        return (*mb.input_ids.shape, int(self.model.config.hidden_size))

    def _pipeline_train(
        self,
        built: list[MicroBatch],
        micro: list[list[int]],
        routed: list[RoutedTokens | None],
        loss_of: Any,
        scale: float,
        entropy_grad: bool,
        minibatch: int,
    ) -> float | None:
        """Forward and backward of one minibatch's micro-batches through the stages (1F1B): the last stage's loss,
        each stage's share of the router's load-balancing loss. Returns a stage before the last's summed share of
        that loss (None on the last stage, whose share is in its loss, or without one)."""
        pipe = self.pipeline
        assert pipe is not None
        kept: dict[int, Any] = {}  # each micro-batch's routing, for the layers its backward recomputes
        stage_aux: list[float] = []

        def run(j: int, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            mb = built[j]
            if self.routing is not None:  # every stage gets the micro-batch's routing; each reads its own layers'
                self.routing.begin((minibatch, j), record=False, counted=bool(micro[j]), tokens=routed[j])
            extra = None
            if pipe.last:
                lp, ent = self._forward_logprobs(mb, with_entropy=True, entropy_grad=entropy_grad, inputs_embeds=hidden)
                out = loss_of(j, lp, ent) * scale
            else:
                out = getattr(self.model, BODY_METHOD)(mb.input_ids, mb.body_kwargs, hidden)
                aux = self.routing.aux_loss() if self.routing is not None else None
                extra = aux * scale if aux is not None else None
                if aux is not None:
                    stage_aux.append(float(aux.detach()))
            if self.routing is not None:
                kept[j] = self.routing.end(keep=True)
            return out, extra

        def around_backward(j: int, starting: bool) -> None:
            if self.routing is None:
                return
            if starting:
                self.routing.recompute(kept.pop(j) or {})
            else:
                self.routing.end()

        shape = lambda j: self._hidden_shape(built[j])  # noqa: E731
        pipe.one_f_one_b(len(built), shape, self._hidden_dtype(), self.device, run, around_backward)
        return sum(stage_aux) if stage_aux else None

    def _hidden_dtype(self) -> torch.dtype:
        return getattr(torch, self.layout.precision.compute_dtype)

    def _pipeline_clip(self, max_norm: float) -> float:
        """Clip to a global norm: each stage's own layers summed over the stages, the shared root weights once."""
        pipe = self.pipeline
        assert pipe is not None
        root = {id(p) for p in pipe.root}
        own = [p for p in self._trainable() if id(p) not in root]
        own_sq = torch.tensor([grad_square_norm(own)], dtype=torch.float64, device=self.device)
        dist.all_reduce(own_sq, group=pipe.group)
        total = (float(own_sq.item()) + grad_square_norm(pipe.root)) ** 0.5
        if max_norm > 0 and math.isfinite(total) and total > max_norm:  # a non-finite norm skips the step instead
            scale_grads(self._trainable(), max_norm / (total + 1e-6))
        return total

    def _per_token(
        self, batch: Mapping[str, Any], key: str, idx: Sequence[int], seqs: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """Rows of ``batch[key]`` for sequences ``idx``; a per-sequence number is spread over its tokens."""
        if not idx:
            return [[0.0] * len(s) for s in seqs]
        rows = [batch[key][i] for i in idx]
        if not isinstance(rows[0], (list, tuple)):  # one number per sequence (GRPO advantage)
            return [[float(v)] * len(s) for v, s in zip(rows, seqs, strict=True)]
        return rows

    # ---------------------------------------------------------------- host helpers

    def sync_address(self) -> tuple[str, int]:
        """This rank's IP and a port free on its node, for a weight-sync group rank 0 will host."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def host_info(self) -> dict[str, Any]:
        """This rank's Ray node id and the free bytes of its /dev/shm (0 if absent): where weights can go."""
        import shutil
        from pathlib import Path

        import ray

        shm = Path("/dev/shm")
        free = shutil.disk_usage(shm).free if shm.is_dir() else 0
        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "shm_free": free}

    def remove_dir(self, path: str) -> None:
        """Delete a folder on this rank's node (the weights it wrote to /dev/shm)."""
        import shutil

        shutil.rmtree(path, ignore_errors=True)

    def shutdown(self) -> None:
        """Leave every process group."""
        self.close_weight_sync()
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_pipeline_layout(model: torch.nn.Module) -> None:
    """What this trainer's pipeline parallelism is built for (`schemas/layout.pipeline_gaps` says it to the plan)."""
    from .linear_attention import linear_attention_modules

    if linear_attention_modules(model):
        raise ValueError("pipeline parallelism on the fsdp2 backend is built without linear-attention layers")


def _fsdp_units(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters per FSDP unit: each decoder layer, then the root's rest (embeddings, norm, head)."""
    seen: set[int] = set()
    units = []
    for layer in decoder_layers(model):
        params = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        units.append(params)
    units.append([p for p in model.parameters() if p.requires_grad and id(p) not in seen])
    return units


def _pad_id(config: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(config, attr, None)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0
