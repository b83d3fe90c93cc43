"""The install path: the README's commands, .ci/run and pyproject agree, so CI tests what the README tells people to
run: the CPU build of torch from PyTorch's CPU index, the same torch version CI installs, and one triton pin that
lives in the `kernels` extra (which the README's test command installs, and CI runs that command)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()

requirements = pytest.importorskip("packaging.requirements")
tomllib = pytest.importorskip("tomllib")


def _ci_commands() -> list[str]:
    return [ln.split("#")[0].strip() for ln in CI.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _kernels_triton():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["kernels"]
    (req,) = [requirements.Requirement(r) for r in extra if r.startswith("triton")]
    return req


def test_ci_runs_the_readme_test_command_and_installs_no_triton_of_its_own():
    test_cmd = README.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert '".[dev,kernels]"' in test_cmd and "pytest" in test_cmd
    assert "<!-- test-command" in CI and 'bash -c "$cmd"' in CI  # CI reads and runs that line
    pip_lines = [c for c in _ci_commands() if "pip install" in c]
    assert pip_lines and not any("triton" in c for c in pip_lines), pip_lines  # the extra decides, for both


def test_readme_gives_the_cpu_build_of_the_torch_ci_installs():
    (ci_torch,) = re.findall(r"pip install -q torch==([\w.]+)", CI)
    cpu = re.search(r"pip install torch==([\w.]+) --index-url https://download.pytorch.org/whl/cpu", README)
    assert cpu, "README: no CPU-only torch install from PyTorch's CPU index"
    assert cpu.group(1) == ci_torch
    assert re.search(rf"pip install torch=={re.escape(ci_torch)}\n", README)  # and the GPU (CUDA) one


def test_kernels_extra_pins_the_tested_triton_and_accepts_a_cuda_torchs_own():
    req = _kernels_triton()
    assert req.marker is not None and "Linux" in str(req.marker)
    assert req.specifier.contains("3.8.0")  # what CI and the README's command install with the CPU torch
    assert not req.specifier.contains("3.9.0")  # newer than CI tests: the 286 MB one from PyPI
    assert req.specifier.contains("3.7.1")  # PyPI's CUDA torch 2.13.0 requires exactly this one


def test_installed_triton_is_the_pinned_one():
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("triton")
    except PackageNotFoundError:
        pytest.skip("triton is not installed (no kernels extra, or not Linux)")
    assert _kernels_triton().specifier.contains(installed), installed
