"""Colocated weights through POSIX shared memory (``schedule.weight_sync: shared_memory``, the cpu target).

The trainer rank that writes for a node's engines (`host_moves`) copies the gathered weights, each tensor at its
offset, into one segment in that node's /dev/shm (POSIX shared memory on Linux: ``shm_open`` names live there);
the engines' workers map the segment and hand views of it to the same reload as every other path
(`WeightSyncExtension._rlc_reload`), so the one copy after the gather is into the engine's parameters. The
``inplace`` path it replaces writes a safetensors file (serialise, write, open, parse, copy) for the same bytes.

Both sides derive the layout (`segment_layout`: offsets in the announced order, each aligned) from the sync's
``(name, shape, dtype)`` list, so only a path and that list travel through Ray. The segment's name carries a
digest of the layout: it is created once and rewritten in place at every sync while the layout holds (no
allocation per step), and a reader never maps another layout's bytes. A header records the policy version the
bytes hold, set only after they are complete; a worker asked for another version refuses instead of loading
whatever is there. Space is reserved when the segment is made, so a full /dev/shm is a clear error, not a SIGBUS
in the middle of a copy.

Cleanup: the segment lives in the writer's folder, which the run removes at its end, after a failure too (the
controller's `close`), and when an engine restart leaves that rank with no engine to write for. A run killed
before that leaves its folder; the next run on the same run directory removes such folders on each writer's node
when its writer first writes (`host_moves.stale_glob`), and a leftover that holds the very name it wants is taken over
(resized, its version cleared) rather than trusted.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import hashlib
import mmap
import os
import shutil
import struct
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "HEADER_BYTES",
    "SharedWeightsExtension",
    "SharedWeightsWriter",
    "segment_layout",
    "segment_name",
]

TensorMeta = tuple[str, tuple[int, ...], str]

#: Bytes before the first tensor: magic, the policy version held, the layout's size and digest.
HEADER_BYTES = 4096
#: Every tensor starts at a multiple of this (views of any dtype are aligned; cache lines are not shared).
ALIGN = 64
MAGIC = b"RLCSHMW1"
_HEADER = struct.Struct("<8sqq40s")  # magic, version (-1 while writing), data bytes, layout digest


def _itemsize(dtype: str) -> int:
    from .torch_dtypes import dtype_from_str

    return dtype_from_str(dtype).itemsize


def segment_layout(meta: Sequence[TensorMeta]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the segment (in ``meta``'s order, after the header) and the segment's size."""
    offsets, end = [], HEADER_BYTES
    for _, shape, dtype in meta:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += _numel(shape) * _itemsize(dtype)
    return offsets, -(-end // ALIGN) * ALIGN


def layout_digest(meta: Sequence[TensorMeta]) -> str:
    """40 hex digits naming the layout: the names, shapes and dtypes in order."""
    text = "\n".join(f"{n}|{','.join(map(str, s))}|{str(d).removeprefix('torch.')}" for n, s, d in meta)
    return hashlib.sha1(text.encode()).hexdigest()


def segment_name(folder: str, meta: Sequence[TensorMeta]) -> str:
    """The segment's path in a writer's folder: named by its layout, so it is reused while the layout holds."""
    return str(Path(folder) / f"weights-{layout_digest(meta)[:16]}.shm")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def remove_stale(pattern: str, keep: str) -> list[str]:
    """Remove the folders matching ``pattern`` other than ``keep``: what earlier runs on this run directory left on
    this node (the run directory's lock keeps two live runs off one directory). Returns the removed paths."""
    removed = []
    for path in sorted(glob.glob(pattern)):
        if os.path.abspath(path) != os.path.abspath(keep):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class SharedWeightsWriter:
    """A trainer rank's segment: made on the first write (or when the layout changes), rewritten in place after."""

    def __init__(self, folder: str, stale: str | None = None) -> None:
        """``stale``: a glob of earlier runs' folders to remove from this node before the first write."""
        self.folder = folder
        self.path: str | None = None
        self.version: int | None = None
        self._map: mmap.mmap | None = None
        self._inode = -1
        self._bytes: torch.Tensor | None = None
        self.removed = remove_stale(stale, folder) if stale else []  # what earlier runs left, for the record
        atexit.register(self.close)

    def write(self, weights: Mapping[str, torch.Tensor], meta: Sequence[TensorMeta], version: int) -> str:
        """Copy ``weights`` into the segment in ``meta``'s layout (cast to its dtypes) and stamp ``version`` once
        every byte is there; returns the segment's path."""
        meta = [(n, tuple(s), str(d)) for n, s, d in meta]
        offsets, size = segment_layout(meta)
        path = segment_name(self.folder, meta)
        if path != self.path or self._map is None or len(self._map) != size or not self._still_there():
            self._open(path, size)
        assert self._map is not None and self._bytes is not None
        digest = layout_digest(meta).encode()
        self._map[: _HEADER.size] = _HEADER.pack(MAGIC, -1, size, digest)
        self.version = None
        for (name, shape, dtype), offset in zip(meta, offsets, strict=True):
            tensor = weights.get(name)
            if tensor is None:
                raise KeyError(f"{name}: announced for the sync but not among the trainer's weights")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from announced {shape}")
            _view(self._bytes, offset, shape, dtype).copy_(tensor.detach())
        self._map[: _HEADER.size] = _HEADER.pack(MAGIC, int(version), size, digest)
        self.version = int(version)
        return path

    def _still_there(self) -> bool:
        """Whether the segment mapped is still the file at its path (a folder removed under a live writer, by a
        cleanup, must not leave it writing into a file no engine can open)."""
        try:
            return os.stat(str(self.path)).st_ino == self._inode
        except FileNotFoundError:
            return False

    def _open(self, path: str, size: int) -> None:
        """Map ``path`` at ``size`` bytes, space reserved; a leftover under that name is taken over, not trusted."""
        self._release(unlink=self.path is not None and self.path != path)
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.close(fd)
                fd = -1
                Path(path).unlink(missing_ok=True)
                raise OSError(
                    exc.errno,
                    f"cannot reserve {size / 2**30:.2f} GiB of shared memory for the colocated weights in {path} "
                    f"({exc.strerror}): mount a larger /dev/shm (in Kubernetes an emptyDir with medium: Memory), or "
                    "compile with rollout.weight_sync: disk",
                ) from None
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._inode = os.fstat(fd).st_ino
        finally:
            if fd >= 0:
                os.close(fd)
        self._map[: _HEADER.size] = _HEADER.pack(MAGIC, -1, size, b"\0" * 40)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.path = path

    def _release(self, unlink: bool) -> None:
        self._bytes = None
        mapping, self._map = self._map, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                mapping.close()
        if unlink and self.path is not None:
            Path(self.path).unlink(missing_ok=True)
        self.version = None

    def close(self) -> None:
        """Unmap and remove the segment and its folder (idempotent; also run at process exit)."""
        self._release(unlink=True)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.path = None
        atexit.unregister(self.close)


def _view(buffer: torch.Tensor, offset: int, shape: Sequence[int], dtype: str) -> torch.Tensor:
    from .torch_dtypes import dtype_from_str

    dt = dtype_from_str(dtype)
    return buffer[offset : offset + _numel(shape) * dt.itemsize].view(dt).view(tuple(shape))


def read_header(buffer: Any) -> tuple[int, int, str]:
    """(version, data bytes, layout digest) from a segment's first bytes; ValueError if it is not one."""
    if len(buffer) < _HEADER.size or _HEADER.unpack_from(buffer, 0)[0] != MAGIC:
        raise ValueError("not an rlc shared-memory weight segment (another program's file under rlc's name?)")
    _, version, size, digest = _HEADER.unpack_from(buffer, 0)
    return int(version), int(size), digest.decode(errors="replace")


class SharedWeightsExtension:
    """Worker-extension methods (mixed into `WeightSyncExtension`, driven by ``collective_rpc``); ``self`` is vLLM's
    worker. The mapping is kept between syncs (the writer rewrites the same segment), so a sync faults no pages in;
    it is replaced when the segment at the path is another file."""

    def load_from_shared_memory(self, path: str, meta: Sequence[TensorMeta], version: int) -> int:
        """Reload every weight from the segment at ``path`` (laid out by ``meta``), which must hold ``version``;
        returns the tensor count."""
        meta = [(n, tuple(s), str(d)) for n, s, d in meta]
        mapping, buffer = self._rlc_shm_map(path)
        held, size, digest = read_header(mapping)
        if held < 0:
            raise RuntimeError(f"the shared-memory segment {path} holds an unfinished write, not version {version}")
        offsets, want = segment_layout(meta)
        if digest != layout_digest(meta) or size != want or buffer.numel() != want:
            raise RuntimeError(
                f"the shared-memory segment {path} holds another layout than the sync announced (a segment of another "
                "run or model under this name): the trainer rewrites it at the next sync"
            )
        if held != int(version):
            raise RuntimeError(f"the shared-memory segment {path} holds version {held}, not version {version}")

        def views() -> Iterator[tuple[str, torch.Tensor]]:
            for (name, shape, dtype), offset in zip(meta, offsets, strict=True):
                yield name, _view(buffer, offset, shape, dtype)

        self._rlc_reload(views())  # type: ignore[attr-defined]
        return len(meta)

    def _rlc_shm_map(self, path: str) -> tuple[mmap.mmap, torch.Tensor]:
        """The segment at ``path`` mapped read-only, and as one byte tensor; mapped once per file."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no shared-memory weight segment at {path} on this engine's node: the trainer rank that writes for "
                "this node has not written it (an engine placed on another node than its writer?)"
            ) from None
        key = (path, st.st_dev, st.st_ino, st.st_size)
        cached = getattr(self, "_rlc_shm", None)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        self._rlc_shm = None  # the old mapping goes once its views do
        fd = os.open(path, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # Read-only on purpose: the reload only reads, and a loader that wrote would fault rather than corrupt
            # the bytes the node's other engines read.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self._rlc_shm = (key, mapping, buffer)
        return mapping, buffer
