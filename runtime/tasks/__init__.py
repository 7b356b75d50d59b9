"""rlc.runtime.tasks package."""
