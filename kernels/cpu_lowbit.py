"""Build, probe and call the CPU kernels (kernels/cpu/*.cpp): lesson 07's low-bit matmuls, lesson 06's native step.

torch's CPU int4/int8 kernels widen each weight to a float; these quantize the activations to int8 per block of 32
(as llama.cpp does) and take integer dot products on the packed bytes, one source built per instruction set (ISAS).
Built on first use and cached; built, imported and run first in a child process (a VM may hide a feature the CPU
lists; a killed link leaves a truncated library), so this process imports only a library a child ran. None loads:
`load()` is None, `status()` says why, torch's kernels stay. MINILLM_CPU_KERNELS=off|<isa> forces a choice."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = ("bindings.cpp", "q4_1_matmul.cpp", "int8_matmul.cpp", "int8_kv_attention.cpp", "native_step.cpp",
           "f32_matmul.cpp", "codebook_matmul.cpp")

# instruction set -> (cpu flags it needs, compiler flags), best first
ISAS = {
    "avx512-vnni": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                    ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
    "avx-vnni": (("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "neon-dotprod": (("asimddp",), ("-march=armv8.2-a+dotprod",)),
    "scalar": ((), ()),
}
ENV = "MINILLM_CPU_KERNELS"

_status = "not loaded yet"
_module = None  # the loaded extension, once load() found one


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them ("flags" on x86, "Features" on ARM); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The instruction sets this CPU lists, best first (the order `load` tries them)."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa, (needs, _) in ISAS.items() if all(f in flags for f in needs)]


def status() -> str:
    """One line: which kernels the quantized layers use here, or why they fall back to torch's."""
    return _status


def _build_root() -> Path:
    """torch.utils.cpp_extension.get_default_build_root(), without importing cpp_extension (it imports setuptools:
    ~0.2 s of every load that finds its library built; a test holds the two equal)."""
    import torch._appdirs

    return Path(os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions")))


def _build_folder(isa: str) -> Path:
    return _build_root() / f"minillm_lowbit_{isa.replace('-', '_')}"


def describe() -> str:
    """status() if the kernels were loaded in this process, else what load() would find, without building anything
    (for `minillm info`)."""
    if _status != "not loaded yet" or os.environ.get(ENV, "auto") != "auto":
        return status()
    for isa in supported_isas():
        if (_build_folder(isa) / "probe-ok").exists():  # probed at least once (a rebuild is probed again on load)
            return f"{isa} (built and probed on this machine; used by q4/int8 models)"
    best = supported_isas()[0]
    return f"{best} (this CPU's best set; compiled on first use of a q4/int8 model, ~40 s once on 2 cores)"


def _say(line: str) -> None:
    print(f"minillm: {line}", file=sys.stderr, flush=True)


# -fno-trapping-math: nothing here unmasks floating-point exceptions, and without it GCC keeps a select such as exp's
# clamp as a branch, which stops it vectorizing the native step's SiLU loop
CFLAGS = ("-O3", "-fopenmp", "-fno-trapping-math")


def _digest() -> str:
    """The sources', headers' and common flags' digest: a build (and its probe) stands for exactly these."""
    sources = b"".join(f.read_bytes() for f in sorted(SOURCE_DIR.glob("*.[ch]*")))
    return hashlib.sha256(sources + " ".join(CFLAGS).encode()).hexdigest()[:16]


def _library(folder: Path) -> Path | None:
    found = sorted(folder.glob(f"{folder.name}*.so"))
    return found[0] if found else None


def _build(isa: str):
    """torch's cpp_extension build (a no-op when up to date) and import, under a lock the kernel releases when its
    holder dies: a build killed mid-way (SIGTERM, SIGKILL) leaves torch's own lock file behind, which would make every
    later build wait on it forever; holding ours, no one else is building, so a leftover one is stale."""
    import fcntl

    from torch.utils.cpp_extension import load

    folder = _build_folder(isa)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "minillm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "lock").exists():
            _say(f"removing a stale build lock left by a killed build in {folder}")
            (folder / "lock").unlink()
        if _library(folder) is None:
            _say(f"compiling the CPU low-bit kernels for {isa} (once per machine, ~30-60 s) into {folder}")
        # torch rebuilds when the sources or the flags change; the headers count through this digest in the flags
        return load(name=folder.name, sources=[str(SOURCE_DIR / s) for s in SOURCES], build_directory=str(folder),
                    extra_cflags=[*CFLAGS, f"-DMINILLM_SOURCES={_digest()}", *ISAS[isa][1]],
                    extra_ldflags=["-fopenmp"], extra_include_paths=[str(SOURCE_DIR)], verbose=False)


# Run in a child: build (if needed), import, and run every kernel on a small case against its plain reference loop.
_PROBE = """
import torch
from minillm_kernels import cpu_lowbit
from minillm_kernels.cpu_lowbit import repack_int8, repack_q4_1
k = cpu_lowbit._build({isa!r})
x, r = torch.randn(3, 64), k.rows
codes = torch.randint(0, 16, (40, 64), dtype=torch.uint8)
packed = repack_q4_1(codes, torch.rand(40, 2).half(), torch.randn(40, 2).half(), r)
a, b = k.q4_1_matmul(x, packed, 40, False), k.q4_1_matmul(x, packed, 40, True)
packed = repack_int8(torch.randint(-127, 128, (40, 64), dtype=torch.int8), torch.rand(40), r)
c, d = k.int8_matmul(x, packed, 40, False), k.int8_matmul(x, packed, 40, True)
assert torch.allclose(a, b, rtol=1e-4, atol=1e-3) and torch.allclose(c, d, rtol=1e-4, atol=1e-3)
pool, scales = torch.randint(-127, 128, (2, 4, 1, 16), dtype=torch.int8), torch.rand(2, 4, 1).half()
o = k.paged_int8_decode(torch.randn(1, 2, 16), pool, scales, pool, scales, torch.tensor([[1, 0]], dtype=torch.int32),
                        torch.tensor([7], dtype=torch.int32), 0.25)
assert o.shape == (1, 2, 16) and bool(o.isfinite().all())
print("ok")
"""


def _run_child(isa: str) -> str | None:
    """Build, import and run the kernels for `isa` in a child process; None when it worked. An instruction the CPU
    (or its VM) does not execute, or a truncated library (a kill during the link, a full disk: SIGBUS in dlopen),
    kills the child, never this process: the parent imports only a library a child has run."""
    code = _PROBE.format(isa=isa)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return "the build and probe took over 30 minutes"
    if done.returncode == 0 and "ok" in done.stdout:
        return None
    why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    return f"the probe failed ({why}): {(done.stderr or done.stdout).strip()[-200:]}"


def _probed_marker(library: Path) -> str:  # these sources, this very file, this torch (the library links to it)
    return f"{_digest()} {library.stat().st_mtime_ns} {torch.__version__}"


def _import_probed(isa: str):
    """The library of `isa` if a child already ran this very build (the probe's marker matches), imported directly:
    no compiler, ninja or cpp_extension on a load that has nothing to build. None otherwise."""
    import importlib.util

    folder = _build_folder(isa)
    library, marker = _library(folder), folder / "probe-ok"
    if library is None or not marker.exists() or marker.read_text().strip() != _probed_marker(library):
        return None
    spec = importlib.util.spec_from_file_location(folder.name, library)  # the name its PyInit_ symbol carries
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checked(isa: str) -> str | None:
    """None when `isa`'s library (for these sources) was built and ran in a child, building and running it there if
    needed; a library that kills its child is deleted and built once more (it may be a truncated file)."""
    folder = _build_folder(isa)
    marker = folder / "probe-ok"
    library = _library(folder)
    if library is not None and marker.exists() and marker.read_text().strip() == _probed_marker(library):
        return None
    problem = _run_child(isa)
    if problem is not None and "(signal" in problem and _library(folder) is not None:
        _say(f"{isa}: the built library crashed its probe ({problem[:60]}); deleting it and building it once more")
        for f in folder.glob("*.so"):
            f.unlink()
        problem = _run_child(isa)
    if problem is None and (library := _library(folder)) is not None:
        marker.write_text(_probed_marker(library) + "\n")
    return problem


@functools.lru_cache(maxsize=None)
def load():
    """The compiled kernel module for the best instruction set that builds and passes the probe, or None."""
    global _status, _module
    _module = None
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced == "off":
        _status = f"off ({ENV}=off): quantized layers use torch's int4/int8 kernels (bf16 activations)"
        return None
    if forced != "auto" and forced not in ISAS:
        raise ValueError(f"{ENV}={forced!r} is not one of off, auto, {', '.join(ISAS)}")
    candidates = [forced] if forced != "auto" else supported_isas()
    if (module := _import_probed(candidates[0])) is not None:  # the common case: built and probed before
        _status = f"{module.isa} ({platform.machine()}): weights int4/int8, activations int8 per block of 32"
        _module = module
        return module
    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        _status = ("off: no C++ compiler found (install g++ or clang, e.g. `apt install g++`); quantized layers use "
                   "torch's int4/int8 kernels (bf16 activations)")
        _say(_status)
        return None
    if not is_ninja_available():
        _status = ("off: ninja not found (`pip install ninja`, then restart); quantized layers use torch's int4/int8 "
                   "kernels (bf16 activations)")
        _say(_status)
        return None
    failures = []
    for isa in candidates:
        problem = _checked(isa)  # built and run in a child first: an illegal instruction kills the child, not us
        if problem is None:
            try:
                module = _build(isa)  # up to date: torch only imports it
            except Exception as err:  # a compiler or ninja error: say it, try the next set down
                problem = f"build failed ({str(err).strip().splitlines()[-1][:160] if str(err) else err!r})"
        if problem is None:
            _status = f"{module.isa} ({platform.machine()}): weights int4/int8, activations int8 per block of 32"
            if failures:
                _status += " (after " + "; ".join(failures) + ")"
                _say(_status)
            _module = module
            return module
        failures.append(f"{isa}: {problem}")
    _status = "off: " + "; ".join(failures) + " -- quantized layers use torch's int4/int8 kernels"
    _say(_status)
    return None


# ----------------------------------------------------------------------------------------- the repacked layouts

BLOCK = 32  # inputs per scale


def rows_per_group() -> int:
    """Weight rows per repacked group: one per lane of the loaded build's vectors (16 with AVX-512, else 8)."""
    return _module.rows if _module is not None else 8


def layout_id() -> str:
    """Names the repacked layouts the loaded build reads: its rows per group and the repack code (a cache of them,
    minillm.gguf.converted, stands for this id only)."""
    import inspect

    code = "".join(inspect.getsource(f) for f in (_pad_rows, _by_group, repack_q4_1, repack_int8))
    return f"{rows_per_group()} rows, repack {hashlib.sha256(code.encode()).hexdigest()[:16]}"


def _pad_rows(a: np.ndarray, groups: int, rows: int) -> np.ndarray:
    pad = groups * rows - a.shape[0]
    return np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a


def _by_group(a: np.ndarray, groups: int, rows: int, blocks: int) -> np.ndarray:
    """Per-row per-block values (N, K/32) -> their bytes (groups, blocks, R * itemsize), row r's value in lane r."""
    return np.ascontiguousarray(_pad_rows(a, groups, rows).reshape(groups, rows, blocks).transpose(0, 2, 1)).view(
        np.uint8)


# The repacks run once per layer at the first call, in numpy: the same permutes in torch's CPU byte ops took ~40x
# longer (80 ms for one 1536 x 576 layer, seconds for a model).

def repack_q4_1(codes: Tensor, scale: Tensor, minimum: Tensor, rows: int | None = None) -> Tensor:
    """Q4_1 codes uint8 (N, K) in 0..15, scale/minimum fp16 (N, K/32) -> uint8 (ceil(N/R), K/32, 20 * R), R = rows
    (default: the loaded build's). For each group of R rows and block of 32 inputs: d[R] fp16, m[R] fp16, then 4
    chunks of 4 * R bytes whose lane r (4 bytes) holds row r's codes 4c..4c+3 (low nibbles) and 16+4c..16+4c+3 (high
    nibbles) in chunk c. See q4_1_matmul.cpp."""
    rows = rows or rows_per_group()
    c = codes.to(torch.uint8).cpu().numpy()
    n, k = c.shape
    groups, blocks = -(-n // rows), k // BLOCK
    # element of a block = 16 * half + 4 * chunk + byte
    c = _pad_rows(c, groups, rows).reshape(groups, rows, blocks, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)
    nibbles = (c[..., 0] | (c[..., 1] << 4)).reshape(groups, blocks, 16 * rows)  # (group, block, chunk, row, byte)
    d, m = (_by_group(t.half().cpu().numpy(), groups, rows, blocks) for t in (scale, minimum))
    return torch.from_numpy(np.concatenate([d, m, nibbles], axis=-1))


def repack_q4_1_packed(packed: Tensor, scale: Tensor, minimum: Tensor, rows: int | None = None) -> Tensor:
    """repack_q4_1 of codes stored two per byte (pack_int4's layout: uint8 (N, K/2), column 2j low, 2j+1 high)."""
    p = packed.cpu().numpy()
    codes = np.empty((p.shape[0], 2 * p.shape[1]), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = p & 0x0F, p >> 4
    return repack_q4_1(torch.from_numpy(codes), scale, minimum, rows)


def unrepack_q4_1(packed: Tensor, n: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of repack_q4_1: the kernel layout uint8 (groups, K/32, 20 * R) of an (n, k) weight -> (codes in
    pack_int4's layout uint8 (n, k/2), scale fp16 (n, k/32), minimum fp16 (n, k/32)). For a layer that keeps only
    this layout: its codes and scales are derived when something other than the kernel asks for them."""
    p = packed.cpu().numpy()
    groups, blocks, width = p.shape
    rows = width // 20

    def per_row(b: np.ndarray) -> Tensor:  # (groups, blocks, R * 2 bytes) -> fp16 (n, blocks)
        h = np.ascontiguousarray(b).view(np.float16).reshape(groups, blocks, rows).transpose(0, 2, 1)
        return torch.from_numpy(np.ascontiguousarray(h.reshape(groups * rows, blocks)[:n]))

    nib = p[..., 4 * rows:].reshape(groups, blocks, 4, rows, 4)  # (group, block, chunk, row, byte)
    c = np.stack([nib & 0x0F, nib >> 4], axis=-1)  # (..., half): element 16 * half + 4 * chunk + byte of a block
    codes = c.transpose(0, 3, 1, 5, 2, 4).reshape(groups * rows, k)[:n]  # (group, row, block, half, chunk, byte)
    return (torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4)), per_row(p[..., :2 * rows]),
            per_row(p[..., 2 * rows:4 * rows]))


def repack_int8(q: Tensor, scale: Tensor, rows: int | None = None) -> Tensor:
    """int8 weights (N, K) with a float scale per row (N,) or per block (N, K/32) -> uint8 (ceil(N/R), K/32, 36 * R):
    for each group of R rows and block, scale[R] float32, then 8 chunks of 4 * R bytes whose lane r holds row r's
    weights 4j..4j+3 (chunk j). See int8_matmul.cpp."""
    rows = rows or rows_per_group()
    w = q.cpu().numpy()
    n, k = w.shape
    groups, blocks = -(-n // rows), k // BLOCK
    s = scale.float().cpu().numpy()
    s = np.broadcast_to(s[:, None], (n, blocks)) if s.ndim == 1 else s
    s = _by_group(s, groups, rows, blocks)
    w = _pad_rows(w, groups, rows).reshape(groups, rows, blocks, 8, 4).transpose(0, 2, 3, 1, 4)  # (group, block,
    w = np.ascontiguousarray(w).view(np.uint8).reshape(groups, blocks, 32 * rows)               # chunk, row, byte)
    return torch.from_numpy(np.concatenate([s, w], axis=-1))


def int8_rows(packed: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Rows `rows` of an (n, k) weight kept as repack_int8's layout: (int8 weights (len, k), float32 scale per block
    (len, k/32)). What a tied embedding reads for a few token ids, without a second copy of the stored codes."""
    p = packed.cpu().numpy()
    width = p.shape[2]
    r = width // 36
    idx = rows.cpu().numpy()
    groups, lanes = idx // r, idx % r
    sel = p[groups]  # (len, blocks, 36 R)
    n_ids, blocks = sel.shape[0], sel.shape[1]
    scales = np.ascontiguousarray(sel[..., :4 * r]).view(np.float32).reshape(n_ids, blocks, r)
    w = sel[..., 4 * r:].reshape(n_ids, blocks, 8, r, 4)  # (id, block, chunk, lane, byte)
    take = np.arange(n_ids)
    q = w[take, :, :, lanes, :].reshape(n_ids, k).view(np.int8)
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(scales[take, :, lanes].copy())


def int8_embedding(packed: Tensor, ids: Tensor, n: int, k: int) -> Tensor:
    """Rows `ids` (any shape) of an (n, k) weight kept as repack_int8's layout, as float32 (*ids.shape, k): scale *
    code per block. One C++ call (the embedding lookup of every q4 decode step) where the module is loaded; the same
    floats by int8_rows' numpy indexing where it is not (cpu_kernels_disabled) or under torch.compile (dynamo traces
    numpy, not a C++ call). An id outside [0, n) raises RuntimeError either way."""
    if _module is not None and not torch.compiler.is_compiling():
        return _module.int8_embedding(packed, ids, n, k)
    flat = ids.reshape(-1)
    if flat.numel() and not torch.compiler.is_compiling() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        bad = int(flat.min()) if int(flat.min()) < 0 else int(flat.max())
        raise RuntimeError(f"token ids must be in [0, {n}), got {bad}")
    q, s = int8_rows(packed, flat, k)
    return (q.float() * s.repeat_interleave(BLOCK, dim=-1)).reshape(*ids.shape, k)


def unrepack_int8(packed: Tensor, n: int, k: int) -> tuple[Tensor, Tensor]:
    """The inverse of repack_int8: (int8 weights (n, k), float32 scale per block (n, k/32))."""
    return int8_rows(packed, torch.arange(n), k)


# ----------------------------------------------------------------------------------------- the calls

def q4_1_matmul(x: Tensor, packed: Tensor, n: int, reference: bool = False) -> Tensor:
    """x (..., K) @ W.T -> (..., n) in x's dtype, W given as repack_q4_1(...). `load()` must have returned a module;
    reference=True runs the plain C++ loops (the scalar reference) instead of the SIMD ones."""
    return _module.q4_1_matmul(x, packed, n, reference)


def int8_matmul(x: Tensor, packed: Tensor, n: int, reference: bool = False) -> Tensor:
    """x (..., K) @ W.T -> (..., n) in x's dtype, W given as repack_int8(...)."""
    return _module.int8_matmul(x, packed, n, reference)


def f32_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) float32 @ w.T -> (..., N), w a float32 (N, K) weight as it lies (f32_matmul.cpp): each output's
    sum in one order whatever the other rows and the threads, so a row's result does not depend on its batch."""
    if _module is None:
        raise RuntimeError(f"the CPU kernels are not loaded ({status()}): call load() first")
    return _module.f32_matmul(x, w)


def codebook_matmul(x: Tensor, codes: Tensor, tables: Tensor, bits: int, k: int) -> Tensor:
    """x (..., k) float32 @ W.T -> (..., N), W a shared-codebook weight as CodebookLinear holds it: codes uint8
    (N, ceil(k / 8) * bits) from pack_codes, tables float32 (groups of rows, 2**bits); bits 3 or 4. The table
    lookup happens in registers (codebook_matmul.cpp): a token reads the packed codes, not a dense weight."""
    if _module is None:
        raise RuntimeError(f"the CPU kernels are not loaded ({status()}): call load() first")
    return _module.codebook_matmul(x, codes, tables, bits, k)


def paged_int8_decode(q: Tensor, k_pool: Tensor, k_scale: Tensor, v_pool: Tensor, v_scale: Tensor,
                      block_tables: Tensor, context_lens: Tensor, scale: float | None = None) -> Tensor:
    """Decode attention straight from one layer of an int8 KVBlockPool (int8_kv_attention.cpp): no float copy of the
    context. q (n, n_heads, head_dim) float32 or bfloat16, one query per sequence; k_pool/v_pool (num_blocks,
    block_size, n_kv_heads, head_dim) int8 and k_scale/v_scale (num_blocks, block_size, n_kv_heads) float16, i.e.
    pool.k[layer], pool.k_scale[layer], ...; block_tables (n, max_blocks) int, entries past a sequence's blocks may be
    -1; context_lens (n,) int; scale: the softmax scale (default head_dim ** -0.5). Query head h reads KV head
    h // group. Returns (n, n_heads, head_dim) in q's dtype. Bad shapes or dtypes raise RuntimeError (the C++ checks
    name the problem)."""
    if _module is None:
        raise RuntimeError(f"the CPU kernels are not loaded ({status()}): call load() first or use the gather path")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _module.paged_int8_decode(q, k_pool, k_scale, v_pool, v_scale, block_tables, context_lens, scale)


# The same two matmuls as torch operators, for torch.compile (lesson 06): dynamo cannot trace into a C++ function, but
# it can call an operator that says what shape it returns; inductor then fuses everything around the matmuls. In
# eager mode the layers call the functions above directly (an operator adds ~10 µs of dispatch per call).
@torch.library.custom_op("minillm::q4_1_matmul", mutates_args=())
def q4_1_matmul_op(x: Tensor, packed: Tensor, n: int) -> Tensor:
    return _module.q4_1_matmul(x, packed, n, False)


@q4_1_matmul_op.register_fake
def _(x: Tensor, packed: Tensor, n: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op("minillm::int8_matmul", mutates_args=())
def int8_matmul_op(x: Tensor, packed: Tensor, n: int) -> Tensor:
    return _module.int8_matmul(x, packed, n, False)


@int8_matmul_op.register_fake
def _(x: Tensor, packed: Tensor, n: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], n))


if __name__ == "__main__":  # python -m minillm_kernels.cpu_lowbit: build, probe, say what loaded
    torch.set_num_threads(1)
    load()
    print(status())
