"""One rank of the FSDP2 policy trainer: log-probs, a policy-gradient step, state dicts, checkpoints.

A ``TrainerWorker`` is one process (a Ray actor per device). ``TrainerGroup`` creates ``world_size``
of them and fans calls out; every public method here is collective, so all ranks must be called.

Batches are dicts of per-sequence lists. ``input_ids`` holds full sequences (prompt + response)
and ``loss_mask`` marks the response tokens. Per-token arrays (``behaviour_logprobs``,
``proximal_logprobs``, ``ref_logprobs``, ``teacher_logprobs``, ``advantages``) are aligned with
``input_ids``: entry ``t`` is about token ``t``, i.e. log p(x_t | x_<t); entry 0 is unused.
``advantages`` may also be one number per sequence (GRPO).

With ``packing`` (the plans' default) a rank's sequences are bin-packed into micro-batches of at
most ``micro_batch_tokens`` tokens, each run as one ``[1, L]`` row with per-sequence boundaries
(``packed_forward``); otherwise ``micro_batch_size`` sequences are right-padded into ``[B, W]``.
Both paths compute log-probs ``logprob_chunk_tokens`` at a time from the final hidden states, so
``[T, V]`` logits never materialise, and both hand back the same per-sequence rows.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..packing import PackedBatch, pack_sequences
from ..platform import Platform, get_platform
from ..rollout.weight_sync import SyncSender, TensorMeta, tensor_meta, write_safetensors
from . import lora as lora_lib
from .packed_forward import (
    LOGPROB_METHOD,
    attn_implementation_for,
    install_logprob_forward,
    pack_rank_sequences,
    packed_attention_inputs,
)

__all__ = ["DEFAULT_TRAIN_CFG", "TrainerWorker"]

DEFAULT_TRAIN_CFG: dict[str, Any] = {
    "lr": 1e-5,
    "weight_decay": 0.0,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "max_grad_norm": 1.0,
    "packing": True,  # token-budget packed micro-batches; False = padded batches of micro_batch_size
    "micro_batch_tokens": 4096,  # packed: tokens per micro-batch (the plan's schedule.micro_batch_tokens)
    "micro_batch_size": 8,  # padded: sequences per forward
    "logprob_chunk_tokens": 1024,  # tokens per chunk of the log-prob head (both paths)
    "packing_algorithm": "ffd",  # "ffd" (fewest bins) or "kk" (balanced bins), see runtime/packing.py
    "packed_attention": "varlen",  # "varlen" (per-sequence kernels) or "mask" (O(L²) CPU reference)
    "temperature": 1.0,  # log-probs are of softmax(logits / T), matching the engines' sampling
    "seed": 0,
    "gradient_checkpointing": False,
    "master_dtype": "float32",  # optimizer and master weights
    "param_dtype": None,  # compute dtype under FSDP2 mixed precision; None = master_dtype
    "local_rank": 0,  # device index inside this process's visible devices
    "lora": None,  # the plan's lora block (rank, alpha, dropout, target_modules, rollout): train adapters only
}

_PER_TOKEN_KEYS = (
    "behaviour_logprobs",
    "proximal_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "distill_weights",
    "advantages",
)


@dataclass
class _MicroBatch:
    """One forward's sequences and the model inputs built from them (packed or padded)."""

    seqs: list[list[int]]
    input_ids: torch.Tensor  # [1, L] packed or [B, W] padded
    body_kwargs: dict[str, Any]  # attention inputs for the model body
    packed: PackedBatch | None  # None on the padded path


class TrainerWorker:
    """One FSDP2 rank holding a shard of the policy and of its AdamW state."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        model_path: str,
        platform: str | Platform = "cpu",
        train_cfg: Mapping[str, Any] | None = None,
    ) -> None:
        """Join the trainer process group, load the HF model, shard it, build the optimizer."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        self.rank, self.world_size = rank, world_size
        self.platform = get_platform(platform)
        self.cfg = {**DEFAULT_TRAIN_CFG, **dict(train_cfg or {})}
        self.model_path = str(model_path)
        self.device = self.platform.set_device(int(self.cfg["local_rank"]))
        if not dist.is_initialized():
            dist.init_process_group(
                backend=self.platform.dist_backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=rank,
                world_size=world_size,
                device_id=None if self.platform.name == "cpu" else self.device,
            )
        torch.manual_seed(int(self.cfg["seed"]))

        master = getattr(torch, self.cfg["master_dtype"])
        self.packing = bool(self.cfg["packing"])
        attn = attn_implementation_for(self.platform, self.packing, self.cfg["packed_attention"])
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=master, **({"attn_implementation": attn} if attn else {})
        )
        if self.cfg["gradient_checkpointing"]:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        for name, param in model.named_parameters():  # a speculative-decoding head stays frozen
            if lora_lib.is_draft_key(name):
                param.requires_grad_(False)
        # PEFT injects the adapters into `model` in place (before sharding, so FSDP2 sees them); the
        # PeftModel wrapper is kept only for disable_adapter() and its config.
        self.lora = dict(self.cfg["lora"]) if self.cfg["lora"] else None
        self.peft = None
        if self.lora:
            from peft import get_peft_model

            self.peft = get_peft_model(model, lora_lib.lora_config(self.lora))
            self.lora_scaling = float(self.lora["alpha"]) / float(self.lora["rank"])
        model.to(self.device)
        param_dtype = getattr(torch, self.cfg["param_dtype"]) if self.cfg["param_dtype"] else master
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        # One FSDP unit per decoder layer overlaps each layer's all-gather with the previous compute;
        # the root unit holds embeddings, final norm and (tied) lm_head.
        for layer in _decoder_layers(model):
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        install_logprob_forward(model)  # body + chunked head inside the root FSDP unit
        self.model = model
        self.pad_id = _pad_id(model.config)
        self._dummy = [self.pad_id, self.pad_id]  # the sequence of a dummy micro-batch
        self.optimizer = torch.optim.AdamW(
            self._trainable(),
            lr=float(self.cfg["lr"]),
            betas=tuple(self.cfg["betas"]),
            eps=float(self.cfg["eps"]),
            weight_decay=float(self.cfg["weight_decay"]),
        )
        self.step = 0
        self._offloaded: set[str] = set()
        self._sender: SyncSender | None = None
        self._sender_key: tuple[str, int, int] | None = None

    # ---------------------------------------------------------------- forward

    def _ids_and_attention(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded token ids and the matching attention mask."""
        attn = self._pad(seqs, [[1.0] * len(s) for s in seqs]).long()
        return self._pad(seqs), attn

    def _pad(self, seqs: Sequence[Sequence[int]], rows: Sequence[Sequence[float]] | None = None) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        if rows is None:
            out = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            for i, s in enumerate(seqs):
                out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        else:
            out = torch.zeros((len(seqs), width), dtype=torch.float32)
            for i, r in enumerate(rows):
                out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.float32)
        return out.to(self.device)

    def _micro_batch(self, seqs: Sequence[Sequence[int]]) -> _MicroBatch:
        """The model inputs for one forward: one packed ``[1, L]`` row, or a padded ``[B, W]`` batch."""
        if self.packing:
            packed = pack_sequences(seqs)
            kwargs = packed_attention_inputs(packed, self.platform, self.device, self.cfg["packed_attention"])
            return _MicroBatch([list(s) for s in seqs], packed.input_ids.to(self.device), kwargs, packed)
        ids, attn = self._ids_and_attention(seqs)
        return _MicroBatch([list(s) for s in seqs], ids, {"attention_mask": attn}, None)

    def _to_layout(self, mb: _MicroBatch, rows: Sequence[Sequence[float]]) -> torch.Tensor:
        """Per-sequence per-token rows in the micro-batch's layout (missing entries are 0, as when padding)."""
        if mb.packed is None:
            return self._pad(mb.seqs, rows)
        parts = []
        for r, s in zip(rows, mb.seqs, strict=True):
            t = torch.zeros(len(s), dtype=torch.float32)
            t[: len(r)] = torch.as_tensor(list(r), dtype=torch.float32)
            parts.append(t)
        return mb.packed.pack(parts).to(self.device)

    def _from_layout(self, mb: _MicroBatch, t: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence rows back out of the micro-batch's layout, each as long as its sequence."""
        if mb.packed is None:
            return [t[i, : len(s)] for i, s in enumerate(mb.seqs)]
        return mb.packed.unpack(t)

    def _forward_logprobs(
        self, mb: _MicroBatch, with_entropy: bool, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log p(x_t | x_<t) in ``mb``'s layout (each sequence's first entry is 0), and entropy.

        Log-probs come from the final hidden states ``logprob_chunk_tokens`` tokens at a time, inside
        the root FSDP unit, so full ``[T, V]`` logits are never held.
        """
        lp, ent = getattr(self.model, LOGPROB_METHOD)(
            mb.input_ids, mb.body_kwargs, float(self.cfg["temperature"]), int(self.cfg["logprob_chunk_tokens"])
        )
        if mb.packed is not None:  # a sequence's first token was "predicted" from the previous sequence
            starts = mb.packed.cu_seqlens[:-1].to(device=lp.device, dtype=torch.long)
            lp, ent = lp.index_fill(1, starts, 0.0), ent.index_fill(1, starts, 0.0)
        if not with_entropy:
            return lp, None
        return lp, ent if entropy_grad and torch.is_grad_enabled() else ent.detach()

    def _micro_batches(self, seqs: Sequence[Sequence[int]]) -> list[list[int]]:
        """This rank's micro-batches as sequence-index lists, padded with empty ones to the group's count.

        Packed: bins of at most ``micro_batch_tokens`` tokens; padded: runs of ``micro_batch_size``
        sequences. FSDP2 all-gathers inside every forward, so all ranks must run the same number of
        them; an empty list stands for a dummy micro-batch that contributes nothing.
        """
        n = len(seqs)
        if self.packing:
            mine = pack_rank_sequences(
                [len(s) for s in seqs], int(self.cfg["micro_batch_tokens"]), str(self.cfg["packing_algorithm"])
            )
        else:
            mbs = max(1, int(self.cfg["micro_batch_size"]))
            mine = [list(range(i, min(i + mbs, n))) for i in range(0, n, mbs)]
        count = torch.tensor([len(mine)], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return mine + [[] for _ in range(int(count.item()) - len(mine))]

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def compute_logprobs(self, batch: Mapping[str, Any], adapters: bool = True) -> list[list[float]]:
        """Log-probs of each sequence's tokens under the current weights (proximal or reference).

        ``adapters=False`` scores with the LoRA adapters disabled, i.e. under the frozen base model: the
        KL reference of a LoRA run costs no extra weights. Returns one list per sequence, aligned with
        its ``input_ids`` (entry 0 is 0.0).
        """
        if not adapters and self.peft is not None:
            with self.peft.disable_adapter():
                return self._compute_logprobs(batch)
        return self._compute_logprobs(batch)

    def _compute_logprobs(self, batch: Mapping[str, Any]) -> list[list[float]]:
        self.model.eval()
        seqs = batch["input_ids"]
        out: list[list[float]] = [[] for _ in seqs]
        for idx in self._micro_batches(seqs):
            mb = self._micro_batch([seqs[i] for i in idx] or [self._dummy])  # a dummy keeps collectives in step
            lp, _ = self._forward_logprobs(mb, with_entropy=False)
            for i, row in zip(idx, self._from_layout(mb, lp), strict=False):
                out[i] = row.float().cpu().tolist()
        return out

    # ---------------------------------------------------------------- training

    def train_step(self, batch: Mapping[str, Any], loss_fn_cfg: Mapping[str, Any] | None = None) -> dict[str, float]:
        """One optimizer step on this rank's share of a batch; returns group-wide stats.

        ``loss_fn_cfg``: ``kind`` ("ppo", default, AReaL's decoupled PPO; or "distill", reverse-KL
        to ``teacher_logprobs``), ``clip``, ``behave_imp_weight_cap``, ``clip_higher``,
        ``dual_clip``, ``decoupled``, ``kl_coef`` (k3 penalty to ``ref_logprobs``),
        ``entropy_coef``, ``distill_coef`` (a "ppo" step then adds ``distill_coef`` × the reverse-KL
        distillation term to ``teacher_logprobs`` on the tokens of sequences whose ``distill_weights``
        is non-zero; on-policy distillation next to the RL loss). The loss is a token mean over the whole
        group's masked tokens.
        """
        from ..algo import loss as L

        cfg = dict(loss_fn_cfg or {})
        kind = cfg.pop("kind", "ppo")
        kl_coef = float(cfg.pop("kl_coef", 0.0))
        entropy_coef = float(cfg.pop("entropy_coef", 0.0))
        distill_coef = float(cfg.pop("distill_coef", 0.0))
        t0 = time.perf_counter()
        self.model.train()
        seqs = batch["input_ids"]
        masks = batch["loss_mask"]
        local_tokens = sum(sum(1 for m in row[1:] if m) for row in masks)
        total = torch.tensor([float(local_tokens)])
        dist.all_reduce(total)
        global_tokens = max(float(total.item()), 1.0)
        # FSDP2 averages gradients over ranks; scaling by world size turns that into a global sum,
        # so the gradient is that of the token mean over every rank's tokens.
        scale = float(self.world_size)

        sums: dict[str, float] = {}
        maxima: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for idx in self._micro_batches(seqs):
            real = bool(idx)
            mb = self._micro_batch([seqs[i] for i in idx] if real else [self._dummy])
            # Entry 0 of each sequence has no prediction; a dummy micro-batch masks everything.
            mask = self._to_layout(mb, [[0.0, *masks[i][1:]] for i in idx] if real else [[0.0] * len(self._dummy)]) > 0
            lp, ent = self._forward_logprobs(mb, with_entropy=True, entropy_grad=bool(entropy_coef))
            tok = {
                k: self._to_layout(mb, self._per_token(batch, k, idx, mb.seqs)) for k in _PER_TOKEN_KEYS if k in batch
            }
            if kind == "ppo":
                behaviour = tok["behaviour_logprobs"]
                loss, stats = L.decoupled_ppo_loss(
                    lp,
                    tok.get("proximal_logprobs", behaviour),
                    behaviour,
                    tok["advantages"],
                    mask,
                    token_count=global_tokens,
                    **cfg,
                )
            elif kind == "distill":
                loss, stats = L.reverse_kl_distill(lp, tok["teacher_logprobs"], mask, token_count=global_tokens)
            else:
                raise ValueError(f"unknown loss kind {kind!r}; expected 'ppo' or 'distill'")
            if kind == "ppo" and distill_coef and "teacher_logprobs" in tok:
                routed = mask & (tok["distill_weights"] > 0) if "distill_weights" in tok else mask
                d_loss, d_stats = L.reverse_kl_distill(lp, tok["teacher_logprobs"], routed, token_count=global_tokens)
                loss = loss + distill_coef * d_loss
                stats["distill_reverse_kl"] = d_stats["reverse_kl"] * routed.sum() / mask.sum().clamp(min=1)
            if kl_coef and "ref_logprobs" in tok:
                kl_tok = L.kl_penalty(lp, tok["ref_logprobs"])
                loss = loss + kl_coef * L.masked_mean(kl_tok, mask, global_tokens)
                stats["kl_ref"] = L.masked_mean(kl_tok.detach(), mask)
            if entropy_coef:
                loss = loss - entropy_coef * L.masked_mean(ent, mask, global_tokens)
            (loss * scale).backward()
            n = float(mask.sum())
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            sums["entropy"] = sums.get("entropy", 0.0) + float((ent.detach() * mask).sum())
            for k, v in stats.items():
                if k == "n_tokens" or not (torch.is_tensor(v) and v.numel() == 1):
                    continue
                if k.endswith("_max"):  # a maximum stays a maximum across micro-batches and ranks
                    maxima[k] = max(maxima.get(k, float("-inf")), float(v) if n > 0 else float("-inf"))
                else:
                    sums[k] = sums.get(k, 0.0) + float(v) * n  # token-weighted across micro-batches/ranks

        grad_norm = torch.nn.utils.clip_grad_norm_(self._trainable(), float(self.cfg["max_grad_norm"]))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.step += 1

        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(vec)
        out = {k: float(v) for k, v in zip(keys, vec.tolist(), strict=True)}
        result = {"loss": out.pop("loss")}
        for k, v in out.items():
            result[k] = v / global_tokens
        max_keys = sorted(maxima)
        if max_keys:
            peaks = torch.tensor([maxima[k] for k in max_keys], dtype=torch.float64)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
            result.update({k: max(float(v), 0.0) for k, v in zip(max_keys, peaks.tolist(), strict=True)})
        result.update(
            grad_norm=float(grad_norm),
            n_tokens=global_tokens,
            step=float(self.step),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            time_s=time.perf_counter() - t0,
        )
        return result

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

    def set_lr(self, lr: float) -> None:
        """Set the learning rate (the controller owns the schedule)."""
        for g in self.optimizer.param_groups:
            g["lr"] = float(lr)

    # ---------------------------------------------------------------- weights out

    def weight_meta(self, dtype: str | None = None) -> list[TensorMeta]:
        """Names, global shapes and dtypes of what a sync sends (``sync_state_dict``), without gathering."""
        sd = self.model.state_dict()  # DTensor shapes are global
        meta = [(k, tuple(v.shape), (dtype or str(v.dtype)).removeprefix("torch.")) for k, v in sd.items()]
        if self.lora:
            meta = lora_lib.merged_meta(meta)
        return [m for m in meta if not lora_lib.is_draft_key(m[0])]

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded weights in model names, on CPU, on rank 0 (None elsewhere). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.rank == 0 else None

    def sync_state_dict(self) -> dict[str, torch.Tensor] | None:
        """What engines load, in HF names, on rank 0. Collective.

        LoRA adapters are merged into (copies of) the base weights, and a speculative-decoding head (MTP
        or draft keys) is left out: it stays frozen and the engines keep the one they loaded.
        """
        sd = self.full_state_dict()
        if sd is None:
            return None
        if self.lora:
            sd = lora_lib.merged_state_dict(sd, self.lora_scaling)
        return {k: v for k, v in sd.items() if not lora_lib.is_draft_key(k)}

    def adapter_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The LoRA factors, unsharded, in model names, on rank 0. Collective (gathers only the adapters)."""
        if not self.lora:
            raise RuntimeError("adapter_state_dict without lora")
        out = {}
        for name, param in self.model.named_parameters():
            if ".lora_" in name:
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                out[name] = full.detach().to("cpu")
        return out if self.rank == 0 else None

    def save_adapter(self, out_dir: str) -> str | None:
        """The LoRA adapter in PEFT format (what vLLM's LoRARequest and PeftModel load). Collective."""
        tensors = self.adapter_state_dict()
        if self.rank != 0:
            return None
        config = self.peft.peft_config[lora_lib.ADAPTER_NAME]
        return str(lora_lib.write_adapter(tensors, config, out_dir, self.model_path))

    def save_weights(self, out_dir: str) -> str | None:
        """HF-format folder an engine can load or reload from (weights, config, tokenizer). Collective."""
        sd = self.sync_state_dict()
        if self.rank != 0:
            return None
        out = Path(out_dir)
        path = write_safetensors(sd, out)
        self.model.config.save_pretrained(out)
        _copy_tokenizer(self.model_path, out)
        return str(path)

    def sync_weights_broadcast(
        self, host: str, port: int, world_size: int, meta: Sequence[TensorMeta] | None = None
    ) -> float:
        """Gather the full weights and broadcast them from rank 0 to the engines. Collective.

        Rank 0 joins the stateless sync group on first use (engines join concurrently with
        ``init_sync_group``) and reuses it afterwards. Returns seconds taken.
        """
        t0 = time.perf_counter()
        sd = self.sync_state_dict()
        if self.rank == 0:
            key = (host, int(port), int(world_size))
            if self._sender_key != key:
                self.close_weight_sync()
                self._sender = SyncSender(host, port, world_size, backend=self.platform.dist_backend)
                self._sender_key = key
            self._sender.broadcast(sd, meta if meta is not None else tensor_meta(sd), device=self.device)
        return time.perf_counter() - t0

    def close_weight_sync(self) -> None:
        """Leave the weight-sync group, if this rank joined one."""
        if self._sender is not None:
            self._sender.close()
        self._sender, self._sender_key = None, None

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self, ckpt_dir: str) -> str:
        """Weights as an HF folder (rank 0) and sharded optimizer state (every rank). Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        root = Path(ckpt_dir)
        if self.lora:  # the base never changes: the adapter is the checkpoint (`rlc export --merged` folds it in)
            self.save_adapter(str(root / "adapter"))
        else:
            self.save_weights(str(root / "hf"))
        optim = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.save({"optim": optim}, checkpoint_id=str(root / "optim"))
        if self.rank == 0:
            (root / "trainer_state.json").write_text(json.dumps({"step": self.step}, sort_keys=True))
        dist.barrier()
        return str(root)

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Restore weights, optimizer state and step from ``save_checkpoint``'s folder. Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from ..rollout.weight_sync import iter_safetensors

        root = Path(ckpt_dir)
        if self.lora:
            full, _ = lora_lib.read_adapter(root / "adapter")
        else:
            full = dict(iter_safetensors(root / "hf"))
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        optim = get_optimizer_state_dict(self.model, self.optimizer)
        state = {"optim": optim}
        dcp.load(state, checkpoint_id=str(root / "optim"))
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.step = int(json.loads((root / "trainer_state.json").read_text())["step"])
        return self.step

    # ---------------------------------------------------------------- colocated phases

    def offload(self, what: Sequence[str]) -> float:
        """Move ``params`` / ``grads`` / ``optimizer`` state to host memory; returns seconds taken.

        On cpu everything already lives in host memory, so this is a no-op that returns 0.0.
        """
        if self.platform.name == "cpu":
            return 0.0
        t0 = time.perf_counter()
        self._move(what, torch.device("cpu"))
        self._offloaded |= set(what)
        self.platform.synchronize()
        self.platform.empty_cache()
        return time.perf_counter() - t0

    def onload(self, what: Sequence[str]) -> float:
        """Bring back what ``offload`` moved to host memory; returns seconds taken (0.0 on cpu)."""
        if self.platform.name == "cpu":
            return 0.0
        t0 = time.perf_counter()
        self._move([w for w in what if w in self._offloaded], self.device)
        self._offloaded -= set(what)
        self.platform.synchronize()
        return time.perf_counter() - t0

    def _move(self, what: Sequence[str], device: torch.device) -> None:
        if "grads" in what:
            self.optimizer.zero_grad(set_to_none=True)  # gradients are dead between steps
        if "params" in what:
            self.model.to(device)  # FSDP2 moves the local shards of its DTensor parameters
        if "optimizer" in what:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":
                        state[key] = value.to(device, non_blocking=True)

    # ---------------------------------------------------------------- misc

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

        import ray

        shm = Path("/dev/shm")
        free = shutil.disk_usage(shm).free if shm.is_dir() else 0
        return {"node_id": ray.get_runtime_context().get_node_id(), "shm_free": free}

    def remove_dir(self, path: str) -> None:
        """Delete a folder on this rank's node (the weights it wrote to /dev/shm)."""
        import shutil

        shutil.rmtree(path, ignore_errors=True)

    def shutdown(self) -> None:
        """Leave every process group."""
        self.close_weight_sync()
        if dist.is_initialized():
            dist.destroy_process_group()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}")
    return list(layers)


def _pad_id(config: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(config, attr, None)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


def _copy_tokenizer(src: str, dst: Path) -> None:
    """Copy tokenizer and generation files so ``dst`` is a complete model folder for vLLM."""
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config", "chat_template")):
            shutil.copy2(os.path.join(src, name), dst / name)
