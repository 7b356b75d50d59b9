"""rlc.runtime.algo package."""
