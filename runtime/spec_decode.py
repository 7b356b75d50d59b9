"""Per-step speculative-decoding figures from the engines' cumulative vLLM counters.

Engines report running totals (drafts, draft tokens, accepted tokens); a step's figures are the change since
the previous step, summed over engines, so a busy engine weighs more than an idle one. A restarted engine's
counters start again from zero, which shows as a decrease: its new totals are then this step's delta.
"""

from __future__ import annotations

from collections.abc import Mapping

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


class SpecDecodeDelta:
    """Turns per-engine cumulative counters into one step's acceptance rate and mean accepted length."""

    def __init__(self) -> None:
        self._last: dict[int, dict[str, float]] = {}

    def step(self, snapshots: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
        """``snapshots``: engine index → ``RolloutEngine.spec_decode_metrics()``; returns spec_decode/* metrics.

        acceptance_rate = accepted / drafted tokens (0..1); mean_accepted_len = tokens per target-model
        step in draft rounds = 1 + accepted / drafts (1..k+1), vLLM's "mean acceptance length".
        """
        total = dict.fromkeys(COUNTERS, 0.0)
        for index, snap in snapshots.items():
            last = self._last.get(index, {})
            restarted = any(float(snap.get(k, 0.0)) < last.get(k, 0.0) for k in COUNTERS)
            for k in COUNTERS:
                now = float(snap.get(k, 0.0))
                total[k] += now if restarted else now - last.get(k, 0.0)
            self._last[index] = {k: float(snap.get(k, 0.0)) for k in COUNTERS}
        drafted, drafts, accepted = total["num_draft_tokens"], total["num_drafts"], total["num_accepted_tokens"]
        return {
            "spec_decode/acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_decode/mean_accepted_len": 1.0 + accepted / drafts if drafts else 1.0,
            "spec_decode/draft_tokens": drafted,
            "spec_decode/accepted_tokens": accepted,
        }
