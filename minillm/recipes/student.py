"""Ship a trained student (lesson 09): what `minillm bench distill` made, written as the recipe under minillm/assets.

Only the training's output ships (dropped blocks, LoRA factors and block norms: a few MB, not the ~340 MB model);
the cache copy is then rebuilt from it, so this machine loads exactly what a fresh checkout builds.
"""

from __future__ import annotations

from pathlib import Path

from minillm.compress.lora import lora_state
from minillm.gguf.loader import load_from_file
from minillm.gguf.saved import STUDENT_COMMAND, build_from_recipe, write_recipe

SHIP = "smollm2-135m-student"


def ship_student(student, dropped_blocks: list[int], info: dict, name: str = SHIP, base: str = "smollm2-135m") -> Path:
    """Write `student` (`base` minus `dropped_blocks`, with LoRA adapters) as recipe_path(name), `info` (budget,
    data, eval) beside it, and rebuild its cache copy; returns the recipe's path."""
    path = write_recipe(name, base, dropped_blocks, lora_state(student),
                        {"command": STUDENT_COMMAND, "dropped_blocks": list(dropped_blocks), **info})
    build_from_recipe(name, load_from_file)  # fp16 factors, as a fresh checkout builds: not the float32 merge
    return path
