"""Shared fixtures: the real model is loaded once per session (cached weights; ~5 s)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

# no per-example deadline (a shared 2-core machine has slow moments); in CI, a fixed example sequence so a run can
# only fail on a real regression, never on a newly drawn example (locally hypothesis keeps exploring). No explain
# phase: after shrinking a failure it re-runs the test many more times to say which arguments mattered (80 s for one
# failing grader of lesson 09, on every stub and mutant run); the minimal failing example is still reported.
settings.register_profile("minillm", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=bool(os.environ.get("CI")), phases=[p for p in Phase if p is not Phase.explain])
settings.load_profile("minillm")

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (the README's command): one thread per worker per core
    torch.set_num_threads(1)
    # and the processes a worker starts (notebook kernels, graded subprocesses) inherit one thread too: two workers
    # each running a two-thread kernel on two cores made the lesson tests 3-4x slower than alone
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

# Triton picks interpreter or driver when it is first imported, and some test modules import it indirectly
# (torch.utils.flop_counter does) before minillm_kernels can choose: decide here, first (kernels/_triton_env.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the engine's per-step consistency checks (every block read is allocated, every block written has one owner) are a
# debug flag in production; the tests run with them on
os.environ.setdefault("MINILLM_DEBUG", "1")


@pytest.fixture(scope="module")
def one_thread():
    """For a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny models gain nothing from a
    second thread, and on a shared 2-core machine whose other core is busy a second thread makes them many times
    slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def real_model():
    from minillm import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def real_meta():
    from minillm.gguf.weights import gguf_path, read_gguf_metadata

    return read_gguf_metadata(gguf_path())


def tiny_model(seed: int = 0, **overrides):
    """A small random Transformer with ModelConfig.tiny(**overrides): same shape rules as the real model."""
    from minillm.config import ModelConfig
    from minillm.model import Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig.tiny(**overrides)).eval()
