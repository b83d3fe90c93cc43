"""A verified GGUF's tokenizer, built once and kept beside the file (lesson 14's edge profile: load and peak memory).

Building the tokenizer from the GGUF decodes 49,152 tokens from GPT-2's alphabet and checks 48,900 merges against
them: the largest part of a q4 load once the weights are mapped, and ~98,000 Python strings at its peak. What the
build found (each normal token's bytes by id, the special tokens, the stop and start ids, the chat template) goes
to one file; later loads rebuild the same tiktoken Encoding from it, without reading the vocabulary from the GGUF.
A file stands for one GGUF (its sha256, which weights.verify checked) and one format; its first line is the sha256
of the rest. Anything else, or damage, is rebuilt from the GGUF, never used. MINILLM_CONVERTED_CACHE=off skips it."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from minillm.gguf import converted
from minillm.gguf.tokenizer import Tokenizer

FORMAT = 1


def cache_path(gguf: Path) -> Path:
    return gguf.with_name(f"{gguf.name}.tokenizer.json")


def tokenizer_for(gguf: Path, source_sha256: str, metadata: Callable[[], dict]) -> Tokenizer:
    """The tokenizer of this verified file: from the cache beside it, or built from metadata() and cached."""
    if not converted.enabled():
        return Tokenizer.from_gguf_metadata(metadata())
    path = cache_path(gguf)
    state = read_state(path, source_sha256)
    if state is not None:
        try:
            return Tokenizer.from_state(state)
        except (KeyError, TypeError, ValueError) as e:  # a format this code does not read: rebuilt below
            print(f"minillm: the cached tokenizer {path.name} is unusable ({type(e).__name__}: {e}); building it "
                  f"from the file again", file=sys.stderr)
    tok = Tokenizer.from_gguf_metadata(metadata())
    write_state(path, source_sha256, tok.state())
    return tok


def read_state(path: Path, source_sha256: str) -> dict | None:
    """The cached state for this source, or None (none, another source or format, damaged: said and deleted)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    digest, _, body = raw.partition(b"\n")
    try:
        if hashlib.sha256(body).hexdigest().encode() != digest:
            raise ValueError("its sha256 is not the one on its first line")
        state = json.loads(body)
    except ValueError as e:
        print(f"minillm: the cached tokenizer {path.name} is damaged ({e}); deleting it, building it from the file",
              file=sys.stderr)
        path.unlink(missing_ok=True)
        return None
    if (state.get("format"), state.get("source_sha256")) != (FORMAT, source_sha256):
        return None
    return state


def write_state(path: Path, source_sha256: str, state: dict) -> None:
    """Written under a temporary name, then renamed: a crash leaves no file, never half of one. A disk that refuses
    costs only the speed-up (said on stderr)."""
    body = json.dumps({"format": FORMAT, "source_sha256": source_sha256, **state}).encode()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"minillm: could not cache the tokenizer beside {path.parent} ({e}); loads build it each time",
              file=sys.stderr)


def tokenizer_of(name: str, metadata: dict | None = None) -> Tokenizer:
    """The tokenizer of a known model (its verified GGUF, downloaded on first use); metadata: its header, when the
    caller has read it already."""
    from minillm.gguf.weights import gguf_path, model_source, read_gguf_metadata

    path = gguf_path(name)
    return tokenizer_for(path, model_source(name).sha256,
                         lambda: metadata if metadata is not None else read_gguf_metadata(path))
