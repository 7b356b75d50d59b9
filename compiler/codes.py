"""Every diagnostic code rlc reports, with what it means: the one registry that rules declare against.

Codes are stable (CI greps them): 0xx the spec file itself, 1xx keys, values and names, 2xx semantic rules that
need the target or the model, 3xx the planner (what does not fit or cannot run), 7xx plan directories.
`rule_registry.rule` refuses an unregistered code, and tests check that every code the sources report is here.
"""

from __future__ import annotations

CODES: dict[str, str] = {
    "RLC000": "The spec file cannot be read",
    "RLC001": "Malformed YAML",
    "RLC002": "The spec is empty",
    "RLC003": "The spec is not a mapping at the top level",
    "RLC004": "The file is not YAML text (binary, not UTF-8, too large)",
    "RLC005": "A key appears more than once",
    "RLC006": "A --set override is malformed",
    "RLC007": "The YAML expands too far: recursive aliases, alias bombs or nesting too deep",
    "RLC101": "Unknown key",
    "RLC102": "A value has the wrong type or structure",
    "RLC103": "A required key is missing",
    "RLC104": "A value is out of range or not one of the allowed values",
    "RLC105": "Unknown model",
    "RLC106": "An inline architecture is inconsistent",
    "RLC107": "No hardware target",
    "RLC108": "A --targets / RLC_TARGETS directory is missing, or a profile in it does not parse or validate",
    "RLC201": "MTP speculative decoding needs a model with MTP layers",
    "RLC202": "MOPD teachers must share the student's vocabulary",
    "RLC203": "Routing and teacher names must be consistent",
    "RLC204": "Colocated mode with teachers must leave room for them",
    "RLC205": "LoRA rank must be sane for the model",
    "RLC206": "Context must fit the model's positions",
    "RLC207": "Pinned parallel degrees must divide heads, layers, experts and devices",
    "RLC208": "Pinned devices must fit in the cluster",
    "RLC209": "kl_coef > 0 needs a reference policy",
    "RLC210": "The cpu target runs only small models",
    "RLC211": "Model weights must be a local folder on real hardware",
    "RLC212": "Data and reward must name something that exists",
    "RLC213": "Settings that the chosen mode ignores",
    "RLC214": "cluster.device_memory_gib must be a budget the devices can give",
    "RLC215": "Training choices the pinned backend does not implement",
    "RLC216": "group_size 1 leaves GRPO nothing to learn from unless a teacher distils",
    "RLC217": "The cluster must be within what the planner searches",
    "RLC218": "Paths are taken literally: no ~ or $VARIABLE expansion",
    "RLC219": "algorithm.deterministic: true asks for more than the plan can repeat",
    "RLC220": "Agent rollouts need settings that fit each other and the rollout budget",
    "RLC221": "algorithm.minibatches must give every optimizer step samples",
    "RLC222": "Algorithm settings must fit the estimator and each other",
    "RLC223": "backend: megatron is refused: nothing in rlc executes Megatron",
    "RLC224": "LoRA on a mixture-of-experts model adapts attention and dense linears, not the routed experts or router",
    "RLC225": "Routing replay needs routed experts, and rollout replay engines that record them",
    "RLC301": "A role does not fit device memory, or cannot be placed, on this cluster",
    "RLC302": "A pinned vLLM memory share above the planner's cap with long contexts",
    "RLC303": "The runtime cannot execute this plan yet",
    "RLC304": "Thin memory headroom: under a GiB spare per device",
    "RLC305": "The environment workers do not fit the nodes' host memory",
    "RLC306": "A minibatch smaller than the trainer's data parallelism leaves ranks idle",
    "RLC307": "Colocated weights staged in each node's /dev/shm outgrow a default /dev/shm",
    "RLC701": "Not a compiled plan directory",
    "RLC702": "Unsupported plan format",
    "RLC703": "Plan compiled by an incompatible rlc",
    "RLC704": "A plan file is missing",
    "RLC705": "A plan file changed after compile",
    "RLC706": "A file that is not part of the plan",
    "RLC707": "plan.json cannot be read (a hand edit broke it)",
    "RLC708": "The runtime cannot execute this plan's layout (rlc run refuses it before anything starts)",
}


def summary(code: str) -> str:
    """What `code` means; KeyError for a code nobody registered."""
    return CODES[code]
