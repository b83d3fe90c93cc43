"""Text <-> token ids for SmolLM2: byte-level BPE run by tiktoken, built from the GGUF itself (lesson 00).

The GGUF holds the vocabulary (in GPT-2's printable bytes-to-unicode alphabet), the merges and the token
types: no download, no model hub. A token's id is its rank (single bytes, then one token per merge, in merge
order), the rule tiktoken merges by. Quirks, tested in tests/test_tokenizer.py: digits split one by one
(pre-tokenizer 'smollm'); the 21 bytes with no token are dropped from their pre-tokenized piece, as HF does
(`_encode_dropping`); lone surrogates become U+FFFD; generation stops on <|im_end|> (EOS), not <|endoftext|>.
"""

from __future__ import annotations

import codecs
import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import lru_cache

import regex  # tiktoken's own dependency; stdlib re lacks \p{L} / \p{N}
import tiktoken

# GPT-2's split, two changes for 'smollm': a digit (any Unicode number) is always a piece of its own, and a
# whitespace run right before a digit stays whole (HF splits digits out first, so that run ends its piece).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_SMOLLM_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
PRE_TOKENIZER_PATTERNS = {"gpt2": _GPT2_PATTERN, "smollm": _SMOLLM_PATTERN}

TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL = 1, 3  # llama.cpp's token types

ROLES = ("system", "user", "assistant")
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# The Jinja template stored in the GGUF; apply_chat_template renders it in plain Python.
SMOLLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SURROGATES = re.compile("[\ud800-\udfff]")
_NOT_OTHER = regex.compile(r"[\s\p{L}\p{N}]")  # the regex's letter / number / space classes
_SENTINEL = "!"  # an ASCII "other" character with a token of its own


@lru_cache(maxsize=1)
def gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character that stands for each byte -> the byte.

    GPT-2 writes every byte as a visible character so vocab files are readable text: printable bytes stand for
    themselves, the other 68 (control bytes, space, ...) are shifted to U+0100 onwards (space -> 'Ġ').
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    char_of = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in char_of.items()}


def _codepoint_ranges_using_byte(b: int) -> list[tuple[int, int]]:
    """Code points whose UTF-8 encoding contains byte `b` (a single byte or a lead byte)."""
    if b < 0x80:
        return [(b, b)]
    if b < 0xC0:  # a continuation byte sits inside most multi-byte characters, letters included
        raise ValueError(f"the vocabulary has no token for continuation byte {b:#x}; not supported")
    if b in (0xC0, 0xC1) or b >= 0xF5:
        return []  # never appears in valid UTF-8
    if b < 0xE0:
        lo = (b & 0x1F) << 6
        return [(lo, lo + 0x3F)]
    if b < 0xF0:
        lo = (b & 0x0F) << 12
        return [(lo, lo + 0xFFF)]
    lo = (b & 0x07) << 18
    return [(lo, min(lo + 0x3FFFF, 0x10FFFF))]


def _class_of(ranges: list[tuple[int, int]]) -> str:
    """The inside of a regex character class [...] matching these code point ranges."""
    return "".join(f"{re.escape(chr(lo))}-{re.escape(chr(hi))}" for lo, hi in ranges)


class _RanksOnDemand(Mapping):
    """What a tiktoken Encoding keeps of the bytes -> rank dict it was built from, which it reads only to pickle
    itself: 49,152 bytes objects and their dict, 5.7 MiB of the edge profile's peak (lesson 14). This stands for it,
    reading the encoding's own table, and pickles as the plain dict."""

    def __init__(self, encoding: tiktoken.Encoding, special_ids: Iterable[int]):
        self._enc, self._special = encoding, frozenset(special_ids)

    def _ids(self) -> Iterator[int]:
        return (i for i in range(self._enc.n_vocab) if i not in self._special)

    def __getitem__(self, piece: bytes) -> int:
        try:
            rank = self._enc.encode_single_token(piece)  # the Rust table's own lookup
        except KeyError:
            raise KeyError(piece) from None
        if rank in self._special:  # a special token's text is not one of the ranks
            raise KeyError(piece)
        return rank

    def __iter__(self) -> Iterator[bytes]:
        return map(self._enc.decode_single_token_bytes, self._ids())

    def __len__(self) -> int:
        return self._enc.n_vocab - len(self._special)

    def __reduce__(self):
        return dict, ({self._enc.decode_single_token_bytes(i): i for i in self._ids()},)


class StreamDecoder:
    """Feed ids one at a time, get printable text back as soon as it is complete.

    A token can end in the middle of a multi-byte character (an emoji is often 2-4 byte tokens): those bytes
    are held back until the character is complete, so a streaming printer never shows half a character.
    Invalid bytes come out as U+FFFD, exactly as `Tokenizer.decode` would.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """SmolLM2's byte-level BPE tokenizer. Build it with `Tokenizer.from_gguf_metadata(meta)`."""

    def __init__(self, encoding: tiktoken.Encoding, special_tokens: dict[str, int],
                 missing_bytes: Iterable[int], eos_id: int, bos_id: int | None = None,
                 chat_template: str | None = None, ranges_checked: bool = False):
        self._enc = encoding
        if isinstance(getattr(encoding, "_mergeable_ranks", None), dict):  # only its pickling reads it
            encoding._mergeable_ranks = _RanksOnDemand(encoding, special_tokens.values())
        self.vocab_size: int = encoding.n_vocab
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.stop_ids: frozenset[int] = frozenset({eos_id})
        self.special_tokens: dict[str, int] = dict(special_tokens)  # text -> id
        self.special_ids: frozenset[int] = frozenset(self.special_tokens.values())
        self.chat_template = chat_template
        self.missing_bytes: bytes = bytes(sorted(set(missing_bytes)))

        # Slow path tools. BPE of one piece, no regex split (public in older tiktoken, private in 0.12+).
        self._bpe_piece = getattr(encoding, "encode_single_piece", None) or encoding._encode_single_piece
        by_length = sorted(self.special_tokens, key=len, reverse=True)  # longest first: no prefix wins early
        self._special_split = re.compile(f"({'|'.join(map(re.escape, by_length))})") if by_length else None
        # Characters whose UTF-8 holds a missing byte. The dropping rule relies on all being "other" to the
        # pre-tokenizer: check it once here (~0.1 s; ranges_checked: a cached state says this regex version did)
        # rather than produce wrong ids for some other vocabulary.
        ranges = [r for b in self.missing_bytes for r in _codepoint_ranges_using_byte(b)]
        for lo, hi in [] if ranges_checked else ranges:
            if _NOT_OTHER.search("".join(map(chr, range(lo, hi + 1)))):
                raise ValueError(f"characters U+{lo:04X}-U+{hi:04X} have no tokens but are letters, "
                                          f"numbers or spaces: dropping their bytes is not supported")
        self._unencodable = re.compile(f"[{_class_of(ranges)}]") if ranges else None
        # encode() takes the slow path on those characters and on lone surrogates: one regex search per call.
        self._needs_care = re.compile(f"[{_class_of(ranges + [(0xD800, 0xDFFF)])}]")
        self._other_cache: dict[str, bool] = {}
        probe = self._enc.encode_ordinary("'s")  # _is_other's probe needs "'s" to be one token
        self._apostrophe_s = probe[0] if len(probe) == 1 else None
        self._sentinel_len = {lead: len(self._enc.encode_ordinary(lead + _SENTINEL)) for lead in ("", " ")}

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        """Build from a GGUF's key/value metadata (see `minillm.gguf.weights.read_gguf_metadata`)."""
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be the dict from read_gguf_metadata, got {type(meta).__name__}")
        needed = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
        absent = [k for k in needed if k not in meta]
        if absent:
            raise ValueError(f"GGUF metadata lacks {', '.join(absent)}: not a BPE tokenizer we can build")
        model = meta.get("tokenizer.ggml.model", "gpt2")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
        pre = meta.get("tokenizer.ggml.pre", "gpt2")
        if pre not in PRE_TOKENIZER_PATTERNS:
            raise ValueError(f"unknown pre-tokenizer {pre!r}; known: {', '.join(PRE_TOKENIZER_PATTERNS)}")

        tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
        if len(tokens) != len(types):
            raise ValueError(f"{len(tokens)} tokens but {len(types)} token types")
        to_byte = gpt2_unicode_to_byte()
        # GPT-2's characters -> their bytes in one C call per token (str.translate, then latin-1: chr(b) -> b); a raw
        # byte GPT-2 never writes as itself maps to U+FFFF, which latin-1 refuses, as the dict lookup did
        table = {ord(c): b for c, b in to_byte.items()} | {b: 0xFFFF for b in range(256) if chr(b) not in to_byte}
        ranks: dict[bytes, int] = {}
        specials: dict[str, int] = {}
        for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
            if kind == TOKEN_TYPE_CONTROL:
                specials[tok] = i  # written as plain text, matched only when allow_special
            elif kind == TOKEN_TYPE_NORMAL:
                try:
                    ranks[tok.translate(table).encode("latin-1")] = i  # id == rank, see the module docstring
                except UnicodeEncodeError as e:
                    raise ValueError(f"token {i} {tok!r} has a character outside GPT-2's byte map") from e
            else:
                raise ValueError(f"token {i} {tok!r} has type {kind}; known: 1 (normal), 3 (control)")
        if len(ranks) + len(specials) != len(tokens):
            raise ValueError("two tokens stand for the same bytes: not a byte-level BPE vocabulary")

        # tiktoken merges by rank, so ranks must grow in merge order: the merges list only serves to check it.
        index = {tok: i for i, tok in enumerate(tokens)}
        last = -1
        for n, merge in enumerate(meta["tokenizer.ggml.merges"]):
            left, sep, right = merge.partition(" ")
            made = index.get(left + right)
            if not sep or made is None or made <= last:
                raise ValueError(f"merge {n} {merge!r}: ids don't follow merge order (tiktoken needs it)")
            last = made

        eos = meta.get("tokenizer.ggml.eos_token_id")
        if eos is None:
            raise ValueError("GGUF metadata lacks tokenizer.ggml.eos_token_id: generation would never stop")
        encoding = tiktoken.Encoding(f"gguf-{pre}", pat_str=PRE_TOKENIZER_PATTERNS[pre],
                                     mergeable_ranks=ranks, special_tokens=specials)
        missing = set(range(256)) - {b[0] for b in ranks if len(b) == 1}
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(encoding, specials, missing, eos_id=int(eos), bos_id=bos,
                   chat_template=meta.get("tokenizer.chat_template"))

    def state(self) -> dict:
        """What from_state rebuilds this tokenizer from (JSON-ready; minillm.gguf.tokenizer_cache keeps it): each
        id's bytes as latin-1 text (None for a special token), the specials, the stop and start ids, the template."""
        by_id: list[str | None] = [None if i in self.special_ids else self._enc.decode_single_token_bytes(i).decode(
            "latin-1") for i in range(self.vocab_size)]
        return {"pre": self._enc.name.removeprefix("gguf-"), "tokens": by_id, "special_tokens": self.special_tokens,
                "eos_id": self.eos_id, "bos_id": self.bos_id, "chat_template": self.chat_template,
                "ranges_checked_by": f"regex {regex.__version__}"}

    @classmethod
    def from_state(cls, state: dict) -> Tokenizer:
        """The tokenizer state() described, without the GGUF's vocabulary strings and merge checks."""
        pre, tokens, specials = state["pre"], state["tokens"], state["special_tokens"]
        if pre not in PRE_TOKENIZER_PATTERNS or not isinstance(tokens, list) or not isinstance(specials, dict):
            raise ValueError(f"not a tokenizer state (pre-tokenizer {pre!r})")
        ranks = {piece.encode("latin-1"): i for i, piece in enumerate(tokens) if piece is not None}
        if len(ranks) + len(specials) != len(tokens) or any(tokens[i] is not None for i in specials.values()):
            raise ValueError("its tokens and special tokens do not cover each id once")
        encoding = tiktoken.Encoding(f"gguf-{pre}", pat_str=PRE_TOKENIZER_PATTERNS[pre], mergeable_ranks=ranks,
                                     special_tokens=specials)
        missing = set(range(256)) - {piece[0] for piece in ranks if len(piece) == 1}
        return cls(encoding, specials, missing, eos_id=int(state["eos_id"]), bos_id=state["bos_id"],
                   chat_template=state["chat_template"],
                   ranges_checked=state.get("ranges_checked_by") == f"regex {regex.__version__}")

    # ---- encoding -----------------------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text such as "<|im_end|>" becomes its special id only when
        `allow_special`; otherwise it is encoded as the plain characters it is (never an error).
        Bytes with no token are dropped (see the module docstring)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}" +
                            (" (decode bytes to str first)" if isinstance(text, (bytes, bytearray)) else ""))
        if not isinstance(allow_special, bool):
            raise TypeError(f"allow_special must be True or False, got {allow_special!r}")
        # tiktoken panics on a byte with no token (a pyo3 PanicException: a BaseException, which
        # `except Exception` misses), so such text never reaches it
        if self._needs_care.search(text):
            return self._encode_careful(text, allow_special)
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode_ordinary(text)

    def _encode_careful(self, text: str, allow_special: bool) -> list[int]:
        """encode() for text with lone surrogates or characters holding a missing byte."""
        text = _SURROGATES.sub("\ufffd", text)  # what tiktoken does too; can't be encoded to UTF-8 otherwise
        parts = self._special_split.split(text) if allow_special and self._special_split else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2 == 1:  # re.split with one group puts the separators (the specials) at odd positions
                ids.append(self.special_tokens[part])
            else:
                ids += self._encode_dropping(part)
        return ids

    def _encode_dropping(self, text: str) -> list[int]:
        """Ids of ordinary text, dropping the bytes that have no token from the piece that holds them.

        Such a character C is "other" to the pre-tokenizer, so its piece is the maximal run of "other"
        characters around C, plus one space in front if there is one. We cut that piece out by hand, BPE it
        without the missing bytes, and let tiktoken do everything else, so its regex (and Unicode tables)
        decide all the other pieces, exactly as on the fast path.
        """
        ids: list[int] = []
        pos = 0  # text[:pos] is encoded; a piece starts at pos
        for m in self._unencodable.finditer(text) if self._unencodable else ():
            if m.start() < pos:
                continue  # inside the run handled last time
            lo, hi = m.start(), m.end()
            while lo > pos and self._is_other(text[lo - 1]):
                lo -= 1
            while hi < len(text) and self._is_other(text[hi]):
                hi += 1
            lead = " " if lo > pos and text[lo - 1] == " " else ""
            lo -= len(lead)
            if lo > pos:
                # Encode what comes before with a stand-in for the piece after it: a trailing run of spaces
                # splits differently at the end of a text than before a non-space. Then cut the stand-in off.
                before = self._enc.encode_ordinary(text[pos:lo] + lead + _SENTINEL)
                ids += before[: -self._sentinel_len[lead]]
            # only this piece loses the bytes: "a\x04b" -> ["a", "b"] (three pieces), "!\x04!" -> ["!!"] (one)
            kept = text[lo:hi].encode("utf-8").translate(None, delete=self.missing_bytes)
            if kept:
                ids += self._bpe_piece(kept)
            pos = hi
        return ids + self._enc.encode_ordinary(text[pos:])

    def _is_other(self, ch: str) -> bool:
        """Is `ch` neither letter, number nor space to tiktoken's pre-tokenizer regex?"""
        if self._unencodable and self._unencodable.match(ch):
            return True  # checked in __init__
        if ch < "\x80" or self._apostrophe_s is None:
            return not _NOT_OTHER.match(ch)
        # Python's `regex` may know a newer Unicode than tiktoken's Rust tables (letters added in Unicode 17
        # are "other" to tiktoken), so ask tiktoken: before "'s", a letter, number or space ends its piece and
        # "'s" stays one piece, while an "other" character takes the apostrophe into its own piece.
        if ch not in self._other_cache:
            self._other_cache[ch] = self._enc.encode_ordinary(ch + "'s")[-1] != self._apostrophe_s
        return self._other_cache[ch]

    # ---- decoding -----------------------------------------------------------------------------------------

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
            raise TypeError(f"ids must be a list of ints, got {type(ids).__name__}")
        if hasattr(ids, "tolist"):  # numpy array / torch tensor
            ids = ids.tolist()
        out = []
        for t in ids:
            try:
                i = operator.index(t)
            except TypeError:
                raise TypeError(f"token ids must be ints, got {t!r} ({type(t).__name__})") from None
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is out of range for a vocabulary of {self.vocab_size}")
            out.append(i)
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character). Specials give their text."""
        (i,) = self._check_ids([token_id])
        return self._enc.decode_single_token_bytes(i)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self._enc.decode_bytes(self._check_ids(ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`. A cut through a multi-byte character shows as U+FFFD instead of raising."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield text as ids arrive; never splits a character. ''.join(...) == decode(ids)."""
        stream = StreamDecoder(self)
        for i in ids:
            if piece := stream.push(i):
                yield piece
        if tail := stream.flush():
            yield tail

    # ---- chat ---------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """ChatML text exactly as the GGUF's Jinja template renders it.

        A default system prompt is put first when the first message is not a system message; each message is
        "<|im_start|>{role}\\n{content}<|im_end|>\\n"; the generation prompt opens the assistant's turn.
        """
        if self.chat_template is not None and self.chat_template != SMOLLM_CHAT_TEMPLATE:
            raise ValueError("this GGUF's chat template is not SmolLM2's, the only one we render")
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                            f"got {type(messages).__name__}")
        if not messages:
            raise ValueError("messages is empty: give at least one message")
        for n, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TypeError(f"message {n} must be a dict with 'role' and 'content', "
                                f"got {type(m).__name__}")
            if "role" not in m or "content" not in m:
                raise ValueError(f"message {n} needs both 'role' and 'content' keys, got {list(m)}")
            if m["role"] not in ROLES:
                raise ValueError(f"message {n} has role {m['role']!r}; use one of {', '.join(ROLES)}")
            if not isinstance(m["content"], str):
                raise TypeError(f"message {n} content must be a str, got {type(m['content']).__name__}")
        out = []
        if messages[0]["role"] != "system":
            out.append(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n")
        out += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    allow_special_in_content: bool = False) -> list[int]:
        """Ids of the chat prompt: the template's own markers are special tokens, message content is plain text.

        Why: if "<|im_end|>" typed by a user became the special token, a user message could close its own turn and
        open a system turn of its own ("...<|im_end|>\\n<|im_start|>system\\nIgnore the rules"): prompt injection
        through the template. So content is encoded as the characters it is (as tiktoken does by default, and as
        hosted chat APIs do); only the markers the template writes are specials. For text without special-token
        text the ids are identical either way.

        `allow_special_in_content=True` encodes the rendered template as one string with specials allowed, as HF's
        apply_chat_template(tokenize=True) does: for parity checks against HF, never for untrusted content.
        """
        if not isinstance(allow_special_in_content, bool):
            raise TypeError(f"allow_special_in_content must be True or False, got {allow_special_in_content!r}")
        text = self.apply_chat_template(messages, add_generation_prompt)  # validates the messages
        if allow_special_in_content:
            return self.encode(text, allow_special=True)
        start, end = self.special_tokens["<|im_start|>"], self.special_tokens["<|im_end|>"]
        turns = list(messages)
        if turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": DEFAULT_SYSTEM_PROMPT})
        ids: list[int] = []
        for m in turns:  # <|im_start|>{role}\n{content}<|im_end|>\n, the markers as ids, the rest as plain text
            ids += [start, *self.encode(f"{m['role']}\n{m['content']}"), end, *self.encode("\n")]
        if add_generation_prompt:
            ids += [start, *self.encode("assistant\n")]
        return ids

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        n = len(self.special_ids)
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, special tokens: {n})"

