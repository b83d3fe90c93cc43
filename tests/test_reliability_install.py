"""The install path: the README's commands, .ci/run and pyproject agree, so CI tests what the README tells people to
run: two lines on a fresh CPU machine (set up + generate, set up + test), each pinning the CPU build of torch from
PyTorch's CPU index, the GPU lines pinning the same version from PyPI, CI running exactly the two CPU lines and
installing nothing of its own, and one triton pin that lives in the `kernels` extra."""

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


def _readme_command(marker: str) -> str:
    """The line in the ```bash block right after `<!-- marker -->`, as .ci/run reads it."""
    return README.split(f"<!-- {marker} -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]


def _kernels_triton():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["kernels"]
    (req,) = [requirements.Requirement(r) for r in extra if r.startswith("triton")]
    return req


CPU_TORCH = re.compile(r"pip install --extra-index-url https://download\.pytorch\.org/whl/cpu torch==([\w.]+) -e ")


def test_ci_runs_the_two_readme_lines_and_installs_nothing_of_its_own():
    generate, test = _readme_command("generate-command"), _readme_command("test-command")
    assert "minillm generate" in generate and '".[dev,kernels]"' in test and "pytest" in test
    for marker in ("<!-- generate-command -->", "<!-- test-command -->"):
        assert marker in CI  # CI reads each line after its marker...
    assert 'bash -c "$cmd"' in CI  # ...and runs it
    assert CI.index("generate-command") < CI.index("test-command")  # in the README's order
    assert not [c for c in _ci_commands() if "pip install" in c]  # torch and triton: the README's lines decide


def test_readme_pins_one_torch_for_cpu_and_gpu():
    pins = [CPU_TORCH.search(_readme_command(m)) for m in ("generate-command", "test-command")]
    assert all(pins), "README: each CPU line installs torch==X from PyTorch's CPU index with minillm"
    (version,) = {m.group(1) for m in pins}
    assert version == "2.13.0"  # the torch CI tests
    gpu = re.findall(r"^python -m pip install torch==([\w.]+) -e .*$", README, re.MULTILINE)
    assert gpu and set(gpu) == {version}, "README: the GPU lines pin the same torch, from PyPI (the CUDA build)"


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
