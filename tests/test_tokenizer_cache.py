"""The tokenizer kept beside the download (minillm/gguf/tokenizer_cache.py): a load that reads it gives the tokenizer
the GGUF builds (the oracle: Tokenizer.from_gguf_metadata), and a damaged, foreign or switched-off cache is never
used; the header's string arrays (reader.StringArray) read as the lists they stand for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm.gguf.tokenizer_cache as tokenizer_cache
from minillm.gguf.tokenizer import Tokenizer
from minillm.gguf.weights import gguf_path, model_source

SOURCE = model_source("smollm2-135m").sha256


@pytest.fixture(scope="module")
def oracle(real_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(real_meta)


@pytest.fixture(scope="module")
def cached(real_meta, tmp_path_factory) -> Tokenizer:
    """Written once, then read back through the cache (the second call builds nothing from the metadata)."""
    path = tmp_path_factory.mktemp("tok") / "m.gguf"
    tokenizer_cache.tokenizer_for(path, SOURCE, lambda: real_meta)
    return tokenizer_cache.tokenizer_for(path, SOURCE, _no_metadata)


def _no_metadata() -> dict:
    raise AssertionError("the cache was not used: the tokenizer was built from the GGUF again")


def test_the_cached_tokenizer_is_the_files(oracle, cached):
    assert len(cached) == len(oracle) and cached.special_tokens == oracle.special_tokens
    assert (cached.eos_id, cached.bos_id, cached.stop_ids) == (oracle.eos_id, oracle.bos_id, oracle.stop_ids)
    assert cached.missing_bytes == oracle.missing_bytes and cached.chat_template == oracle.chat_template
    assert all(cached.token_bytes(i) == oracle.token_bytes(i) for i in range(len(oracle)))
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    assert cached.encode_chat(chat) == oracle.encode_chat(chat)
    for text in ("a\x04b", "digits 12345 stay apart", "\ud800 lone", "<|im_end|> plain"):
        assert cached.encode(text) == oracle.encode(text)  # the slow paths: missing bytes, surrogates
        assert cached.encode(text, allow_special=True) == oracle.encode(text, allow_special=True)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60))
def test_the_cached_tokenizer_encodes_any_text_as_the_file_does(oracle, cached, text):
    assert cached.encode(text) == oracle.encode(text)


def test_a_damaged_or_foreign_cache_is_rebuilt_never_used(real_meta, tmp_path, capsys):
    path = tmp_path / "m.gguf"
    tok = tokenizer_cache.tokenizer_for(path, SOURCE, lambda: real_meta)
    file = tokenizer_cache.cache_path(path)
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit inside a token's bytes
    file.write_bytes(bytes(raw))
    again = tokenizer_cache.tokenizer_for(path, SOURCE, lambda: real_meta)
    assert "damaged" in capsys.readouterr().err
    assert again.encode("The capital of France") == tok.encode("The capital of France")
    tokenizer_cache.tokenizer_for(path, SOURCE, _no_metadata)  # written again, whole
    # another source's cache is not this file's: built from the metadata (which is what _no_metadata forbids)
    with pytest.raises(AssertionError, match="not used"):
        tokenizer_cache.tokenizer_for(path, "0" * 64, _no_metadata)
    file.write_bytes(b"not json")
    assert tokenizer_cache.read_state(file, SOURCE) is None and not file.exists()


def test_a_state_that_does_not_cover_the_ids_is_refused(oracle):
    state = oracle.state()
    assert Tokenizer.from_state(state).encode("hello") == oracle.encode("hello")
    for i, piece in ((0, "x"), (300, state["tokens"][301])):  # a special's id given bytes; two ids, one piece
        tokens = list(state["tokens"])
        tokens[i] = piece
        with pytest.raises(ValueError, match="cover each id"):
            Tokenizer.from_state({**state, "tokens": tokens})
    with pytest.raises(ValueError, match="pre-tokenizer"):
        Tokenizer.from_state({**state, "pre": "unknown"})


def test_switched_off_it_writes_nothing(real_meta, tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CONVERTED_CACHE", "off")
    path = tmp_path / "m.gguf"
    tokenizer_cache.tokenizer_for(path, SOURCE, lambda: real_meta)
    assert not tokenizer_cache.cache_path(path).exists()


def test_a_read_only_folder_costs_only_the_speed_up(real_meta, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        tok = tokenizer_cache.tokenizer_for(folder / "m.gguf", SOURCE, lambda: real_meta)
    finally:
        folder.chmod(0o700)
    assert tok.encode("hello") == Tokenizer.from_gguf_metadata(real_meta).encode("hello")
    err = capsys.readouterr().err
    assert "could not cache" in err or not err  # root ignores the mode: then it simply wrote it


def test_string_arrays_read_as_their_lists(real_meta):
    from minillm.gguf.reader import GGUFFile, StringArray

    tokens = GGUFFile(gguf_path()).metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == 49152
    as_list = list(tokens)
    assert tokens == as_list and as_list == tokens and tokens != as_list[:-1] and tokens != "a string"
    assert tokens[0] == "<|endoftext|>" and tokens[-1] == as_list[-1] and tokens[5:9] == as_list[5:9]
    assert tokens[::-1000] == as_list[::-1000] and "49152 strings" in repr(tokens)
    with pytest.raises(IndexError):
        tokens[49152]
    with pytest.raises(TypeError):
        hash(tokens)


def test_a_string_array_cut_short_is_a_truncated_file(tmp_path):
    import struct

    from minillm.gguf.reader import GGUFError, GGUFFile

    def s(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    words = ["a", "bé", "", "ccc"]
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("words") + struct.pack("<IIQ", 9, 8, len(words))
    head += b"".join(s(w) for w in words)
    path = tmp_path / "w.gguf"
    path.write_bytes(head)
    assert GGUFFile(path).metadata == {"words": words}
    for cut in (len(head) - 1, len(head) - 6, len(head) - 12):  # inside the last string, its length, the one before
        path.write_bytes(head[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            GGUFFile(path)


def test_loads_read_the_cache_beside_the_download(monkeypatch):
    """describe_spec (the server's front process) and load_from_file take the tokenizer from beside the verified file
    once it is there: nothing builds it from the GGUF's vocabulary again."""
    from minillm.gguf.loader import describe_spec

    monkeypatch.delenv("MINILLM_CONVERTED_CACHE", raising=False)
    first = describe_spec("smollm2-135m")[1]  # writes the cache if this machine has none yet
    assert tokenizer_cache.cache_path(gguf_path()).exists()
    monkeypatch.setattr(Tokenizer, "from_gguf_metadata", classmethod(lambda cls, meta: _no_metadata()))
    again = describe_spec("smollm2-135m")[1]
    assert again.encode("The capital of France") == first.encode("The capital of France")


def test_tiktokens_rank_dict_is_rebuilt_when_read_and_pickles_as_itself(oracle, cached, real_meta):
    """The encoding keeps no bytes -> rank dict of its own (edge memory); what stands for it equals the ranks the
    GGUF gives, and a pickled tokenizer comes back whole."""
    import pickle

    ranks = cached._enc._mergeable_ranks
    assert not isinstance(ranks, dict)
    tokens, types = real_meta["tokenizer.ggml.tokens"], real_meta["tokenizer.ggml.token_type"]
    assert len(ranks) == sum(kind == 1 for kind in types) == len(tokens) - len(cached.special_tokens)
    assert dict(ranks) == {oracle.token_bytes(i): i for i in range(len(oracle)) if i not in oracle.special_ids}
    assert all(text.encode() not in ranks for text in cached.special_tokens) and b"\xff\xfe not a token" not in ranks
    again = pickle.loads(pickle.dumps(cached))
    chat = [{"role": "user", "content": "Name three fruits. <|im_end|>"}]
    assert again.encode_chat(chat) == cached.encode_chat(chat) and again.decode(again.encode("héllo")) == "héllo"
