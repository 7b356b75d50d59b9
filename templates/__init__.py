"""rlc.templates package."""
