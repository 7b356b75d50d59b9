"""Target profiles from directories: calibrated profiles (`rlc calibrate -o DIR`) shadow the shipped ones.

`rlc compile --targets DIR` (repeatable) and the RLC_TARGETS environment variable (directories separated by
the OS path separator) name directories of `<target>.yaml` files in the shipped schema; the first directory
holding the spec's target wins, else the shipped profile is used. The plan records which one it was.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from rlc.schemas.registry import load_target
from rlc.schemas.target import TargetProfile

TARGETS_ENV = "RLC_TARGETS"
SHIPPED = "shipped"


class ProfileError(ValueError):
    """A profile file that does not parse or validate; the message names the file."""


def target_dirs(explicit: Sequence[str | Path] | None = None) -> list[Path]:
    """--targets directories first, then those in RLC_TARGETS; ProfileError for one that is not a directory.

    A mistyped calibration directory would otherwise fall back to the shipped profile without a word.
    """
    named = [(Path(d), "--targets") for d in explicit or []]
    env = os.environ.get(TARGETS_ENV, "")
    named += [(Path(d), TARGETS_ENV) for d in env.split(os.pathsep) if d]
    for directory, origin in named:
        if not os.path.isdir(directory):
            why = "is not a directory" if os.path.lexists(directory) else "does not exist"
            raise ProfileError(
                f"target profile directory {directory} (from {origin}) {why}: give the directory `rlc calibrate -o` "
                "wrote"
            )
    return [directory for directory, _ in named]


def read_profile(path: Path) -> TargetProfile:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        profile = TargetProfile.model_validate(data)
    except UnicodeDecodeError as exc:
        raise ProfileError(
            f"{path}: not a valid target profile: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start})"
        ) from None
    except (OSError, yaml.YAMLError, ValidationError, RecursionError) as exc:
        raise ProfileError(f"{path}: not a valid target profile: {exc}") from exc
    if profile.id != path.stem:
        raise ProfileError(f"{path}: id {profile.id!r} must equal the file name {path.stem!r}")
    return profile


def _calibrated(path: Path) -> bool:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and bool(data.get("calibration"))


def profile_files(directory: Path) -> list[Path]:
    """The `<target>.yaml` files of a profile directory (what `find_target` may read), sorted."""
    return sorted(p for p in directory.glob("*.yaml") if p.is_file())


def find_target(name: str, dirs: Sequence[Path] = ()) -> tuple[TargetProfile, str]:
    """The profile for target `name` and where it came from (a directory, or `shipped`)."""
    for d in dirs:
        path = d / f"{name.lower()}.yaml"
        if path.is_file():
            return read_profile(path), str(d)
    return load_target(name), SHIPPED


def profile_record(profile: TargetProfile, source: str) -> dict[str, str]:
    """What the plan records about the profile its estimates used."""
    digest = hashlib.sha256(profile.model_dump_json().encode()).hexdigest()
    return {"source": source, "sha256": digest, **{f"calibration.{k}": v for k, v in profile.calibration.items()}}


def write_profile(profile: TargetProfile, directory: Path, *, force: bool = False) -> Path:
    """Write `profile` as `<id>.yaml` in `directory` (the shipped schema, keys in schema order).

    An existing file is replaced only when `rlc calibrate` wrote it (it records its calibration) or `force`:
    a hand-tuned profile is never lost to a re-run (ProfileError)."""
    path = directory / f"{profile.id}.yaml"
    if path.exists() and not force and not _calibrated(path):
        raise ProfileError(
            f"{path} exists and is not a profile `rlc calibrate` wrote (no calibration record); choose another "
            "-o folder, or --force to replace it"
        )
    directory.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=110)
    path.write_text(text, encoding="utf-8")
    return path
