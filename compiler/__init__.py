"""The compile path: spec loading, validation rules, planning and artifact emission.

Nothing under this package may import torch, ray, vllm or transformers.
"""
