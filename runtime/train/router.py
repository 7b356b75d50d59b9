"""The MoE router in RL: expert load, routing drift, routing replay (trainer-side and from the rollout engine) and the
load-balancing loss over the step's global batch.

Every MoE layer's router is given rlc's forward (`install_routing`), the same computation as transformers' (Qwen's:
softmax over experts in fp32, top-k, renormalised when the model says so; DeepSeek-V3's: sigmoid scores, a
per-expert bias that steers the choice only, top-k within the best expert groups, weights renormalised and scaled)
with one difference: the experts it picks pass through a `Routing` object shared by the layers, which

* counts tokens per expert (`moe/expert_load_max` is the busiest expert's share over an even share, worst layer);
* records the experts each micro-batch of the proximal pass chose and, in the policy forward of the same
  micro-batch, measures the share of tokens whose expert set changed (`moe/routing_changed`). One large
  optimizer step moved about 40% of a tiny model's tokens to other experts, so the policy's log-probs can come
  from other experts than the proximal ones the decoupled loss compares them with;
* compares, in the policy forward, the trainer's own choice with the experts the rollout engine chose for the same
  tokens (the batch's ``routed_experts``), before any replay: ``moe/rollout_routing_agreement`` is the share of
  (token, MoE layer) pairs with captured engine routing whose expert sets are equal (in a layer after a replayed
  one, the trainer chooses on the hidden states the replay produced, as the engine did);
* replays (`REPLAY_MODES`): ``proximal`` makes the policy forward use the proximal pass's experts (trainer-side
  replay); ``rollout`` (R3, arXiv 2510.11370) makes every forward of a batch that carries the engine's routing use
  the engine's experts for each captured token (the proximal pass, the policy forward, and reference or behaviour
  scoring of such a batch), the trainer's own elsewhere. Either way the gate weights are the trainer's router
  probabilities of the used experts, renormalised as the router does, so the router still gets gradients;
* with a load-balancing coefficient adds, per MoE layer, E · Σ_i f_i · P_i averaged over the MoE layers, with f_i
  the share of the tokens routed to expert i (summing to top-k) and P_i the mean router probability of expert i,
  both over the step's global batch: every micro-batch of the minibatch being optimised on every data- and
  context-parallel rank (Qwen's global-batch balancing). That is transformers' `load_balancing_loss_func` of one
  layer, so `router_aux_loss_coef` means what it means in transformers' configs, except that transformers pools
  every layer's counts and probabilities into one product where this averages the per-layer products (equal with
  one MoE layer, both top-k when balanced). For DeepSeek's sigmoid router P_i is the mean of each token's scores
  normalised to sum to one, as in DeepSeek-V3's complementary balance loss (there per sequence).

The tokens counted are the micro-batch's real ones less each sequence's last token: nothing reads that token's
output and no engine routed it. f_i carries no gradient, so it is fixed before the first backward
(`Routing.start_minibatch`), from the first of:

1. the proximal pass's experts when one ran over the minibatch: exact with ``proximal`` replay and for the first
   minibatch (same weights); for later minibatches without it, the routing of the weights the step started from;
2. with ``rollout`` replay, the engine's experts of the captured tokens (exactly what the forwards use) plus, for
   tokens without captured routing, the trainer's own choice in the micro-batches run so far, scaled up to the
   number of such tokens;
3. otherwise the trainer's own choice in the micro-batches run so far (exact with one micro-batch per rank; with
   more, the first micro-batches see an estimate, as Megatron's global load-balancing loss does).

P_i's share of each micro-batch is its probability sum over the global token count, so the trainer's gradient
accumulation and reduction sum to the gradient of the global batch's loss.

The trainer brackets each micro-batch with `Routing.begin` and `Routing.end`; a layer run twice in between
(activation recompute in backward) reuses its first routing and adds nothing, and a forward outside them routes
as transformers does.
"""

from __future__ import annotations

import re
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["REPLAY_MODES", "RoutedTokens", "Routing", "install_routing", "replay_mode", "router_modules"]

#: `train.routing_replay`: nothing, the proximal pass's experts, or the rollout engine's (R3).
REPLAY_MODES = ("off", "proximal", "rollout")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def replay_mode(value: Any) -> str:
    """The trainer's `routing_replay` setting as one of `REPLAY_MODES`; older plans carry a bool (True: proximal)."""
    if value is None or isinstance(value, bool):
        return "proximal" if value else "off"
    if value not in REPLAY_MODES:
        raise ValueError(f"routing_replay {value!r}; expected one of {', '.join(REPLAY_MODES)}")
    return str(value)


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Top-k routers of an MoE model (transformers' ``*TopKRouter``: ``top_k``, ``num_experts``, ``weight``)."""
    return [m for _, m in _named_routers(model)]


def _named_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]


@dataclass
class RoutedTokens:
    """One micro-batch's tokens in the order its routers see them (`MicroBatch.routing_tokens`)."""

    counted: torch.Tensor  # [n] bool: tokens the statistics and the load-balancing loss count
    experts: torch.Tensor | None = None  # [n, decoder layers, top_k] long: the engine's experts
    captured: torch.Tensor | None = None  # [n, decoder layers] bool: where `experts` holds captured routing

    def to(self, device: torch.device) -> RoutedTokens:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return RoutedTokens(self.counted.to(device, non_blocking=True), move(self.experts), move(self.captured))


@dataclass
class _Balance:
    """One minibatch's load-balancing inputs known before its forwards (all group-wide)."""

    tokens: float | None  # tokens counted (None: this micro-batch's, as its routers count them)
    known: torch.Tensor  # [layers, E] routed slots known in advance
    rest: list[float]  # per layer: tokens whose slots are not known in advance
    seen: torch.Tensor  # [layers, E] routed slots of such tokens in the micro-batches run so far
    seen_tokens: torch.Tensor  # [layers] those tokens (device tensors: no host sync per layer)
    use_captured: bool  # the known slots are the engine's captured tokens (the rest: the others)


# Order of the summed statistics (`Routing._sums`).
_CHANGED, _COMPARED, _AGREE, _PAIRS, _AUX = range(5)


class Routing:
    """Shared by every router of one model: the current micro-batch, the proximal pass's experts, the statistics."""

    def __init__(
        self,
        num_experts: int,
        layers: int,
        aux_loss_coef: float,
        replay: bool | str,
        group: Any = None,
        device: torch.device | None = None,
        *,
        decoder: Sequence[int | None] | None = None,
        columns: int | None = None,
        top_k: int = 0,
    ) -> None:
        """`layers`: the MoE layers (routers) of the whole model (a pipeline stage runs some of them); `decoder`: each
        one's decoder layer index, the column of the engine's routing it reads (default 0..layers-1); `columns`: the
        model's decoder layers (the routing arrays' second axis); `group`: the data- and context-parallel ranks
        (None: one rank); `device`: where the statistics' reductions run (the trainer's device: nccl/hccl reduce
        device tensors)."""
        self.num_experts, self.layers, self.aux_loss_coef = num_experts, layers, aux_loss_coef
        self.mode = replay_mode(replay)
        self.decoder = list(decoder) if decoder is not None else list(range(layers))
        self.columns = columns if columns is not None else max([d for d in self.decoder if d is not None] + [-1]) + 1
        self.top_k = top_k
        # Expert-load rows by decoder layer, so pipeline stages' statistics add up; a router outside the decoder
        # layers (or past them) gets a row of its own after them.
        inside = [d is not None and 0 <= d < self.columns for d in self.decoder]
        extra = iter(range(self.columns, self.columns + inside.count(False)))
        self._load_row = [d if ok else next(extra) for d, ok in zip(self.decoder, inside, strict=True)]
        self.group = group
        self.device = device or torch.device("cpu")
        self._active = False
        self._key: Any = None
        self._record = False
        self._counted = True
        self._tokens: RoutedTokens | None = None
        self._proximal: dict[Any, dict[int, torch.Tensor]] = {}
        self._proximal_slots: dict[Any, torch.Tensor] = {}  # minibatch -> [layers, E] slots the proximal pass used
        self._balance: _Balance | None = None
        self._balance_auto = False
        self._seen: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, float] | None]] = {}
        self._aux: list[torch.Tensor] = []
        self._reset_totals()

    def _reset_totals(self) -> None:
        rows = max(self.columns, max(self._load_row, default=0) + 1)  # the same on every pipeline stage
        self._load = torch.zeros(rows, self.num_experts, dtype=torch.float64, device=self.device)
        self._sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        self._aux_batches = 0

    # ------------------------------------------------------------- the trainer's side

    def begin(self, key: Any, record: bool, counted: bool = True, tokens: RoutedTokens | None = None) -> None:
        """A micro-batch starts: `key` names it across passes (None: not compared; a tuple's first entry names its
        minibatch); `record`: this is the proximal pass, keep its experts; `counted`: False for a dummy micro-batch
        (it only keeps collectives in step) or a pass the statistics leave out; `tokens`: which tokens count and the
        engine's experts (None: every token counts, no engine routing)."""
        self._active, self._key, self._record, self._counted = True, key, record, counted
        self._tokens = tokens.to(self.device) if tokens is not None else None
        self._seen = {}
        self._aux = []
        if self.aux_loss_coef and torch.is_grad_enabled() and self._balance is None:
            # A forward with gradients outside `start_minibatch` (not the trainer's): its micro-batch is the batch.
            known = torch.zeros(self.layers, self.num_experts, dtype=torch.float64, device=self.device)
            seen_tokens = torch.zeros(self.layers, dtype=torch.float64, device=self.device)
            self._balance = _Balance(None, known, [1.0] * self.layers, known.clone(), seen_tokens, False)
            self._balance_auto = True
            self._aux_batches += 1

    def end(self, keep: bool = False) -> dict[int, Any] | None:
        """The micro-batch is done: routers pass their own choice through until `begin`. `keep`: its backward comes
        later (a pipeline stage runs other forwards in between); returns its routing for `recompute`."""
        seen = self._seen
        self._active = False
        self._seen = {}
        self._aux = []
        self._tokens = None
        if self._balance_auto:
            self._balance, self._balance_auto = None, False
        return seen if keep else None

    def recompute(self, seen: dict[int, Any]) -> None:
        """The backward of a micro-batch `end(keep=True)` closed: a layer recomputed in it (activation recompute)
        routes as its forward did, and adds nothing. Close with `end()`."""
        self._active, self._key, self._record, self._counted = True, None, False, False
        self._seen = seen
        self._aux = []

    def forget(self) -> None:
        """Drop the recorded proximal experts and the minibatch's balance inputs (a new training step)."""
        self._proximal = {}
        self._proximal_slots = {}
        self._balance, self._balance_auto = None, False

    def start_minibatch(self, minibatch: Any, micro: Sequence[RoutedTokens], counted: Sequence[bool]) -> None:
        """Before the policy forwards of a minibatch's micro-batches `micro` (collective over the group when the
        load-balancing loss is on): fix its token count and what is known of its expert shares (see the module
        docstring)."""
        self._balance_auto = False
        self._balance = self._prepare(minibatch, micro, counted) if self.aux_loss_coef else None

    def _prepare(self, minibatch: Any, micro: Sequence[RoutedTokens], counted: Sequence[bool]) -> _Balance:
        """The group-wide `_Balance` of these micro-batches (one all-reduce)."""
        layers, experts = self.layers, self.num_experts
        proximal = self._proximal_slots.get(minibatch)
        use_captured = proximal is None and self.mode == "rollout"
        known = proximal.cpu() if proximal is not None else torch.zeros(layers, experts, dtype=torch.float64)
        rest = torch.zeros(layers, dtype=torch.float64)
        tokens = 0.0
        for mb, real in zip(micro, counted, strict=True):
            if not real:
                continue
            mask = mb.counted.cpu()
            n = float(mask.sum())
            tokens += n
            if proximal is not None:
                continue
            ids, captured = (mb.experts.cpu(), mb.captured.cpu()) if mb.experts is not None else (None, None)
            for k in range(layers):
                col = self.decoder[k]
                if use_captured and ids is not None and col is not None and col < self.columns:
                    cap = captured[:, col] & mask  # type: ignore[index]
                    known[k] += torch.bincount(ids[:, col][cap].reshape(-1), minlength=experts).to(torch.float64)
                    rest[k] += n - float(cap.sum())
                else:
                    rest[k] += n
        both = torch.cat([known.reshape(-1), rest, torch.tensor([tokens], dtype=torch.float64)]).to(self.device)
        if self.group is not None:
            dist.all_reduce(both, group=self.group)
        self._aux_batches += 1
        return _Balance(
            tokens=float(both[-1]),
            known=both[: layers * experts].view(layers, experts),
            rest=both[layers * experts : -1].tolist(),
            seen=torch.zeros(layers, experts, dtype=torch.float64, device=self.device),
            seen_tokens=torch.zeros(layers, dtype=torch.float64, device=self.device),
            use_captured=use_captured,
        )

    def aux_loss(self) -> torch.Tensor | None:
        """This rank's share of the micro-batch's load-balancing loss times its coefficient (None when off or
        nothing routed): summed over micro-batches and ranks it is the global batch's loss, mean over MoE layers."""
        if not self._aux:
            return None
        return self.aux_loss_coef * torch.stack(self._aux).sum() / self.layers

    def take_stats(self, stages: Any = None) -> dict[str, float]:
        """Group-wide routing statistics since the last call (collective: every rank calls it). `stages`: the
        pipeline's stage group, each stage holding other layers (None without pipeline parallelism).

        ``moe/expert_load_max``: the busiest expert's routed slots over an even share, worst layer;
        ``moe/routing_changed``: share of tokens whose expert set in the policy forward differs from the proximal
        pass's (present when passes were compared); ``moe/rollout_routing_agreement``: share of (token, MoE layer)
        pairs with the engine's routing whose expert set the trainer chose too, before replay (present when the
        batch carried routing); ``moe/aux_loss``: the load-balancing loss before its coefficient, mean over
        minibatches (present when on).
        """
        loads, sums, batches = self._load, self._sums, self._aux_batches
        self._reset_totals()
        both = torch.cat([loads.reshape(-1), sums])
        for group in (self.group, stages):
            if group is not None:
                dist.all_reduce(both, group=group)
        loads = both[: loads.numel()].view_as(loads)
        changed, compared, agree, pairs, aux = both[loads.numel() :].tolist()
        mean = loads.sum(-1, keepdim=True).clamp(min=1) / self.num_experts
        stats = {"moe/expert_load_max": float((loads / mean).max())}
        if compared:
            stats["moe/routing_changed"] = changed / compared
        if pairs:
            stats["moe/rollout_routing_agreement"] = agree / pairs
        if batches:  # each rank's sum holds its share of every minibatch's loss; every rank counted the minibatches
            stats["moe/aux_loss"] = aux / batches
        return stats

    # ------------------------------------------------------------- the routers' side

    def route(self, layer: int, indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The experts layer `layer` uses for this micro-batch's tokens (`indices` are its own choice)."""
        if not self._active:  # a forward outside the trainer's passes (generation, a test): nothing to do
            return indices
        if layer in self._seen:  # recomputed in backward: the first run's experts and autograd ops
            indices, balance = self._seen[layer]
            if balance is not None and torch.is_grad_enabled():
                self._balance_term(probs, *balance)
            return indices
        own = indices
        counted = self._counted_mask(layer, own.shape[0])
        policy = self._key is not None and not self._record
        tokens = self._tokens
        if tokens is not None and tokens.experts is not None:
            col = self._column(layer)
            if col is not None:
                engine, captured = tokens.experts[:, col], tokens.captured[:, col]  # type: ignore[index]
                if policy:  # the diagnostic: the trainer's own choice against the engine's, before any replay
                    pairs = captured & counted
                    same = (own.sort(-1).values == engine.sort(-1).values).all(-1) & pairs
                    self._sums[_AGREE] += same.sum()
                    self._sums[_PAIRS] += pairs.sum()
                if self.mode == "rollout":
                    indices = torch.where(captured.unsqueeze(-1), engine, own)
        recorded = self._proximal.get(self._key, {}) if self._key is not None else {}
        if self._record and self._key is not None:
            self._proximal.setdefault(self._key, {})[layer] = own.detach()
        elif layer in recorded and recorded[layer].shape == own.shape:
            before = recorded[layer]
            differs = (before.sort(-1).values != own.sort(-1).values).any(-1) & counted
            self._sums[_CHANGED] += differs.sum()
            self._sums[_COMPARED] += counted.sum()
            if self.mode == "proximal":
                indices = before
        slots = self._slots(indices, counted)
        self._load[self._load_row[layer]] += slots
        if self._record and self._key is not None:
            minibatch = self._key[0] if isinstance(self._key, tuple) else self._key
            used = self._proximal_slots.setdefault(
                minibatch, torch.zeros(self.layers, self.num_experts, dtype=torch.float64, device=self.device)
            )
            used[layer] += slots
        balance = None
        if self.aux_loss_coef and torch.is_grad_enabled() and self._balance is not None:
            share, tokens_total = self._share(layer, indices, counted, slots)
            balance = (share, counted, tokens_total)
            term = self._balance_term(probs, *balance)
            self._aux.append(term)
            self._sums[_AUX] += term.detach().to(torch.float64) / self.layers
        self._seen[layer] = (indices, balance)
        return indices

    def _column(self, layer: int) -> int | None:
        """The decoder layer of router `layer` (the engine routing's column), None past the routing's layers."""
        col = self.decoder[layer]
        if col is None:
            raise ValueError(f"MoE router {layer} is outside the decoder layers (`layers.N`): no engine routing column")
        return col if col < self.columns else None

    def _counted_mask(self, layer: int, n: int) -> torch.Tensor:
        """Which of the `n` tokens layer `layer` routes the statistics and the loss count."""
        tokens = self._tokens
        if tokens is None:
            return torch.full((n,), self._counted, dtype=torch.bool, device=self.device)
        if tokens.counted.shape[0] != n:
            raise RuntimeError(
                f"the micro-batch's routing describes {tokens.counted.shape[0]} tokens but MoE router {layer} "
                f"routes {n}"
            )
        return tokens.counted if self._counted else torch.zeros_like(tokens.counted)

    def _slots(self, indices: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """Routed slots per expert of the counted tokens (no gradient)."""
        ids = indices.detach()[counted].reshape(-1)
        return torch.bincount(ids, minlength=self.num_experts).to(device=self.device, dtype=torch.float64)

    def _share(
        self, layer: int, indices: torch.Tensor, counted: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(f_i for layer `layer`: tokens per expert over the global batch's tokens, summing to top-k; that token
        count, at least 1). f_i is the slots known in advance plus those of the other tokens as far as the
        micro-batches so far tell, scaled to their number (one all-reduce, only while some are not known)."""
        b = self._balance
        assert b is not None
        if b.rest[layer] > 0:
            if b.use_captured and self._tokens is not None and self._tokens.captured is not None:
                col = self._column(layer)
                if col is not None:
                    counted = counted & ~self._tokens.captured[:, col]
                    slots = self._slots(indices, counted)
            both = torch.cat([slots, counted.sum().to(slots).reshape(1)])
            if self.group is not None:
                dist.all_reduce(both, group=self.group)
            b.seen[layer] += both[:-1]
            b.seen_tokens[layer] += both[-1]
        seen = b.seen_tokens[layer]
        if b.tokens is None:  # this micro-batch alone
            total, tokens = b.seen[layer], seen
        else:
            scale = torch.where(seen > 0, b.rest[layer] / seen.clamp(min=1), torch.zeros_like(seen))
            total, tokens = b.known[layer] + b.seen[layer] * scale, torch.tensor(b.tokens, dtype=torch.float64)
        share = indices.shape[-1] * total / total.sum().clamp(min=1e-12)
        return share, tokens.to(self.device).clamp(min=1)

    def _balance_term(
        self, probs: torch.Tensor, share: torch.Tensor, counted: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """E · Σ f_i P_i with this rank's share of P_i (see the module docstring); the only ops with a gradient, so a
        recomputed layer repeats exactly these."""
        kept = probs * counted.unsqueeze(-1).to(probs.dtype)
        return self.num_experts * (share.to(probs.dtype) * kept.sum(0)).sum() / tokens.to(probs.dtype)


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


def _decoder_layers(model: torch.nn.Module) -> int | None:
    """The model's decoder layer count (the engine's routing arrays have one column per decoder layer)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    return int(layers) if layers is not None else None


def install_routing(
    model: torch.nn.Module,
    aux_loss_coef: float,
    replay: bool | str,
    group: Any,
    device: torch.device | None = None,
) -> Routing | None:
    """Give every router of `model` rlc's forward through one `Routing`; None for a model without routers. Call
    before the model is sharded (each router's own forward is run once) and before a pipeline stage drops the other
    stages' layers (every stage's `Routing` then knows every MoE layer: the loss's mean over them, and statistics of
    the same shape on every stage). Each router reads the engine routing's column of the decoder layer its module
    name says (``layers.N``)."""
    named = _named_routers(model)
    if not named:
        return None
    decoder = [int(m.group(1)) if (m := _LAYER.search(name)) else None for name, _ in named]
    routing = Routing(
        int(named[0][1].num_experts),
        len(named),
        aux_loss_coef,
        replay,
        group,
        device,
        decoder=decoder,
        columns=_decoder_layers(model),
        top_k=int(named[0][1].top_k),
    )
    for layer, (_, router) in enumerate(named):
        original = router.forward
        grouped = _grouped_sigmoid(router)
        if not grouped:
            router._rlc_renormalise = _renormalises(router)
        router._rlc_routing, router._rlc_layer = routing, layer
        router.forward = types.MethodType(_grouped_sigmoid_forward if grouped else _router_forward, router)
        _check_same_routing(router, original)
    return routing
