"""The policy-loss settings a train step obeys: ratio, clipping, off-policy correction and aggregation.

One typed record instead of loose dict keys, built from the plan's `algorithm` section (`from_plan`) by the
controller and handed to every trainer rank. It imports no torch, so the plan side can build and test it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "Aggregation",
    "Correction",
    "PolicyLoss",
    "RatioLevel",
    "aggregation_weights",
]

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Correction = Literal["token_mask", "token_truncate", "sequence_truncate", "sequence_mask"]
RatioLevel = Literal["token", "sequence"]
AGGREGATIONS: tuple[str, ...] = Aggregation.__args__  # type: ignore[attr-defined]
CORRECTIONS: tuple[str, ...] = Correction.__args__  # type: ignore[attr-defined]

#: The dict keys train steps took before this record (tests, benchmarks): they map onto its fields.
_LEGACY = {"clip": "clip_low", "clip_higher": "clip_high", "dual_clip": "dual_clip", "decoupled": "decoupled"}


@dataclass(frozen=True)
class PolicyLoss:
    """How the clipped policy-gradient loss is formed (see `loss.policy_loss` for the formulas).

    ``clip_low``/``clip_high``: the trust region [1 − low, 1 + high] of the ratio (token ratio, or the
    length-normalised sequence ratio of GSPO when ``ratio`` is "sequence"); ``clip_high`` None is symmetric.
    ``dual_clip`` (> 1) bounds negative-advantage losses and ``log_ratio_clamp`` bounds log(π_θ/π_prox) before the
    exponential; the defaults (3 and 20, verl's) keep every token's loss within 3·|A| of its weight, None turns each
    off. ``behave_correction`` picks what happens to the behaviour importance weight w = π_prox/π_behave above
    ``behave_imp_weight_cap`` (None: no bound). ``agg`` is the loss aggregation; ``agg_norm_tokens`` the constant
    of seq-mean-token-sum-norm.
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = 3.0
    log_ratio_clamp: float | None = 20.0
    decoupled: bool = True
    ratio: RatioLevel = "token"
    behave_correction: Correction = "token_mask"
    behave_imp_weight_cap: float | None = 5.0
    agg: Aggregation = "token-mean"
    agg_norm_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.clip_low <= 0 or (self.clip_high is not None and self.clip_high <= 0):
            raise ValueError(f"clip range must be > 0, got low {self.clip_low}, high {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.log_ratio_clamp is not None and self.log_ratio_clamp <= 0:
            raise ValueError(f"log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
        if self.ratio not in ("token", "sequence"):
            raise ValueError(f"unknown ratio level {self.ratio!r}; expected 'token' or 'sequence'")
        if self.behave_correction not in CORRECTIONS:
            raise ValueError(f"unknown behave_correction {self.behave_correction!r}; expected one of {CORRECTIONS}")
        if self.behave_correction != "token_mask" and self.behave_imp_weight_cap is None:
            raise ValueError(f"behave_correction {self.behave_correction} needs a behave_imp_weight_cap")
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {self.agg!r}; expected one of {AGGREGATIONS}")
        if self.agg == "seq-mean-token-sum-norm" and not (self.agg_norm_tokens and self.agg_norm_tokens > 0):
            raise ValueError("seq-mean-token-sum-norm needs agg_norm_tokens > 0 (the constant normaliser)")

    @property
    def high(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high

    @property
    def needs_sequences(self) -> bool:
        """Whether the loss needs each token's sequence (a sequence-level ratio or correction)."""
        return self.ratio == "sequence" or (self.decoupled and self.behave_correction.startswith("sequence"))

    @classmethod
    def from_cfg(cls, cfg: dict[str, Any]) -> PolicyLoss:
        """The record from a train step's loss settings: ``cfg["policy"]`` (a PolicyLoss or its fields), or the older
        keys (clip, clip_higher, dual_clip, decoupled, behave_imp_weight_cap). Consumes what it reads."""
        given = cfg.pop("policy", None)
        if isinstance(given, PolicyLoss):
            return given
        if isinstance(given, Mapping):
            return cls(**dict(given))
        kwargs = {new: cfg.pop(old) for old, new in _LEGACY.items() if old in cfg}
        if "behave_imp_weight_cap" in cfg:
            kwargs["behave_imp_weight_cap"] = cfg.pop("behave_imp_weight_cap")
        return cls(**kwargs)

    @classmethod
    def from_plan(cls, algo: Any, max_response_len: int) -> PolicyLoss:
        """From a plan's `AlgorithmSettings` (fields older plans lack take their old meaning: no dual clip, no
        log-ratio clamp)."""
        sequence = getattr(algo, "importance_ratio", "token") == "sequence"
        low = algo.sequence_clip_low if sequence else algo.clip
        high = algo.sequence_clip_high if sequence else getattr(algo, "clip_high", None)
        agg = getattr(algo, "loss_agg", "token-mean")
        norm = getattr(algo, "loss_norm_tokens", None)
        return cls(
            clip_low=float(low),
            clip_high=None if high is None else float(high),
            dual_clip=getattr(algo, "dual_clip", None),
            log_ratio_clamp=getattr(algo, "log_ratio_clamp", None),
            decoupled=bool(algo.decoupled_loss),
            ratio="sequence" if sequence else "token",
            behave_correction=getattr(algo, "behave_correction", "token_mask"),
            behave_imp_weight_cap=float(algo.behave_imp_weight_cap),
            agg=agg,
            agg_norm_tokens=(norm or max_response_len) if agg == "seq-mean-token-sum-norm" else None,
        )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def aggregation_weights(
    token_counts: Sequence[int], agg: Aggregation, total_tokens: float, total_sequences: float, norm_tokens: int | None
) -> list[float]:
    """The weight each loss token of each sequence gets, so that the loss is Σ_t weight_t · loss_t.

    ``token_counts``: the loss tokens of each sequence of one share; ``total_tokens``/``total_sequences``: the
    counts over the whole minibatch (every micro-batch of every rank; sequences with no loss token are not
    counted). Because every weight depends on those totals and on its own sequence only, the sum over any split
    of the minibatch into micro-batches and ranks is the same loss:

      token-mean               1 / T                (Σ over all tokens / T; DAPO)
      seq-mean-token-sum       1 / B                (each sequence's token sum, mean over sequences)
      seq-mean-token-mean      1 / (B · |y_i|)      (each sequence's token mean, mean over sequences; GRPO paper)
      seq-mean-token-sum-norm  1 / (B · L)          (a constant normaliser L, Dr. GRPO; TRL's dr_grpo)
    """
    t, b = max(float(total_tokens), 1.0), max(float(total_sequences), 1.0)
    if agg == "token-mean":
        return [1.0 / t for _ in token_counts]
    if agg == "seq-mean-token-sum":
        return [1.0 / b for _ in token_counts]
    if agg == "seq-mean-token-mean":
        return [1.0 / (b * n) if n > 0 else 0.0 for n in token_counts]
    if agg == "seq-mean-token-sum-norm":
        if not norm_tokens:
            raise ValueError("seq-mean-token-sum-norm needs a constant normaliser (norm_tokens)")
        return [1.0 / (b * norm_tokens) for _ in token_counts]
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {AGGREGATIONS}")
