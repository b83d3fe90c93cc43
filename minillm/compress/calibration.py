"""Calibration: run sample text through the model and watch what some layers receive (lessons 07 and 08).

AWQ's scales, LLM.int8()'s outlier count, Wanda's activation norms and structured pruning's importances all
come from the inputs of a few Linears on real text. `watch_inputs` hooks them for the length of a `with`
block and always unhooks them (a hook left behind would keep recording on every later forward);
`run_windows` and `calib_batch` are the two ways the callers feed the text in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping

import torch
from torch import Tensor, nn


@contextlib.contextmanager
def watch_inputs(modules: Mapping[Hashable, nn.Module], record: Callable[[Hashable, Tensor], None]) -> Iterator[None]:
    """Inside the block, every forward of modules[key] first calls record(key, x), x its input as a (tokens, in)
    float32 tensor. The hooks are gone when the block ends, however it ends."""
    handles = []
    try:
        for key, module in modules.items():
            def hook(mod, args, key=key):
                record(key, args[0].reshape(-1, args[0].shape[-1]).float())
            handles.append(module.register_forward_pre_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


def run_windows(model: nn.Module, ids: list[int], window: int) -> None:
    """The model over `ids` one window of up to `window` tokens at a time (batch 1, a short last window kept)."""
    for start in range(0, len(ids) - 1, window):
        model(torch.tensor([ids[start:start + window]], device=model.device))


def calib_batch(model, ids: list[int], window: int) -> Tensor:
    """Calibration ids cut into equal windows of `window` tokens, one batch (a short last window is dropped)."""
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) == len(windows[0])]
    if not windows or len(windows[0]) < 2:
        raise ValueError("calibration needs at least 2 token ids")
    return torch.tensor(windows, device=model.device)
