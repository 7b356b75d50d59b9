"""Compile time against cluster size, and pruned-vs-exhaustive agreement on small cases.

Run: python benchmarks/compile_speed.py. Prints the seconds for `build_plan` at 8 to 1,024 devices for dense
(qwen3-8b, qwen3-32b) and MoE (qwen3-235b-a22b, deepseek-v3) models as ratios to the 8-device case, then
whether the pruned search picks the same layout as the exhaustive one.
"""

from __future__ import annotations

import time

from rlc.compiler import search
from rlc.compiler.planner import build_plan
from rlc.compiler.validate import check_text

MODELS = ("qwen3-8b", "qwen3-32b", "qwen3-235b-a22b", "deepseek-v3")
NODES = (1, 4, 16, 64, 128)  # a2: 8 devices per node
SMALL = (("qwen3-1.7b", 1), ("qwen3-8b", 1), ("qwen3-8b", 2), ("qwen3-32b", 2), ("qwen3-30b-a3b", 1))


def problem(model: str, nodes: int, target: str = "a2"):  # type: ignore[no-untyped-def]
    text = (
        f"name: bench\nmodel: {{name: {model}, path: /m}}\ncluster: {{nodes: {nodes}}}\ndata: {{train: arithmetic}}\n"
    )
    return check_text(text, target=target).problem


def timed(model: str, nodes: int, repeat: int = 3) -> tuple[float, bool]:
    p = problem(model, nodes)
    best = float("inf")
    ok = False
    for _ in range(repeat):
        start = time.perf_counter()
        plan, _ = build_plan(p)
        best = min(best, time.perf_counter() - start)
        ok = plan is not None
    return best, ok


def main() -> None:
    print("compile time (s) and ratio to the smallest cluster with a plan; '-' = no plan fits")
    print(f"{'model':18s}" + "".join(f"{n * 8:>16d}" for n in NODES))
    for model in MODELS:
        row, base = [], None
        for nodes in NODES:
            seconds, ok = timed(model, nodes)
            if ok and base is None:
                base = seconds
            row.append(f"{seconds:7.3f} ({seconds / (base or seconds):4.1f}x)" if ok else f"{seconds:7.3f}    -   ")
        print(f"{model:18s}" + "".join(f"{c:>16s}" for c in row))
    print("\npruned vs exhaustive (a2)")
    for model, nodes in SMALL:
        target = "a3" if "30b" in model else "a2"
        p = problem(model, nodes, target)
        start = time.perf_counter()
        pruned = search.search(p)
        t_pruned = time.perf_counter() - start
        start = time.perf_counter()
        full = search.search(p, exhaustive=True)
        t_full = time.perf_counter() - start
        same = pruned.best is not None and full.best is not None and pruned.best.summary == full.best.summary
        print(
            f"  {model:14s} {nodes} node(s) {target}: {'same' if same else 'DIFFERENT'}  "
            f"pruned {t_pruned:.3f}s  exhaustive {t_full:.3f}s"
        )


if __name__ == "__main__":
    main()
