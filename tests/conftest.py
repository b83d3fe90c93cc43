"""Shared fixtures: the real model is loaded once per session (cached weights; ~5 s)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def real_model():
    from minillm import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def real_meta():
    from minillm.weights import gguf_path, read_gguf_metadata

    return read_gguf_metadata(gguf_path())
