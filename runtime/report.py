"""`rlc report RUNDIR`: one self-contained HTML page (plus the PNGs) of a run, next to what the plan predicted.

It reads only the run directory (`metrics.jsonl`, and `plan.json` for the predictions), so it works on a
finished run, a stopped one or one still going. The charts are drawn with matplotlib (the optional
`rlc[report]` extra) and embedded in the page as data URIs, so the page can be mailed or attached to a CI run
as a single file.

Writes never follow a symbolic link: a `RUN/report` link, or a link in place of a file the report writes, is
refused before anything is drawn (someone else's `index.html` must not be overwritten through it), and each
file is written beside its name and renamed into place, which replaces a name rather than following it.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlc.runtime.errors import RunError, RunUsageError
from rlc.schemas.metrics_file import MetricsError, read_metrics_rows

#: (file stem, title, [(metric key, label)], y-axis label)
CHARTS: tuple[tuple[str, str, tuple[tuple[str, str], ...], str], ...] = (
    ("reward", "Reward", (("reward/mean", "mean"), ("reward/std", "std")), "reward"),
    ("response_len", "Response length", (("response_len/mean", "mean"),), "tokens"),
    (
        "importance_weight",
        "Behaviour importance weight",
        (("behave_imp_weight/mean", "mean"), ("behave_imp_weight/max", "max")),
        "weight",
    ),
    ("staleness", "Staleness", (("staleness/mean", "mean"), ("staleness/max", "max")), "policy versions"),
    ("entropy", "Entropy", (("entropy", "entropy"),), "nats per token"),
    (
        "time_split",
        "Time per step",
        (
            ("time/rollout_s", "rollout wait"),
            ("time/gather_s", "gather results"),
            ("time/reward_s", "reward"),
            ("time/batch_s", "build batch"),
            ("time/train_s", "training"),
            ("time/weight_sync_s", "weight sync"),
            ("time/overlap_s", "rollout under training"),
            ("time/step_s", "step"),
        ),
        "seconds",
    ),
    (
        "throughput",
        "Throughput",
        (("throughput/rollout_tokens_per_s", "rollout"), ("throughput/train_tokens_per_s", "trained")),
        "tokens / s",
    ),
)
#: Plan estimate → the measured metric it predicts.
PREDICTIONS: tuple[tuple[str, str, str], ...] = (
    ("step time (s)", "step_time_s", "time/step_s"),
    ("training (s)", "train_s", "time/train_s"),
    ("weight sync (s)", "weight_sync_s", "time/weight_sync_s"),
    ("trained tokens / s", "tokens_per_s", "throughput/train_tokens_per_s"),
)
#: Charts that show a plan estimate as a dashed line: stem → (estimate, label).
REFERENCES: dict[str, tuple[str, str]] = {
    "time_split": ("step_time_s", "planned step"),
    "throughput": ("tokens_per_s", "planned trained"),
}
#: The plan's estimates are for a warm run: the first steps (engine warm-up, compilation) are left out.
WARMUP_STEPS = 2


@dataclass
class Report:
    html: Path
    pngs: list[Path]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The step rows of metrics.jsonl (a last line cut off by a crash mid-write is skipped; any other line that is
    not a metrics object is a usage error naming the file and line)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise RunUsageError(f"{run_dir} has no metrics.jsonl: is it a run directory (the --run-dir of `rlc run`)?")
    try:
        rows = [row for row in read_metrics_rows(path) if "step" in row]
    except MetricsError as exc:
        raise RunUsageError(str(exc)) from None
    if not rows:
        raise RunError(f"{path} holds no steps yet: nothing to report")
    return rows


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(float(row["step"]))
            ys.append(float(value))
    return xs, ys


def _estimates(run_dir: Path) -> dict[str, float]:
    try:
        plan = json.loads((run_dir / "plan.json").read_text(encoding="utf-8"))
        return {k: float(v) for k, v in plan["estimates"].items() if isinstance(v, int | float)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _chart(
    rows: list[dict[str, Any]],
    title: str,
    series: tuple[tuple[str, str], ...],
    unit: str,
    reference: tuple[str, float] | None = None,
) -> bytes | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [(label, *_series(rows, key)) for key, label in series]
    drawn = [(label, xs, ys) for label, xs, ys in drawn if xs]
    if not drawn:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
    try:
        for label, xs, ys in drawn:
            ax.plot(xs, ys, label=label, linewidth=1.4)
        if reference is not None:
            ax.axhline(reference[1], linestyle="--", color="grey", linewidth=1.0, label=reference[0])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png", metadata={"Software": None})
        return out.getvalue()
    finally:
        plt.close(fig)


def _predictions(rows: list[dict[str, Any]], estimates: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """(what, predicted, measured median, measured / predicted) for each estimate the plan made."""
    warm = rows[WARMUP_STEPS:] or rows
    table = []
    for label, estimate, metric in PREDICTIONS:
        _, ys = _series(warm, metric)
        if estimate not in estimates or not ys:
            continue
        predicted, measured = estimates[estimate], statistics.median(ys)
        ratio = f"{measured / predicted:.2f}×" if predicted else "-"
        table.append((label, f"{predicted:,.4g}", f"{measured:,.4g}", ratio))
    return table


def _summary(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    first, last = rows[0], rows[-1]
    _, rewards = _series(rows, "reward/mean")
    tail = rewards[len(rewards) // 2 :]
    lines = [("steps", f"{int(first['step'])}–{int(last['step'])} ({len(rows)} rows)")]
    if rewards:
        lines.append(("reward/mean", f"first {rewards[0]:.3f}, last {rewards[-1]:.3f}, last-half mean "
                      f"{statistics.fmean(tail):.3f}"))  # fmt: skip
    _, failed = _series(rows, "reward/failed")
    if failed and sum(failed):
        lines.append(("reward/failed", f"{sum(failed):.0f} sample(s) scored 0 because the reward failed"))
    return lines


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def is_report_dir(folder: Path) -> bool:
    """Whether `folder` may take a report: new, empty, or holding an earlier one (its index.html is ours)."""
    if not folder.exists():
        return True
    if not folder.is_dir():
        return False
    if not any(folder.iterdir()):
        return True
    try:
        head = (folder / "index.html").read_text(encoding="utf-8", errors="replace")[:400]
    except OSError:
        return False
    return "<title>rlc run " in head


#: Every file a report writes into its folder.
REPORT_FILES: tuple[str, ...] = ("index.html", *(f"{stem}.png" for stem, *_ in CHARTS))


def _refuse_links(run_dir: Path, out: Path, default: bool) -> None:
    """RunError when writing the report into `out` would follow a symbolic link: `RUN/report` itself, a folder
    inside the run directory that leads out of it, or a link in place of one of the report's files."""
    if default and out.is_symlink():
        raise RunError(
            f"{out} is a symbolic link (to {os.readlink(out)}), not the run's report folder: rlc writes its report "
            "only inside the run directory; remove the link, or write elsewhere with -o"
        )
    run, dest = Path(os.path.abspath(run_dir)), Path(os.path.abspath(out))
    if dest.is_relative_to(run) and not dest.resolve().is_relative_to(run.resolve()):
        raise RunError(f"{out} leads out of the run directory {run_dir} through a symbolic link; remove the link")
    linked = [name for name in REPORT_FILES if (out / name).is_symlink()]
    if linked:
        raise RunError(
            f"{out / linked[0]} is a symbolic link (to {os.readlink(out / linked[0])}); the report would overwrite "
            "what it points to: remove the link"
        )


def _write_file(path: Path, data: bytes) -> None:
    """Write `data` to a new file beside `path` and rename it into place: never through a link at `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_report(run_dir: Path, out_dir: Path | None = None) -> Report:
    """Draw every chart the metrics allow, write the PNGs and `index.html` into `out_dir` (RUN/report)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RunUsageError("plots need matplotlib: install `rlc[report]`") from None
    rows = read_metrics(run_dir)
    out = out_dir or run_dir / "report"
    _refuse_links(run_dir, out, default=out_dir is None)
    out.mkdir(parents=True, exist_ok=True)
    estimates = _estimates(run_dir)
    pngs, figures = [], []
    for stem, title, series, unit in CHARTS:
        key, label = REFERENCES.get(stem, ("", ""))
        image = _chart(rows, title, series, unit, (label, estimates[key]) if key in estimates else None)
        if image is None:
            continue
        path = out / f"{stem}.png"
        _write_file(path, image)
        pngs.append(path)
        data = base64.b64encode(image).decode()
        figures.append(f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>')
    predictions = _predictions(rows, estimates)
    name = html.escape(run_dir.resolve().name)
    page = "\n".join(
        [
            "<!doctype html>",
            f'<html lang="en"><head><meta charset="utf-8"><title>rlc run {name}</title>',
            "<style>body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em}"
            "figure{display:inline-block;margin:.5em}img{max-width:640px}"
            "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;"
            "text-align:right}th{background:#f4f4f4}</style></head><body>",
            f"<h1>rlc run <code>{name}</code></h1>",
            _table(("", ""), _summary(rows)),
            "<h2>Plan vs measured</h2>",
            _table(("", "predicted", "measured (median)", "measured / predicted"), predictions)
            if predictions
            else "<p>No plan estimates to compare (plan.json missing or the metrics lack the timings).</p>",
            f"<p>Measured medians leave out the first {WARMUP_STEPS} steps (engine warm-up).</p>",
            "<h2>Charts</h2>",
            *figures,
            "</body></html>",
        ]
    )
    page_path = out / "index.html"
    _write_file(page_path, (page + "\n").encode("utf-8"))
    return Report(page_path, pngs)
