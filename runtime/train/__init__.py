"""rlc.runtime.train package."""
