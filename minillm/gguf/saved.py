"""The models the course makes, on disk: a transformed float model saved under the cache (lessons 08-09), and a
student shipped as a recipe (its base's name, the blocks it drops, fp16 low-rank factors and norms: a few MB
instead of ~340 MB), rebuilt into the cache once. Loading a model by name (gguf/loader.py) finds both here; every
file is checked against the sha256 recorded beside it (gguf/weights.py)."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from pathlib import Path

import torch

from minillm.config import ModelConfig
from minillm.gguf.weights import KNOWN_MODELS, cache_dir, model_source, read_verified, write_with_digest
from minillm.model import Transformer

ASSETS = Path(__file__).resolve().parent.parent / "assets"

STUDENT_COMMAND = "minillm bench distill"  # what trains a student and writes its recipe (recipes/student.py)
# saved models the course makes, and how (load_model names them in its error when they are missing)
HOW_TO_MAKE = {
    "smollm2-pruned-20": "run lesson 08 (lessons/08_sparsity_pruning.py), which saves it",
    "smollm2-135m-student": "it ships as minillm/assets/smollm2-135m-student.pt; retrain it with "
                            f"`{STUDENT_COMMAND}` (~60 min on 2 CPU cores)",
}


def saved_model_exists(name: str) -> bool:
    """Is `name` a model save_model wrote (and not one of the known model files)?"""
    return name not in KNOWN_MODELS and bool(name) and "/" not in name and (
        saved_model_dir(name) / "config.json").exists()


def saved_model_dir(name: str) -> Path:
    """Where save_model(model, name) writes: <cache dir>/saved/<name> ($MINILLM_CACHE or ~/.cache/minillm)."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a saved model's name is one plain folder name (e.g. 'smollm2-pruned-22'), got {name!r}")
    return cache_dir() / "saved" / name


def _config_json(name: str) -> dict:
    return json.loads((saved_model_dir(name) / "config.json").read_text())


def saved_config(name: str) -> tuple[ModelConfig, str]:
    """(config, base model name) of a saved model, without loading its weights."""
    meta = _config_json(name)
    return ModelConfig(**meta["config"]), meta["base"]


def empty_model(cfg: ModelConfig, attn_backend: str = "sdpa") -> Transformer:
    """The model's structure on the meta device, no weights and no random init, for a loader that fills every weight
    next (load_state_dict(..., assign=True), or to_empty then a copy). Random init of weights about to be
    overwritten costs time, and on the meta device it runs through torch's Python decompositions, whose first use
    imports torch._dynamo: ~2 s of a 1 s load."""
    names = ("normal_", "uniform_", "kaiming_uniform_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            return Transformer(cfg, attn_backend=attn_backend)
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def save_model(model: Transformer, name: str, base: str = "smollm2-135m", info: dict | None = None) -> Path:
    """Save a transformed float model (pruned, distilled: lessons 08-09) as config.json + model.pt under
    saved_model_dir(name). The config says what the model now is; `base` names the model whose tokenizer it uses;
    `info` is kept as-is (what was done to it). The state dict's SHA-256 is recorded and checked on load."""
    model_source(base)
    if any(type(m).__name__.endswith("Linear") and not isinstance(m, torch.nn.Linear) for m in model.modules()):
        raise ValueError("save_model stores float weights: save before quantizing (quantize again after loading)")
    folder = saved_model_dir(name)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
          if not (model.config.tie_embeddings and k == "lm_head.weight")}
    buf = io.BytesIO()
    torch.save(sd, buf)
    meta = {"config": dataclasses.asdict(model.config), "base": base, "dtype": str(model.dtype).removeprefix("torch."),
            "info": info or {}}
    write_with_digest(folder / "model.pt", buf.getvalue(), meta, folder / "config.json")
    return folder


def load_saved(name: str, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu"):
    """(model, tokenizer) from save_model's folder; weights round-trip exactly (dtype=None keeps the saved one)."""
    folder = saved_model_dir(name)
    if not (folder / "config.json").exists() or not (folder / "model.pt").exists():
        raise FileNotFoundError(f"no saved model {name!r} in {folder}: save one first with "
                                f"minillm.gguf.saved.save_model(model, {name!r})")
    raw, meta = read_verified(folder / "model.pt", folder / "config.json",
                              f"delete {folder} and save the model again")
    cfg = ModelConfig(**meta["config"])
    model = empty_model(cfg)
    sd = torch.load(io.BytesIO(raw), weights_only=True, map_location=torch.device(device))
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)  # the loaded tensors, no copy
    model.rope_cos, model.rope_sin = model.rope_cos.to(device), model.rope_sin.to(device)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"{folder} does not match its config: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    dtype = dtype or meta["dtype"]
    model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eval().requires_grad_(False)
    model.saved_info = meta["info"]
    from minillm.gguf.tokenizer_cache import tokenizer_of

    return model, tokenizer_of(meta["base"])


# ------------------------------------------------------------------------------------- a student, as a recipe


def recipe_path(name: str) -> Path:
    """Where the course ships a small model as a recipe (lesson 09): minillm/assets/<name>.pt (+ .pt.json)."""
    return ASSETS / f"{name}.pt"


def write_recipe(name: str, base: str, dropped_blocks: list[int], state: dict[str, torch.Tensor],
                 info: dict) -> Path:
    """Ship a student as recipe_path(name): `base` minus `dropped_blocks`, plus `state` (compress/lora.py's
    lora_state: factors A, B per weight and the block norms), stored in fp16; `info` goes to the .json beside it."""
    recipe = {"base": base, "dropped_blocks": list(dropped_blocks),
              "state": {k: v.detach().cpu().half() for k, v in state.items()}}
    buf = io.BytesIO()
    torch.save(recipe, buf)
    path = recipe_path(name)
    write_with_digest(path, buf.getvalue(), info)
    return path


def built_from_current_recipe(name: str) -> bool:
    """Is the saved copy of `name` built from the recipe that ships now (an older build is rebuilt)?"""
    meta_path = Path(f"{recipe_path(name)}.json")
    if not saved_model_exists(name) or not meta_path.exists():
        return False
    saved = _config_json(name).get("info", {})
    return saved.get("sha256") == json.loads(meta_path.read_text()).get("sha256")


@torch.no_grad()
def build_from_recipe(name: str, load_base: Callable) -> Path:
    """Rebuild a shipped student from its base model and a few MB of what training made: the blocks it drops and a
    low-rank update (A, B) per weight plus its norms (lesson 09's LoRA recovery). The full model (~340 MB) is too
    large to ship; this takes seconds, runs once, and saves it like save_model (later loads read the cache).
    load_base(name, dtype=, device=) -> (model, tokenizer) loads the base (the loader's load_from_file)."""
    path = recipe_path(name)
    raw, meta = read_verified(path, None, f"restore it with `git checkout -- {path}` or retrain it "
                                          f"(`{STUDENT_COMMAND}`)")
    recipe = torch.load(io.BytesIO(raw), weights_only=True)
    print(f"building {name} once from {recipe['base']} + {path.name} ...", flush=True)
    model, _ = load_base(recipe["base"], dtype="float32", device="cpu")
    drop = set(recipe["dropped_blocks"])
    model.layers = torch.nn.ModuleList(b for i, b in enumerate(model.layers) if i not in drop)
    model.config = model.config.with_(n_layers=len(model.layers))
    for key, value in recipe["state"].items():
        if key.endswith(".A"):
            lin = model.get_submodule(key[:-2])
            lin.weight += recipe["state"][key[:-2] + ".B"].float() @ value.float()
        elif not key.endswith(".B"):
            model.get_parameter(key).copy_(value.float())
    return save_model(model, name, base=recipe["base"], info={**meta, "built_from": str(path)})
