"""The run path: Ray placement, vLLM rollout engines, FSDP2 trainers and the controller loop."""
