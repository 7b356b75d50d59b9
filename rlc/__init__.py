"""rlc: compile and run asynchronous RL post-training plans for Ascend NPU clusters."""

__version__ = "0.1.0"
