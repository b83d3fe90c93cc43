"""What a measurement ran on: the machine's names, native bf16 or not, how busy it is, its *measured* roofs.

`hardware_info` measures memory bandwidth (`probe_bandwidth`) and matmul FLOP/s (`probe_matmul`), each probe
bounded in time: it starts small and grows only while the next size fits its budget (a CPU that emulates bf16
spends minutes on one large bf16 GEMM). `bandwidth`, the one roof the MBU of `minillm generate` needs, is
cached on disk per machine; `native_bf16` and `preferred_dtype` say whether bf16 pays here. Lesson 00 explains
the roofs; `minillm info` prints what this module detects.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from minillm.measure.metrics import timer

# ------------------------------------------------------------------------------------------------ the machine

_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 /proc/cpuinfo "flags"; aarch64 "Features" lists "bf16"


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is absent): the same list the CPU
    low-bit kernels pick their instruction set from."""
    from minillm_kernels.cpu_lowbit import cpu_flags as listed_flags

    return listed_flags()


def cpu_capability() -> str:
    """The vector ISA torch's CPU kernels were dispatched to (e.g. 'AVX2', 'AVX512', 'ZVECTOR', 'DEFAULT')."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def _mac_has_bf16() -> bool:
    try:
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                             timeout=2, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.strip() == "1"


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Does `device` compute bfloat16 matmuls in hardware? If not, torch emulates them and bf16 GEMMs are slow."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if sys.platform == "darwin":
        return _mac_has_bf16()
    return bool(cpu_flags() & set(_BF16_FLAGS))


def bf16_status(device: str | torch.device = "cpu") -> str:
    """One line: native or emulated bf16, and the evidence."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return "bf16: native" if native_bf16(dev) else "bf16: not supported by this GPU"
    if native_bf16(dev):
        found = sorted(cpu_flags() & set(_BF16_FLAGS)) or ["FEAT_BF16"]
        return f"bf16: native ({', '.join(found)}; torch kernels {cpu_capability()})"
    return (f"bf16: emulated (no avx512_bf16/amx_bf16 flag; torch kernels {cpu_capability()}): bf16 matmuls run "
            f"far slower than float32 here (lessons and benches use float32 where bf16 is not the point)")


def preferred_dtype(device: str | torch.device = "cpu") -> str:
    """'bfloat16' where the device computes it natively, else 'float32' (emulated bf16 GEMMs are tens of times
    slower)."""
    return "bfloat16" if native_bf16(device) else "float32"


def cpu_count() -> int:
    """Cores this process may run on (a container's affinity, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average (runnable processes, ours included once we run), None where unknown."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def threads_line(threads: int | None = None) -> str:
    """'2 threads, load 1.3 on 2 cores': print it with every measurement."""
    threads = threads or torch.get_num_threads()
    load = load_average()
    return f"{_threads(threads)}, load {'?' if load is None else f'{load:.1f}'} on {cpu_count()} cores"


def machine_line() -> str:
    """One line naming what computes this process's numbers, detected without timing anything: the GPU
    torch sees, else the CPU and torch's threads (lessons print it: minillm.course.lesson.hardware_line)."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return f"CPU {cpu_name()}, {_threads(torch.get_num_threads())}, torch {torch.__version__}"


def busy_warning(threads: int | None = None) -> str | None:
    """A warning when other work leaves fewer free cores than the threads torch will use, else None.

    With more threads than free cores torch's threads wait on each other (oneDNN's bf16 kernels spin-wait): a step
    can get many times slower, and timings mean little. Call it before the work starts, so the load is others'.
    """
    threads = threads or torch.get_num_threads()
    load = load_average()
    if load is None:
        return None
    free = cpu_count() - load
    if threads <= free + 0.5:  # half a core of slack: a load average is a smoothed count, never exact
        return None
    fewer = max(1, int(free + 0.5))
    return (f"warning: load average {load:.1f} on {cpu_count()} cores leaves ~{max(free, 0):.1f} free for "
            f"{_threads(threads)}: timings will be slow and noisy"
            + (f" (try --threads {fewer})" if fewer < threads else ""))


# ------------------------------------------------------------------------------------------------------ probes


def _bounded_best_rate(sizes: Sequence[int], make: Callable[[int], Callable[[], Any]], work: Callable[[int], float],
                       budget_s: float, max_calls: int = 6) -> float:
    """Best work/second of `make(n)()` over growing sizes `n`, within about `budget_s` seconds.

    Each size is timed up to `max_calls` times while the budget lasts (best of several: one busy moment must not set
    the roof); the next size is tried only if one call of it, predicted from this one by the work ratio, still fits.
    The first call of the first size always runs, so choose the smallest size cheap on any machine.
    """
    deadline = time.perf_counter() + budget_s
    best = 0.0
    for i, n in enumerate(sizes):
        fn = make(n)
        fastest = float("inf")
        for call in range(max_calls):
            with timer() as t:
                fn()
            fastest = min(fastest, t.seconds)
            best = max(best, work(n) / max(t.seconds, 1e-9))
            if call and time.perf_counter() + fastest > deadline:  # the first call is a warm-up: time one more
                break
        if i + 1 == len(sizes) or time.perf_counter() + fastest * work(sizes[i + 1]) / work(n) > deadline:
            break
    return best


def probe_bandwidth(device: str | torch.device = "cpu", budget_s: float = 0.5) -> float:
    """Bytes/s of a large tensor copy, counting the bytes read and the bytes written (best of a few, bounded)."""
    dev = torch.device(device)
    n_bytes = (1 << 30) if dev.type == "cuda" else (128 << 20)  # far larger than any cache

    def make(n: int):
        src = torch.ones(n // 4, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    return _bounded_best_rate([n_bytes], make, lambda n: 2 * n, budget_s)


def probe_matmul(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 budget_s: float = 2.0) -> float | None:
    """FLOP/s of n x n x n matmuls (2 n^3 FLOPs), n growing while it fits the budget; None if unsupported.

    On a CPU 1024 reaches only ~2/3 of the 2048 rate, so a fast machine should get to 2048; an emulating one stops
    at 256-512 (a 2048^3 bf16 matmul alone takes ~15 s there).
    """
    dev = torch.device(device)
    sizes = (1024, 2048, 4096, 8192) if dev.type == "cuda" else (256, 512, 1024, 2048)

    def make(n: int):
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        return lambda: a @ b

    try:
        return _bounded_best_rate(sizes, make, lambda n: 2 * n**3, budget_s)
    except (RuntimeError, TypeError):
        return None


# --------------------------------------------------------------------------------------- results, and caches

_HARDWARE: dict[str, dict] = {}  # device type -> hardware_info, measured once per process
_BANDWIDTH: dict[str, float] = {}  # device type -> bytes/s, from hardware_info or the disk cache


def hardware_info(device: str | torch.device = "cpu") -> dict:
    """Names, versions, bf16 support, load, and *measured* roofs of `device`; cached per process, bounded in time
    (~3-5 s at most on a CPU: bandwidth 0.5 s, each matmul dtype 2 s).

    Keys: device, cpu, gpu, threads, cpu_count, load_avg, cpu_capability, native_bf16, torch, python, platform,
    bandwidth_GBps (copy, read+write bytes), flops_float32 and flops_bfloat16 (FLOP/s; None where unsupported).
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("hardware_info(device='cuda') but torch sees no CUDA GPU; use device='cpu'")
    if dev.type not in _HARDWARE:
        load = load_average()  # before the probes add to it
        bandwidth = probe_bandwidth(dev)
        _HARDWARE[dev.type] = {
            "device": dev.type,
            "cpu": cpu_name(),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "threads": torch.get_num_threads(),
            "cpu_count": cpu_count(),
            "load_avg": load,
            "cpu_capability": cpu_capability(),
            "native_bf16": native_bf16(dev),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "bandwidth_GBps": bandwidth / 1e9,
            "flops_float32": probe_matmul(dev, torch.float32),
            "flops_bfloat16": probe_matmul(dev, torch.bfloat16),
        }
        _BANDWIDTH[dev.type] = bandwidth
        _save_bandwidth(dev, bandwidth)
    return dict(_HARDWARE[dev.type])


def _machine_key(dev: torch.device) -> str:
    # the bandwidth a probe sees depends on the machine, the device and the threads copying
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return f"{platform.node()}|{dev.type}|{name}|{cpu_capability()}|torch {torch.__version__}|" \
           f"{torch.get_num_threads()} threads"


def _bandwidth_file() -> Path:
    from minillm.gguf.weights import cache_dir

    return cache_dir() / "hardware.json"


def _load_bandwidths() -> dict:
    try:
        data = json.loads(_bandwidth_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_bandwidth(dev: torch.device, value: float) -> None:
    """Remember a measured bandwidth for this machine; never fails (a read-only cache just means re-probing)."""
    path = _bandwidth_file()
    data = _load_bandwidths()
    data[_machine_key(dev)] = {"bandwidth_GBps": value / 1e9,
                               "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one writer per name; os.replace is atomic
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


# `minillm generate`'s MBU needs only the bandwidth: kept on disk per machine, ordinary commands probe once.
# Benchmarks call hardware_info, which measures afresh in every process: their roofs belong to their run.
def bandwidth(device: str | torch.device = "cpu") -> float:
    """Measured memory bandwidth of `device`, bytes/s: this process's measurement if there is one, else this
    machine's from the disk cache, else a new bounded probe (< 1 s) that is then cached."""
    dev = torch.device(device)
    if dev.type not in _BANDWIDTH:
        cached = _load_bandwidths().get(_machine_key(dev))
        if isinstance(cached, dict) and isinstance(cached.get("bandwidth_GBps"), (int, float)):
            _BANDWIDTH[dev.type] = cached["bandwidth_GBps"] * 1e9
        else:
            _BANDWIDTH[dev.type] = probe_bandwidth(dev)
            _save_bandwidth(dev, _BANDWIDTH[dev.type])
    return _BANDWIDTH[dev.type]


def peak_flops(dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu") -> float:
    """Measured matmul FLOP/s of `device` in `dtype` (float16 uses the bfloat16 probe; falls back to float32)."""
    name = str(dtype).replace("torch.", "")
    info = hardware_info(device)
    value = info.get(f"flops_{'bfloat16' if name == 'float16' else name}")
    return value if value else info["flops_float32"]


def hardware_summary(info: dict) -> str:
    """One line: what ran, its measured roofs, and whether bf16 is native."""
    name = info.get("gpu") or f"CPU {info.get('cpu')}, {_threads(info.get('threads') or 0)}"
    bf16 = info.get("flops_bfloat16")
    native = info.get("native_bf16")
    bf16_text = "" if not bf16 else f", {bf16 / 1e9:.3g} GFLOP/s bf16" + (
        "" if native is None else (" (native)" if native else " (emulated: no bf16 instructions)"))
    return (f"{name}; torch {info.get('torch')}; measured {info['bandwidth_GBps']:.1f} GB/s copy, "
            f"{info['flops_float32'] / 1e9:.0f} GFLOP/s fp32" + bf16_text)
