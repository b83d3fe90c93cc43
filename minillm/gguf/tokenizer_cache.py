"""A verified GGUF's tokenizer, built once and kept beside the file (lesson 14's edge profile: load and peak memory).

Building the tokenizer from the GGUF decodes 49,152 tokens from GPT-2's alphabet and checks 48,900 merges against
them: the largest part of a q4 load once the weights are mapped, and ~98,000 Python strings at its peak. What the
build found (each normal token's bytes by id, the special tokens, the stop and start ids, the chat template) goes
to one file; later loads rebuild the same tiktoken Encoding from it, without reading the vocabulary from the GGUF.
It stands for one GGUF (the sha256 weights.verify checked) and one format, recorded beside it with its own sha256;
anything else, or damage, is rebuilt from the GGUF, never used. MINILLM_CONVERTED_CACHE=off skips it."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from minillm.gguf import converted
from minillm.gguf.tokenizer import Tokenizer
from minillm.gguf.weights import read_verified, write_with_digest

FORMAT = 1


def cache_path(gguf: Path) -> Path:
    return gguf.with_name(f"{gguf.name}.tokenizer.json")


def meta_path(cache: Path) -> Path:  # its sha256 and what it stands for (weights.write_with_digest)
    return cache.with_name(cache.name.removesuffix(".json") + ".meta.json")


def tokenizer_for(gguf: Path, source_sha256: str, metadata: Callable[[], dict]) -> Tokenizer:
    """The tokenizer of this verified file: from the cache beside it, or built from metadata() and cached."""
    if not converted.enabled():
        return Tokenizer.from_gguf_metadata(metadata())
    path = cache_path(gguf)
    state = read_state(path, source_sha256)
    if state is not None:
        try:
            return Tokenizer.from_state(state)
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # a state this code does not read
            print(f"minillm: the cached tokenizer {path.name} is unusable ({type(e).__name__}: {e}); building it "
                  f"from the file again", file=sys.stderr)
    tok = Tokenizer.from_gguf_metadata(metadata())
    write_state(path, source_sha256, tok.state())
    return tok


def read_state(path: Path, source_sha256: str) -> dict | None:
    """The cached state for this source, or None (none, another source or format, damaged: said and deleted)."""
    if not path.exists():
        return None
    try:
        raw, meta = read_verified(path, meta_path(path), "it is rebuilt from the GGUF")
        if (meta.get("format"), meta.get("source_sha256")) != (FORMAT, source_sha256):
            return None
        return json.loads(raw)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"minillm: the cached tokenizer {path.name} is damaged ({e}); deleting it, building it from the file",
              file=sys.stderr)
        for p in (path, meta_path(path)):
            p.unlink(missing_ok=True)
        return None


def write_state(path: Path, source_sha256: str, state: dict) -> None:
    """The state, then its sha256 and source beside it, each under a temporary name first (write_with_digest). A disk
    that refuses costs only the speed-up (said on stderr)."""
    try:
        write_with_digest(path, json.dumps(state).encode(), {"format": FORMAT, "source_sha256": source_sha256},
                          meta_path(path))
    except OSError as e:
        print(f"minillm: could not cache the tokenizer beside {path.parent} ({e}); loads build it each time",
              file=sys.stderr)


def tokenizer_of(name: str, metadata: dict | None = None) -> Tokenizer:
    """The tokenizer of a known model (its verified GGUF, downloaded on first use); metadata: its header, when the
    caller has read it already."""
    from minillm.gguf.weights import gguf_path, model_source, read_gguf_metadata

    path = gguf_path(name)
    return tokenizer_for(path, model_source(name).sha256,
                         lambda: metadata if metadata is not None else read_gguf_metadata(path))
