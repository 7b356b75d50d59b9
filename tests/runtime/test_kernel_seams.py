"""The trainer's kernel seams (Gated-DeltaNet, packed attention, the experts' GEMMs), per platform.

The seam walk runs each platform's selection with import guards: packages a scenario lacks cannot be imported, and
any attempt to import a package that platform must never need (causal-conv1d, flash-attn or fla's CUDA backends on
npu; torch_npu on cuda; any of them on cpu) is recorded and fails the test. Packages a scenario has are stood in by
empty modules carrying the names the seam looks up, so the walk needs none of them installed. The expert kernels
that run on cpu are checked against the per-expert loop and against transformers' experts on one unpacked rank.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import itertools
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlc.schemas.layout import KERNEL_SEAMS, PLATFORM_KERNELS  # noqa: E402

#: Packages no selection on the platform may import, present or not.
NEVER = {
    "cpu": {"fla", "torch_npu", "flash_attn", "causal_conv1d"},
    "cuda": {"torch_npu", "triton_ascend"},
    "npu": {"causal_conv1d", "flash_attn", "fla.modules.causal_conv1d.backends.cuda"},
}
OPTIONAL = ("fla", "torch_npu", "flash_attn", "causal_conv1d")
SEAM_MODULES = tuple(
    f"rlc.runtime.train.{m}" for m in ("expert_parallel", "linear_attention", "varlen_attention", "context_parallel")
)
#: What a fully equipped image of each platform has.
EQUIPPED = {"cpu": OPTIONAL, "cuda": ("fla", "flash_attn", "causal_conv1d"), "npu": ("fla", "torch_npu")}


class _Guard:
    """Records every import (statement or `find_spec` probe) of a forbidden package."""

    def __init__(self, forbidden: set[str]) -> None:
        self.forbidden, self.tried = forbidden, []

    def note(self, fullname: str) -> None:
        if any(fullname == f or fullname.startswith(f + ".") for f in self.forbidden):
            self.tried.append(fullname)


def _module(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []  # a package, so submodules resolve through sys.modules
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _unavailable(*args: object, **kwargs: object) -> None:
    raise AssertionError("a seam walk selects kernels; it does not run them")


def _stand_ins(platform: str, present: tuple[str, ...]) -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}
    if "fla" in present:
        mods |= {
            "fla": _module("fla"),
            "fla.utils": _module("fla.utils", IS_NPU=platform == "npu"),
            "fla.modules": _module("fla.modules"),
            "fla.modules.causal_conv1d": _module(
                "fla.modules.causal_conv1d", CausalConv1dFunction=types.SimpleNamespace(apply=_unavailable)
            ),
            "fla.ops": _module("fla.ops"),
            "fla.ops.gated_delta_rule": _module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=_unavailable),
        }
    if "torch_npu" in present:
        mods["torch_npu"] = _module("torch_npu", npu_grouped_matmul=_unavailable)
    for name in ("flash_attn", "causal_conv1d"):
        if name in present:
            mods[name] = _module(name)
    return mods


@pytest.fixture
def image(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``image(platform, present)``: an interpreter where only `present` of the optional packages import."""

    import transformers.integrations.moe  # noqa: F401  (transformers' own availability probes run here, unwatched)
    from transformers import AttentionInterface  # noqa: F401

    def build(platform: str, present: tuple[str, ...]) -> _Guard:
        for name in list(sys.modules):
            if name.split(".")[0] in OPTIONAL or name in SEAM_MODULES:  # the seams import afresh, watched
                monkeypatch.delitem(sys.modules, name)
        for name in set(OPTIONAL) - set(present):
            monkeypatch.setitem(sys.modules, name, None)  # `import` raises, `find_spec` answers None
        for name, module in _stand_ins(platform, present).items():
            monkeypatch.setitem(sys.modules, name, module)
        guard = _Guard(set(NEVER[platform]))
        real_import, real_find_spec = builtins.__import__, importlib.util.find_spec

        def watched_import(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
            if level == 0:
                guard.note(name)
                for item in fromlist or ():
                    guard.note(f"{name}.{item}")
            return real_import(name, globals, locals, fromlist, level)

        def watched_find_spec(name, package=None):  # type: ignore[no-untyped-def]
            guard.note(name)
            return real_find_spec(name, package)

        monkeypatch.setattr(builtins, "__import__", watched_import)
        monkeypatch.setattr(importlib.util, "find_spec", watched_find_spec)
        return guard

    yield build


def _select(platform: str) -> dict[str, str]:
    from rlc.runtime.train.expert_parallel import expert_kernel_for
    from rlc.runtime.train.linear_attention import kernels_for
    from rlc.runtime.train.varlen_attention import attention_kernel_for

    try:
        linear = kernels_for(platform).name
    except RuntimeError as exc:
        linear = f"refused: {exc}"
    return {
        "gated_deltanet": linear,
        "attention": attention_kernel_for(platform)[1],
        "experts": expert_kernel_for(platform).name,
    }


def test_the_table_covers_every_platform_and_seam() -> None:
    assert set(PLATFORM_KERNELS) == {"cpu", "cuda", "npu"}
    for seams in PLATFORM_KERNELS.values():
        assert tuple(seams) == KERNEL_SEAMS


@pytest.mark.parametrize("platform", ["cpu", "cuda", "npu"])
@pytest.mark.parametrize("equipped", [True, False], ids=["equipped", "bare"])
def test_each_platform_selects_a_kernel_its_table_names_and_imports_nothing_it_lacks(
    image, monkeypatch: pytest.MonkeyPatch, platform: str, equipped: bool
) -> None:
    guard = image(platform, EQUIPPED[platform] if equipped else ())
    if platform == "cuda":
        _gpu(monkeypatch, (9, 0))
    chosen = _select(platform)
    assert guard.tried == [], f"{platform} tried to import {guard.tried}"
    for seam, name in chosen.items():
        choice = PLATFORM_KERNELS[platform][seam]
        if name.startswith("refused: "):
            assert platform == "cuda" and seam == "gated_deltanet" and not equipped and choice.fallback is None
            assert "install fla-core" in name
            continue
        assert name in choice.names(), (seam, name)
        has_it = equipped or ((platform, seam) == ("cuda", "experts") and hasattr(torch, "_grouped_mm"))  # torch's own
        assert name == (choice.preferred if has_it else choice.fallback or choice.preferred), (seam, name)


def test_npu_selection_never_reaches_a_cuda_package_even_when_one_is_installed(image) -> None:
    """On an Ascend image that happens to carry causal-conv1d or flash-attn, rlc itself never imports them (fla's real
    ``fla.modules.causal_conv1d`` would try causal-conv1d on import; the stand-in here does not)."""
    guard = image("npu", ("fla", "torch_npu"))
    guard.forbidden |= {"causal_conv1d", "flash_attn"}
    _select("npu")
    assert guard.tried == []


@pytest.mark.parametrize("broken", ["fla.modules.causal_conv1d", "fla.ops.gated_delta_rule"])
def test_npu_falls_back_to_torch_when_fla_imports_but_its_kernels_do_not(
    image, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], broken: str
) -> None:
    """fla's device probe imports on the NPU but one of the kernel modules rlc calls does not: the trainer runs the
    torch path and says which import failed, rather than stopping with an ImportError."""
    from rlc.schemas.layout import TORCH_LINEAR_KERNELS

    image("npu", ("fla", "torch_npu"))
    monkeypatch.setitem(sys.modules, broken, None)
    assert _select("npu")["gated_deltanet"] == TORCH_LINEAR_KERNELS
    assert f"rlc: warning: fla imports on this NPU but not its Gated-DeltaNet kernels (import of {broken}" in (
        capsys.readouterr().err
    )


# --------------------------------------------------------------------------------------------- expert kernels


def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """A CUDA GPU of `capability`, as far as the kernel choice asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")
@pytest.mark.parametrize(("capability", "grouped"), [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_grouped_mm_is_chosen_on_sm90_and_later_only(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], grouped: bool
) -> None:
    """Some torch builds' grouped GEMM runs on sm90+ only: an A100 (sm80) takes the loop, as the dry run says."""
    from rlc.runtime.train.expert_parallel import expert_kernel_for

    _gpu(monkeypatch, capability)
    choice = PLATFORM_KERNELS["cuda"]["experts"]
    assert "sm90" in (choice.needs or "")
    assert expert_kernel_for("cuda").name == (choice.preferred if grouped else choice.fallback)


def test_a_failing_grouped_mm_falls_back_to_the_loop_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A grouped GEMM that raises (a build that does not run on this GPU) hands the experts to the loop, with one
    warning line, and is not tried again; the results are the loop's."""
    from rlc.runtime.train import expert_parallel

    calls = []

    def broken(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("grouped gemm is only supported on SM90\nmore detail")

    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    monkeypatch.setattr(expert_parallel, "_grouped_mm_failed", False)
    args = _experts(seed=2)
    loop, loop_grads = _run(expert_parallel.TORCH_EXPERT_KERNEL, *args, torch.bfloat16)
    for _ in range(2):
        got, got_grads = _run(expert_parallel.GROUPED_MM_EXPERT_KERNEL_IMPL, *args, torch.bfloat16)
        assert torch.equal(got, loop) and all(map(torch.equal, got_grads, loop_grads))
    assert len(calls) == 1
    err = capsys.readouterr().err
    assert err.count("rlc: warning: torch._grouped_mm failed (grouped gemm is only supported on SM90)") == 1


def _experts(seed: int = 0, rows: int = 37, hidden: int = 32, inter: int = 16, experts: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    counts = [9, 0, 20, 8]  # an expert with no rows, as routing gives
    return x, counts, gate_up, down


def _run(kernel, x, counts, gate_up, down, dtype):  # type: ignore[no-untyped-def]
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, gate_up, down)]
    out = kernel.run(leaves[0], counts, leaves[1], leaves[2], torch.nn.functional.silu)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.float(), [t.grad.float() for t in leaves]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")
def test_grouped_mm_experts_equal_the_loop_on_cpu() -> None:
    """CUDA's kernel (torch._grouped_mm, bfloat16) runs on this torch's cpu too: forward and gradients match the loop
    in bfloat16 and the float32 loop to bfloat16's precision."""
    from rlc.runtime.train.expert_parallel import GROUPED_MM_EXPERT_KERNEL_IMPL, TORCH_EXPERT_KERNEL

    args = _experts()
    ref, ref_grads = _run(TORCH_EXPERT_KERNEL, *args, torch.float32)
    loop, _loop_grads = _run(TORCH_EXPERT_KERNEL, *args, torch.bfloat16)
    grouped, grouped_grads = _run(GROUPED_MM_EXPERT_KERNEL_IMPL, *args, torch.bfloat16)
    scale = ref.abs().max()
    assert (grouped - loop).abs().max() <= 2e-2 * scale
    assert (grouped - ref).abs().max() <= 2e-2 * scale
    for got, want in zip(grouped_grads, ref_grads, strict=True):
        assert (got - want).abs().max() <= 3e-2 * want.abs().max()
    f32, _f32_grads = _run(GROUPED_MM_EXPERT_KERNEL_IMPL, *args, torch.float32)
    assert torch.equal(f32, ref)  # float32 takes the loop


def _reference_npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type, bias=None):  # type: ignore[no-untyped-def]
    """torch_npu's documented semantics in torch: group_type 0 splits the rows of x[0] by group_list (counts, as
    group_list_type 1 says) over weight[0][e]; group_type 2 splits the shared axis, giving one [K, N] per group."""
    assert group_list_type == 1 and bias is None
    bounds = [0, *torch.cumsum(group_list, 0).tolist()]
    a, w = x[0], weight[0]
    if group_type == 0:
        assert split_item == 2
        return [torch.cat([a[s:e] @ w[i] for i, (s, e) in enumerate(itertools.pairwise(bounds))])]
    assert group_type == 2 and split_item == 3
    return [torch.stack([a[:, s:e] @ w[s:e] for s, e in itertools.pairwise(bounds)])]


def test_npu_grouped_matmul_adapter_equals_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter around torch_npu's grouped matmul (weight layout, counts, the backward's two calls) against the
    loop, with torch_npu's documented semantics written in torch."""
    from rlc.runtime.train.expert_parallel import NPU_GROUPED_MATMUL_KERNEL, TORCH_EXPERT_KERNEL

    monkeypatch.setitem(
        sys.modules, "torch_npu", _module("torch_npu", npu_grouped_matmul=_reference_npu_grouped_matmul)
    )
    args = _experts(seed=1)
    ref, ref_grads = _run(TORCH_EXPERT_KERNEL, *args, torch.float32)
    got, got_grads = _run(NPU_GROUPED_MATMUL_KERNEL, *args, torch.float32)
    assert torch.allclose(got, ref, atol=1e-5)
    for g, r in zip(got_grads, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-5)


def test_installed_expert_kernel_equals_transformers_experts_on_one_rank(tiny_moe_model_dir: Path) -> None:
    """`install_expert_kernel` (what the trainer runs at EP 1) gives the same log-probs and gradients as
    transformers' own experts on an unpacked batch."""
    from transformers import AutoModelForCausalLM

    from rlc.runtime.train.expert_parallel import ExpertKernel, expert_modules, install_expert_kernel

    def logprobs_and_grads(model):  # type: ignore[no-untyped-def]
        ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
        logits = model(input_ids=ids, use_cache=False).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp.sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def load():  # type: ignore[no-untyped-def]
        return AutoModelForCausalLM.from_pretrained(
            tiny_moe_model_dir, dtype=torch.float32, experts_implementation="eager"
        )

    ref_lp, ref_grads = logprobs_and_grads(load())
    model = load()
    kernel = install_expert_kernel(model, "cpu")
    assert kernel is not None and kernel.name == PLATFORM_KERNELS["cpu"]["experts"].preferred
    calls = []
    counted = ExpertKernel(kernel.name, lambda *args: calls.append(1) or kernel.run(*args))
    for module in expert_modules(model):
        module._rlc_expert_kernel = counted
    lp, grads = logprobs_and_grads(model)
    assert len(calls) == len(expert_modules(model))  # every MoE layer ran the seam's kernel
    assert torch.allclose(lp, ref_lp, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], atol=1e-5, rtol=1e-4), name


# --------------------------------------------------------------------------------------------- accelerator check


def test_the_accelerator_check_runs_dry_on_cpu_without_vllm_or_ray() -> None:
    """`benchmarks/accelerator_check.py --dry`: both tables print, every tiny model passes on cpu's kernels, and
    the script imports neither vLLM nor Ray (a trainer-only GPU machine need not have them)."""
    import subprocess

    from paths import REPO

    script = (
        "import runpy, sys\n"
        "sys.argv = ['accelerator_check.py', '--dry']\n"
        "try:\n"
        f"    runpy.run_path({str(REPO / 'benchmarks' / 'accelerator_check.py')!r}, run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code, 'vllm' in sys.modules, 'ray' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    out = done.stdout
    assert "exit 0 False False" in out, out + done.stderr
    for kind in ("dense", "moe", "hybrid"):
        assert any(line.startswith(kind) and " yes " in line for line in out.splitlines()), out
    assert "experts: torch loop" in out and "gated_deltanet: torch chunked delta rule" in out
    assert "peak GiB" in out and "step s" in out
