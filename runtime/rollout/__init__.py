"""rlc.runtime.rollout package."""
