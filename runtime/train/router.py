"""The MoE router in RL: expert load, routing drift between passes, routing replay and the load-balancing loss.

Every MoE layer's router is given rlc's forward (`install_routing`), the same computation as transformers' (Qwen's:
softmax over experts in fp32, top-k, renormalised when the model says so; DeepSeek-V3's: sigmoid scores, a
per-expert bias that steers the choice only, top-k within the best expert groups, weights renormalised and scaled)
with one difference: the experts it picks pass through a `Routing` object shared by the layers, which

* counts tokens per expert (`moe/expert_load_max` is the busiest expert's share over an even share, worst layer);
* records the experts each micro-batch of the proximal pass chose and, in the policy forward of the same
  micro-batch, measures the share of tokens whose expert set changed (`moe/routing_changed`). One large
  optimizer step moved about 40% of a tiny model's tokens to other experts, so the policy's log-probs can come
  from other experts than the proximal ones the decoupled loss compares them with;
* with replay on, makes the policy forward use the proximal pass's experts (trainer-side routing replay: the
  router weights still get gradients through the replayed experts' probabilities);
* with a load-balancing coefficient, adds Switch Transformer's loss (Fedus et al. 2021): E · Σ_i f_i · P_i, f_i the
  share of routed slots that went to expert i and P_i the mean router probability of expert i, both over every
  data- and context-parallel rank's tokens of the micro-batch (the counts are all-reduced, P_i is each rank's sum
  over the global token count, and the trainer's gradient reduction sums the ranks), not per rank, which differs
  (2.46 vs 2.34 measured on the same tokens). For DeepSeek's sigmoid router P_i is the mean of each token's
  scores normalised to sum to one, as in DeepSeek-V3's complementary balance loss (there per sequence).

The trainer brackets each micro-batch with `Routing.begin` and `Routing.end`; a layer run twice in between
(activation recompute in backward) reuses its first routing and adds nothing, and a forward outside them routes
as transformers does.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["Routing", "install_routing", "router_modules"]


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Top-k routers of an MoE model (transformers' ``*TopKRouter``: ``top_k``, ``num_experts``, ``weight``)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]


@dataclass
class _Totals:
    """What the routers saw since the last `Routing.take_stats`."""

    load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> routed slots per expert
    changed: float = 0.0  # tokens whose expert set differs from the proximal pass's
    compared: float = 0.0  # tokens compared with the proximal pass
    aux: float = 0.0  # load-balancing loss summed over micro-batches (before its coefficient)
    aux_terms: int = 0


class Routing:
    """Shared by every router of one model: the current micro-batch, the proximal pass's experts, the statistics."""

    def __init__(
        self,
        num_experts: int,
        layers: int,
        aux_loss_coef: float,
        replay: bool,
        group: Any = None,
        device: torch.device | None = None,
    ) -> None:
        """`layers`: MoE layers of the model; `group`: the data- and context-parallel ranks (None: one rank);
        `device`: where the statistics' reductions run (the trainer's device: nccl/hccl reduce device tensors)."""
        self.num_experts, self.layers, self.aux_loss_coef, self.replay = num_experts, layers, aux_loss_coef, replay
        self.group = group
        self.device = device or torch.device("cpu")
        self.ranks = dist.get_world_size(group) if group is not None else 1
        self._active = False
        self._key: Any = None
        self._record = False
        self._counted = True
        self._proximal: dict[Any, dict[int, torch.Tensor]] = {}
        self._seen: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, bool]] = {}
        self._aux: list[torch.Tensor] = []
        self._totals = _Totals()

    # ------------------------------------------------------------- the trainer's side

    def begin(self, key: Any, record: bool, counted: bool = True) -> None:
        """A micro-batch starts: `key` names it across passes (None: not compared); `record`: this is the proximal
        pass, keep its experts; `counted`: False for a dummy micro-batch (it only keeps collectives in step)."""
        self._active, self._key, self._record, self._counted = True, key, record, counted
        self._seen = {}
        self._aux = []

    def end(self, keep: bool = False) -> dict[int, Any] | None:
        """The micro-batch is done: routers pass their own choice through until `begin`. `keep`: its backward comes
        later (a pipeline stage runs other forwards in between); returns its routing for `recompute`."""
        seen = self._seen
        self._active = False
        self._seen = {}
        self._aux = []
        return seen if keep else None

    def recompute(self, seen: dict[int, Any]) -> None:
        """The backward of a micro-batch `end(keep=True)` closed: a layer recomputed in it (activation recompute)
        routes as its forward did, and adds nothing. Close with `end()`."""
        self._active, self._key, self._record, self._counted = True, None, False, False
        self._seen = seen
        self._aux = []

    def forget(self) -> None:
        """Drop the recorded proximal experts (a new training step)."""
        self._proximal = {}

    def aux_loss(self) -> torch.Tensor | None:
        """This micro-batch's load-balancing loss times its coefficient (None when off or nothing routed)."""
        if not self._aux:
            return None
        return self.aux_loss_coef * torch.stack(self._aux).sum()

    def take_stats(self) -> dict[str, float]:
        """Group-wide routing statistics since the last call (collective: every rank calls it).

        ``moe/expert_load_max``: the busiest expert's routed slots over an even share, worst layer;
        ``moe/routing_changed``: share of tokens whose expert set in the policy forward differs from the proximal
        pass's (present when passes were compared); ``moe/aux_loss``: the load-balancing loss, mean per layer and
        micro-batch (present when on).
        """
        totals, self._totals = self._totals, _Totals()
        zero = torch.zeros(self.num_experts, dtype=torch.float64, device=self.device)
        loads = torch.stack([totals.load.get(k, zero).to(self.device) for k in range(self.layers)])
        extra = torch.tensor(
            [totals.changed, totals.compared, totals.aux, float(totals.aux_terms)],
            dtype=torch.float64,
            device=self.device,
        )
        both = torch.cat([loads.reshape(-1), extra])
        if self.group is not None:
            dist.all_reduce(both, group=self.group)
        loads = both[: loads.numel()].view_as(loads)
        changed, compared, aux, terms = both[loads.numel() :].tolist()
        mean = loads.sum(-1, keepdim=True).clamp(min=1) / self.num_experts
        stats = {"moe/expert_load_max": float((loads / mean).max())}
        if compared:
            stats["moe/routing_changed"] = changed / compared
        if terms:  # each rank's term holds its share of the global loss; every rank counted the same terms
            stats["moe/aux_loss"] = aux / (terms / self.ranks)
        return stats

    # ------------------------------------------------------------- the routers' side

    def route(self, layer: int, indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The experts layer `layer` uses for this micro-batch's tokens (`indices` are its own choice)."""
        if not self._active:  # a forward outside the trainer's passes (generation, a test): nothing to do
            return indices
        if layer in self._seen:  # recomputed in backward: the first run's experts and autograd ops
            indices, balance, counted = self._seen[layer]
            if balance is not None and torch.is_grad_enabled():
                self._balance_term(*balance, probs if counted else probs[:0])
            return indices
        real = indices if self._counted else indices[:0]
        counts = torch.bincount(real.reshape(-1), minlength=self.num_experts).to(torch.float64)
        load = self._totals.load.get(layer)
        self._totals.load[layer] = counts if load is None else load + counts
        recorded = self._proximal.get(self._key, {}) if self._key is not None else {}
        if self._record and self._key is not None:
            self._proximal.setdefault(self._key, {})[layer] = indices.detach()
        elif layer in recorded and recorded[layer].shape == indices.shape:
            before = recorded[layer]
            if self._counted:
                differs = (before.sort(-1).values != indices.sort(-1).values).any(-1)
                self._totals.changed += float(differs.sum())
                self._totals.compared += float(differs.numel())
            if self.replay:
                indices = before
        balance = None
        if self.aux_loss_coef and torch.is_grad_enabled():
            balance = self._global_shares(counts, probs.shape[0] if self._counted else 0)
            term = self._balance_term(*balance, probs if self._counted else probs[:0])
            self._aux.append(term)
            self._totals.aux += float(term.detach())
            self._totals.aux_terms += 1
        self._seen[layer] = (indices, balance, self._counted)
        return indices

    def _global_shares(self, counts: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(f_i, the token count) over every rank's tokens of this micro-batch: one all-reduce, no gradient."""
        both = torch.cat([counts, torch.tensor([float(tokens)], dtype=torch.float64, device=counts.device)])
        if self.group is not None:
            dist.all_reduce(both, group=self.group)
        slots = both[:-1]
        return slots / slots.sum().clamp(min=1), both[-1].clamp(min=1)

    def _balance_term(self, share: torch.Tensor, total: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """E · Σ f_i P_i with this rank's P_i share (see the module docstring); the only ops with a gradient, so a
        recomputed layer repeats exactly these."""
        return self.num_experts * (share.to(probs.dtype) * probs.sum(0) / total.to(probs.dtype)).sum()


def _router_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' top-k router (fp32 softmax, top-k, optional renormalisation) through `Routing.route`."""
    hidden_states = hidden_states.reshape(-1, self.weight.shape[-1])
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    _, chosen = torch.topk(probs, self.top_k, dim=-1)
    indices = self._rlc_routing.route(self._rlc_layer, chosen, probs)
    weights = probs.gather(-1, indices)
    if self._rlc_renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), indices


def _grouped_sigmoid_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V3's router op for op (`DeepseekV3TopkRouter.forward`) through `Routing.route`: sigmoid scores; the
    expert bias (`e_score_correction_bias`) added for the choice only; the `topk_group` groups with the best two-
    expert sums kept; top-k among their experts; the chosen scores renormalised and scaled."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias
    per_group = self.num_experts // self.num_group
    group_scores = choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, best_groups, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    chosen = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    indices = self._rlc_routing.route(self._rlc_layer, chosen, scores / scores.sum(-1, keepdim=True))
    weights = scores.gather(1, indices)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, indices


def _grouped_sigmoid(router: torch.nn.Module) -> bool:
    """A DeepSeek-V3 router (sigmoid scores, expert bias, group-limited top-k) rather than a softmax top-k one."""
    return all(hasattr(router, a) for a in ("e_score_correction_bias", "num_group", "topk_group"))


@torch.no_grad()
def _check_same_routing(router: torch.nn.Module, original: Any) -> None:
    """Refuse a router whose transformers forward rlc's does not reproduce on a probe: a router class rlc was not
    built for would otherwise route every token differently, silently."""
    weight = router.weight
    probe = torch.randn(16, weight.shape[-1], generator=torch.Generator().manual_seed(1)).to(weight)
    theirs, ours = original(probe), router.forward(probe)
    same = all(torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6) for a, b in zip(theirs, ours, strict=True))
    if not same:
        raise RuntimeError(
            f"rlc's routing does not reproduce transformers' {type(router).__name__}; this router is not built"
        )


@torch.no_grad()
def _renormalises(router: torch.nn.Module) -> bool:
    """Whether transformers' own forward of `router` renormalises its top-k weights: some router classes read the
    config's `norm_topk_prob`, others (Qwen3.5-MoE's) always do, so the class's own forward is asked once."""
    weight = router.weight
    probe = torch.randn(4, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
    _, weights, _ = router.forward(probe)
    return bool(torch.allclose(weights.float().sum(-1), torch.ones(4), atol=1e-3))


def install_routing(
    model: torch.nn.Module, aux_loss_coef: float, replay: bool, group: Any, device: torch.device | None = None
) -> Routing | None:
    """Give every router of `model` rlc's forward through one `Routing`; None for a model without routers. Call
    before the model is sharded (each router's own forward is run once)."""
    routers = router_modules(model)
    if not routers:
        return None
    routing = Routing(int(routers[0].num_experts), len(routers), aux_loss_coef, replay, group, device)
    for layer, router in enumerate(routers):
        original = router.forward
        grouped = _grouped_sigmoid(router)
        if not grouped:
            router._rlc_renormalise = _renormalises(router)
        router._rlc_routing, router._rlc_layer = routing, layer
        router.forward = types.MethodType(_grouped_sigmoid_forward if grouped else _router_forward, router)
        _check_same_routing(router, original)
    return routing
