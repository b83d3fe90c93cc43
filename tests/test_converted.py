"""The converted-weights cache beside the download (minillm/gguf/converted.py): a q4 load maps the kernels' layouts
instead of repacking them, and the model it gives is the converted one, byte for byte; a damaged, foreign or stale
cache is never used."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from minillm_kernels import cpu_lowbit

import minillm.gguf.converted as converted
from minillm.api import load_model
from minillm.compress.quant import Int4Linear, Int8Linear, quantize_int4


def need_kernels():
    from minillm.compress.quant import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip(f"the CPU low-bit kernels did not load: {cpu_lowbit.status()}")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The cache in a folder of its own (the real one sits beside the shared download)."""
    monkeypatch.setattr(converted, "converted_path",
                        lambda gguf, layout, fused: tmp_path / f"{gguf.name}.{abs(hash((layout, fused)))}.pt")
    monkeypatch.delenv(converted.ENV, raising=False)
    return tmp_path


def layouts(model) -> dict[str, torch.Tensor]:
    return {n: m._buffers["kernel_weight"] for n, m in model.named_modules()
            if isinstance(m, (Int4Linear, Int8Linear)) and m.kernel_layout_only}


def logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids]))


@pytest.mark.parametrize("fuse", [True, False])
def test_a_mapped_model_is_the_converted_one(cache_dir, fuse):
    need_kernels()
    first, tok = load_model(weights="q4", fuse=fuse)
    files = sorted(cache_dir.glob("*.pt"))
    assert len(files) == 1 and files[0].with_name(files[0].name + ".json").exists()
    second, _ = load_model(weights="q4", fuse=fuse)
    a, b = layouts(first), layouts(second)
    assert a.keys() == b.keys() and len(a) == 30 * (4 if fuse else 7) + 1  # every block Linear and the head
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert not b[name].is_meta
    ids = tok.encode("The capital of France is")
    assert torch.equal(logits(first, ids), logits(second, ids))


def test_a_damaged_cache_is_deleted_and_rebuilt(cache_dir, capfd):
    need_kernels()
    good, tok = load_model(weights="q4", fuse=True)
    (path,) = cache_dir.glob("*.pt")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensors' bytes
    path.write_bytes(bytes(data))
    again, _ = load_model(weights="q4", fuse=True)
    assert "unusable" in capfd.readouterr().err
    ids = tok.encode("Hello")
    assert torch.equal(logits(good, ids), logits(again, ids))
    assert path.exists() and path.read_bytes() != bytes(data)  # written again, whole


def test_a_cache_for_another_layout_or_source_is_not_used(cache_dir, monkeypatch):
    need_kernels()
    load_model(weights="q4", fuse=True)
    (path,) = cache_dir.glob("*.pt")
    gguf = converted.Path("x.gguf")
    meta_sha = "0" * 64
    assert converted.read_converted(gguf, meta_sha, cpu_lowbit.layout_id(), True) is None  # not this path's
    from minillm.gguf.weights import KNOWN_MODELS, gguf_path

    real = (gguf_path("smollm2-135m"), KNOWN_MODELS["smollm2-135m"].sha256)
    assert converted.read_converted(*real, cpu_lowbit.layout_id(), True) is not None
    assert converted.read_converted(real[0], meta_sha, cpu_lowbit.layout_id(), True) is None  # another source
    monkeypatch.setattr(converted, "converted_path", lambda g, layout, fused: path)  # same file, other layout id
    assert converted.read_converted(*real, "8 rows, repack 0123", True) is None


def test_a_touched_but_whole_cache_is_hashed_again_and_kept(cache_dir):
    need_kernels()
    load_model(weights="q4", fuse=True)
    (path,) = cache_dir.glob("*.pt")
    st_before = path.stat()
    os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns + 10**9))
    from minillm.gguf.weights import KNOWN_MODELS, gguf_path

    got = converted.read_converted(gguf_path("smollm2-135m"), KNOWN_MODELS["smollm2-135m"].sha256,
                                   cpu_lowbit.layout_id(), True)
    assert got is not None and path.exists()


def test_a_read_only_cache_is_still_read(cache_dir, monkeypatch):
    """A whole cache whose stamp is stale (copied, touched) on a disk that refuses writes: hashed, used, not
    rewritten; and a load that cannot write one at all still loads."""
    need_kernels()
    load_model(weights="q4", fuse=True)
    (path,) = cache_dir.glob("*.pt")
    st_before = path.stat()
    os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns + 10**9))

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(converted, "_write_text", refuse)
    from minillm.gguf.weights import KNOWN_MODELS, gguf_path

    key = (gguf_path("smollm2-135m"), KNOWN_MODELS["smollm2-135m"].sha256, cpu_lowbit.layout_id(), True)
    assert converted.read_converted(*key) is not None
    monkeypatch.setattr(torch, "save", refuse)
    path.unlink()
    model, tok = load_model(weights="q4", fuse=True)
    assert not path.exists() and model(torch.tensor([tok.encode("Hi")])).isfinite().all()


def test_two_writers_write_the_same_bytes(tmp_path, monkeypatch):
    """Processes that miss the cache together each write it (a temporary name, then a rename): the bytes are equal,
    so a reader that hashes one writer's file against the other's meta finds it whole."""
    monkeypatch.setattr(converted, "converted_path", lambda gguf, layout, fused: tmp_path / "c.pt")
    layers = {"layers.0.attn.wq": torch.arange(640, dtype=torch.uint8).reshape(1, 2, 320)}
    key = (tmp_path / "m.gguf", "0" * 64, "16 rows, repack x", True)
    monkeypatch.setattr(converted.os, "getpid", lambda: 1)
    converted.write_converted(*key, layers)
    first = (tmp_path / "c.pt").read_bytes()
    monkeypatch.setattr(converted.os, "getpid", lambda: 2)  # another process: another temporary name
    converted.write_converted(*key, layers)
    assert (tmp_path / "c.pt").read_bytes() == first
    assert torch.equal(converted.read_converted(*key)["layers.0.attn.wq"], layers["layers.0.attn.wq"])


def test_off_writes_nothing(cache_dir, monkeypatch):
    need_kernels()
    monkeypatch.setenv(converted.ENV, "off")
    load_model(weights="q4", fuse=True)
    assert not list(cache_dir.iterdir())


def test_a_cache_that_does_not_fit_the_model_is_rebuilt(cache_dir, capfd):
    need_kernels()
    from minillm.gguf.weights import KNOWN_MODELS, gguf_path

    model, tok = load_model(weights="q4", fuse=True)
    key = (gguf_path("smollm2-135m"), KNOWN_MODELS["smollm2-135m"].sha256, cpu_lowbit.layout_id(), True)
    wrong = dict(layouts(model))
    wrong["layers.3.mlp.down"] = wrong["layers.3.mlp.down"][:-1].clone()  # a group short
    converted.write_converted(*key, wrong)
    again, _ = load_model(weights="q4", fuse=True)
    assert "do not fit" in capfd.readouterr().err
    ids = tok.encode("Hi there")
    assert torch.equal(logits(model, ids), logits(again, ids))


@settings(max_examples=15, deadline=None)
@given(parts=st.lists(st.integers(1, 3), min_size=2, max_size=3), blocks=st.integers(1, 3), seed=st.integers(0, 99))
def test_kernel_layouts_stack_like_codes(parts, blocks, seed):
    """cat_rows of layers that hold only the kernels' layout (whole groups of rows) equals the layout of the
    concatenated codes, and the fused layer computes the same."""
    need_kernels()
    rows = cpu_lowbit.rows_per_group()
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(p * rows, 32 * blocks, generator=g) for p in parts]
    layers = [Int4Linear(*quantize_int4(w, 32), group_size=32) for w in dense]
    by_codes = Int4Linear.cat_rows(layers)
    for m in layers:
        m.keep_kernel_layout_only()
    by_layout = Int4Linear.cat_rows(layers)
    assert by_layout.kernel_layout_only and by_layout.out_features == sum(parts) * rows
    assert torch.equal(by_layout._buffers["kernel_weight"], by_codes._kernel_pack())
    x = torch.randn(3, 32 * blocks, generator=g)
    assert torch.equal(by_layout(x), by_codes(x))


def test_a_wrong_kernel_layout_is_refused():
    with pytest.raises(ValueError, match="not the kernel layout"):
        Int4Linear.from_kernel_layout(torch.zeros(2, 3, 20 * 16, dtype=torch.uint8), 33, 96)
    with pytest.raises(ValueError, match="not the kernel layout"):
        Int8Linear.from_kernel_layout(torch.zeros(2, 3, 36 * 16, dtype=torch.float32), 32, 96)


def test_max_context_stops_the_rope_tables_there_and_refuses_a_longer_context():
    """load_model(max_context=n), as llama.cpp's n_ctx (the edge profile's 512): the same logits within it, the
    RoPE tables n rows long, a longer prompt or generation refused, bad values said."""
    need_kernels()
    from minillm.api import generate

    full, tok = load_model(weights="q4", fuse=True, native="auto")
    short, _ = load_model(weights="q4", fuse=True, native="auto", max_context=32)
    assert short.config.max_seq_len == 32 and short.rope_cos.shape[0] == short.rope_sin.shape[0] == 32
    assert torch.equal(short.rope_cos, full.rope_cos[:32]) and torch.equal(short.rope_sin, full.rope_sin[:32])
    ids = tok.encode("The capital of France is")
    assert torch.equal(logits(short, ids), logits(full, ids))
    assert generate(short, tok, ids, max_new_tokens=8).token_ids == generate(full, tok, ids, max_new_tokens=8).token_ids
    with pytest.raises(ValueError, match="context window"):
        logits(short, list(range(33)))
    out = generate(short, tok, ids, max_new_tokens=40)  # stops at the window, saying why
    assert len(ids) + len(out.token_ids) == 32 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="context window is 32"):
        generate(short, tok, list(range(40)), max_new_tokens=4)
    for bad in (0, -1, 1.5, True, "512"):
        with pytest.raises(ValueError, match="max_context"):
            load_model(weights="q4", max_context=bad)
