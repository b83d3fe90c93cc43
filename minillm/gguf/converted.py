"""A q4 model's weights in the CPU kernels' layout, cached beside its download (lesson 14's edge profile).

The kernels read each 4-bit layer (and the Q8_0 head) in their own layout (kernels/cpu_lowbit.py repack_*), which
a load builds from the file's blocks: numpy permutes over every weight, the load's largest cost once the kernels are
built. The first q4 load writes those layouts to one file beside the GGUF; later loads map it (torch.load with
mmap=True): no repack, and the weights are the page cache's pages, shared by every process serving the same model.
A cache stands for one source file, one layout (rows per group and the repack code) and one fusion; anything else,
or a file whose sha256 is not the one recorded, is rebuilt, never used. MINILLM_CONVERTED_CACHE=off skips it."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import Tensor

from minillm.gguf.weights import file_stamp, sha256_of

ENV = "MINILLM_CONVERTED_CACHE"


def enabled() -> bool:
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def converted_path(gguf: Path, layout: str, fused: bool) -> Path:
    tag = hashlib.sha256(f"{layout} {fused}".encode()).hexdigest()[:12]
    return gguf.with_name(f"{gguf.name}.kernels-{tag}.pt")


def read_converted(gguf: Path, source_sha256: str, layout: str, fused: bool) -> dict[str, Tensor] | None:
    """{module name: kernel layout} mapped from the cache, or None (no cache, another source or layout, damaged: a
    damaged one is deleted and says so)."""
    path = converted_path(gguf, layout, fused)
    meta_path = Path(f"{path}.json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if (meta.get("source_sha256"), meta.get("layout"), meta.get("fused")) != (source_sha256, layout, fused):
        return None
    try:
        if meta.get("stamp") != file_stamp(path):  # touched since it was hashed: hash it again
            if sha256_of(path) != meta.get("sha256"):
                raise ValueError("its sha256 is not the one recorded")
            meta["stamp"] = file_stamp(path)
            try:
                _write_text(meta_path, json.dumps(meta, indent=1) + "\n")
            except OSError:  # a read-only cache: hashed again next time, as weights.verify does
                pass
        return torch.load(path, mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 -- a cache is never worth a failed load: rebuild it
        print(f"minillm: the converted weights {path.name} are unusable ({type(e).__name__}: {e}); deleting them, "
              f"this load converts from the file and writes them again", file=sys.stderr)
        delete_converted(gguf, source_sha256, layout, fused)
        return None


def delete_converted(gguf: Path, source_sha256: str, layout: str, fused: bool) -> None:
    path = converted_path(gguf, layout, fused)
    for p in (path, Path(f"{path}.json")):
        try:
            p.unlink(missing_ok=True)
        except OSError:  # a read-only cache: it stays, and is refused again next time
            pass


def write_converted(gguf: Path, source_sha256: str, layout: str, fused: bool, layers: dict[str, Tensor]) -> None:
    """Write the layouts and then their meta (sha256, source, layout), each under a temporary name first: a crash
    leaves no cache, never a half one. A disk that refuses costs only the speed-up (said on stderr)."""
    path = converted_path(gguf, layout, fused)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:  # through a file object: the archive's inner name is fixed, so processes
            torch.save({name: t.contiguous() for name, t in layers.items()}, f)  # racing to write write equal bytes
        os.replace(tmp, path)
        meta = {"sha256": sha256_of(path), "source_sha256": source_sha256, "layout": layout, "fused": fused,
                "stamp": file_stamp(path)}
        _write_text(Path(f"{path}.json"), json.dumps(meta, indent=1) + "\n")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"minillm: could not cache the converted weights beside {gguf.name} ({e}); loads convert each time",
              file=sys.stderr)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
