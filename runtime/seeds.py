"""Per-request sampling seeds: a sample's randomness depends on what it is, never on when it was generated.

vLLM draws unseeded samples from its engine's global generator, whose state depends on every batch the
engine ran before (their sizes, and which requests the engine core had received when it scheduled a step),
so the same prompt gets different samples run after run. A request with ``SamplingParams(seed=s)`` draws
from a generator of its own, and vLLM's parallel sampling gives sample ``i`` of an ``n``-sample request the
seed ``s + i``. Seeding each prompt from (run seed, prompt cursor) therefore fixes every sample by
(run seed, cursor, sample index); the cursor (the prompt's position in the seeded prompt stream) fixes the
step it belongs to and the prompt itself, and stays the same when a prompt is re-issued or a run resumed.
"""

from __future__ import annotations

import hashlib

__all__ = ["SEED_BITS", "request_seed"]

#: Seeds stay below 2**62 so that vLLM's ``seed + i`` for the group's samples stays within int64.
SEED_BITS = 62


def request_seed(run_seed: int, cursor: int) -> int:
    """The vLLM seed of the request for the prompt at ``cursor`` (sample ``i`` gets this ``+ i``).

    A hash, not ``run_seed + cursor``: neighbouring prompts and neighbouring run seeds must not share
    generator streams (with ``+`` the seed-1 run would replay the seed-0 run's samples one prompt later).
    """
    digest = hashlib.blake2b(f"rlc-sample:{int(run_seed)}:{int(cursor)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)
