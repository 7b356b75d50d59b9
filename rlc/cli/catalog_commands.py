"""Commands that list what rlc knows: the model catalog and the hardware targets."""

from __future__ import annotations

import sys

import typer

from rlc.cli.app import (
    TargetsOption,
    usage_error,
)


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A rich table on a terminal; tab-separated lines when piped, so nothing is truncated for grep or cut."""
    if not sys.stdout.isatty():
        for row in (header, *rows):
            typer.echo("\t".join(row))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def models() -> None:
    """List the model catalog (head counts are what TP, CP and EP degrees must divide)."""
    from rlc.schemas.registry import load_arch, model_ids

    rows = []
    for model_id in model_ids():
        arch = load_arch(model_id)
        moe = f"{arch.moe.num_experts}x top-{arch.moe.experts_per_token}" if arch.moe else "-"
        rows.append(
            (
                arch.id,
                f"{arch.params_b:g}",
                f"{arch.active_params_b:g}",
                str(arch.num_layers),
                str(arch.hidden_size),
                str(arch.num_attention_heads),
                str(arch.num_kv_heads),
                arch.attention.kind,
                moe,
                str(arch.mtp_layers),
            )
        )
    header = ("id", "params (B)", "active (B)", "layers", "hidden", "heads", "kv heads", "attention", "MoE", "MTP")
    _print_table(header, rows)


def targets(targets: TargetsOption = None) -> None:
    """List the hardware targets, and which profile compile would use for each (a calibrated one shadows the
    shipped one: --targets, RLC_TARGETS)."""
    from rlc.schemas.profiles import ProfileError, find_target, profile_files, target_dirs
    from rlc.schemas.registry import target_ids

    try:
        dirs = target_dirs(targets)
        ids = sorted({*target_ids(), *(p.stem for d in dirs for p in profile_files(d))})
        found = [find_target(target_id, dirs) for target_id in ids]
    except ProfileError as exc:
        raise usage_error(str(exc)) from None
    rows = [
        (
            t.id,
            t.chip,
            str(t.devices_per_node),
            f"{t.hbm_gib:g}",
            f"{t.usable_hbm_gib:g}",
            f"{t.bf16_tflops:g}",
            f"{t.hbm_bandwidth_gbps:g}",
            source,
        )
        for t, source in found
    ]
    header = ("id", "chip", "devices/node", "HBM GiB", "usable GiB", "bf16 TFLOPS", "HBM GB/s", "profile")
    _print_table(header, rows)
