"""The OpenAI fields clients send (issue 28): logprobs / top_logprobs, n, presence / frequency / repetition
penalties, seed, min_tokens, honoured by the in-process engine and over HTTP (completions and chat, streamed or
not). Oracles: the model run directly (float64 log_softmax of its logits), a hand-written penalty rule and a naive
decode loop that applies it, the in-process engine for the server."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.api import generate_ids
from minillm.config import ModelConfig
from minillm.engine import LLM
from minillm.model import Transformer
from minillm.sampling import SamplingParams, adjust_logits, apply_penalties, logits_to_probs, sample, sample_batch
from minillm.speculative.decoding import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "smollm2-135m"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time there was a little cat. The little cat"


# --------------------------------------------------------------------------------------------- the rules, alone


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> list[float]:
    """OpenAI's and vLLM's rules, one token at a time: CTRL's repetition penalty over prompt and output, then
    frequency * count + presence * (count > 0) over the output."""
    out = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        out.append(x - frequency * count - presence * (count > 0))
    return out


@given(st.lists(st.floats(-5, 5), min_size=8, max_size=8), st.lists(st.integers(0, 7), max_size=6),
       st.lists(st.integers(0, 7), max_size=12), st.floats(-2, 2), st.floats(-2, 2),
       st.sampled_from([1.0, 0.5, 1.3, 2.0]))
def test_penalties_equal_a_hand_computed_reference(logits, prompt, output, presence, frequency, repetition):
    got = apply_penalties(torch.tensor(logits), prompt, output, presence, frequency, repetition)
    want = reference_penalties(torch.tensor(logits).tolist(), prompt, output, presence, frequency, repetition)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_min_tokens_masks_the_stop_tokens_until_reached():
    history = type("History", (), {"prompt_ids": [1], "output_ids": [2, 3], "stop_ids": frozenset({0, 5})})
    logits = torch.zeros(8)
    masked = adjust_logits(logits, SamplingParams(max_tokens=9, min_tokens=3), history)
    assert masked[[0, 5]].isneginf().all() and torch.isfinite(masked[[1, 2, 3, 4, 6, 7]]).all()
    assert torch.isfinite(adjust_logits(logits, SamplingParams(max_tokens=9, min_tokens=2), history)).all()
    with pytest.raises(ValueError, match="history"):  # a row with penalties needs to know what came before
        sample_batch(logits[None], [SamplingParams(frequency_penalty=1.0)], [None])


@pytest.mark.parametrize("kwargs,words", [
    ({"n": 0}, r"n \(samples"), ({"presence_penalty": 2.5}, "presence_penalty must be"),
    ({"frequency_penalty": -3}, "frequency_penalty must be"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be"), ({"top_logprobs": 2}, "needs logprobs"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens must be"), ({"frequency_penalty": math.nan}, "frequency"),
])
def test_bad_values_are_refused_in_process(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_sample_i_of_n_is_seeded_with_seed_plus_i():
    p = SamplingParams(n=3, seed=41, temperature=1.0)
    assert [p.for_sample(i).seed for i in range(3)] == [41, 42, 43] and p.for_sample(2).n == 1
    assert SamplingParams(n=2).for_sample(1).seed is None and SamplingParams(seed=2**64 - 1).for_sample(1).seed == 0


# ------------------------------------------------------------------------------ the engine against a naive loop


@pytest.fixture(scope="module")
def flat_tiny():
    """A tiny random model with a flattened output (norm scaled down), so penalties and seeds change answers."""
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=2, max_seq_len=96)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.norm.weight.mul_(0.1)
    return model


def naive_decode(model, prompt: list[int], p: SamplingParams, stop_ids: set[int]) -> list[int]:
    """Recompute everything each step, penalise with the hand-written rule, mask stops before min_tokens."""
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    out: list[int] = []
    while len(out) < p.max_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out]))[0, -1].tolist()
        row = torch.tensor(reference_penalties(logits, prompt, out, p.presence_penalty, p.frequency_penalty,
                                               p.repetition_penalty))
        if len(out) < p.min_tokens:
            row[sorted(stop_ids)] = float("-inf")
        if p.temperature == 0:
            tok = int(row.argmax())
        else:
            tok = int(sample(logits_to_probs(row[None], p.temperature, p.top_k, p.top_p), gen)[0])
        out.append(tok)
        if tok in stop_ids:
            break
    return out


PENALISED = [
    SamplingParams(max_tokens=12, frequency_penalty=1.5),
    SamplingParams(max_tokens=12, presence_penalty=2.0, repetition_penalty=1.8),
    SamplingParams(max_tokens=12, repetition_penalty=0.7, temperature=0.8, seed=3),
    SamplingParams(max_tokens=12, frequency_penalty=-1.0, presence_penalty=0.5, temperature=1.2, seed=9, top_k=20),
    SamplingParams(max_tokens=12, min_tokens=8, stop_ids={7, 11, 12}, temperature=1.0, seed=1),
]


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", k=3, ngram_min=1)])
def test_engine_penalties_and_min_tokens_equal_a_naive_loop(flat_tiny, speculative):
    """Batched together (greedy rows in one argmax), with a plain request beside them; with speculation on, the
    requests with penalties or under min_tokens decode without drafts and still equal the naive loop."""
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 8, 7], [1, 2, 1, 2, 1, 2], [5] * 10, [2, 3]]
    llm = LLM.from_model(flat_tiny, num_blocks=64, block_size=4, speculative=speculative)
    outs = llm.generate(prompts, PENALISED)
    for i, (prompt, p, out) in enumerate(zip(prompts, PENALISED, outs)):
        assert out.token_ids == naive_decode(flat_tiny, prompt, p, p.stop_ids), f"request {i}"
    assert len(outs[-1].token_ids) >= 8  # min_tokens held the three stop tokens back
    if speculative is not None:
        proposed = llm.spec_stats.proposed
        llm.generate(prompts[:4], PENALISED[:4])
        assert llm.spec_stats.proposed == proposed  # no drafts for a request with penalties
        repetitive = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]
        plain = llm.generate([repetitive], SamplingParams(max_tokens=12))[0]  # the drafts of the others
        assert plain.token_ids == naive_decode(flat_tiny, repetitive, SamplingParams(max_tokens=12), set())
        assert llm.spec_stats.proposed > proposed


def test_the_single_sequence_loop_refuses_what_only_the_engine_honours(flat_tiny):
    with pytest.raises(ValueError, match="honoured by the engine"):
        list(generate_ids(flat_tiny, [1, 2], SamplingParams(max_tokens=2, frequency_penalty=1.0)))
    with pytest.raises(ValueError, match="add_samples"):
        LLM.from_model(flat_tiny, num_blocks=16, block_size=4).add_request([1, 2], SamplingParams(max_tokens=2, n=2))


# ----------------------------------------------------------------------------------- the real model, in process


def oracle_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """float64 log_softmax of the model's logits at each generated position, from one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated]))[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(generated)].double().log_softmax(-1)


def check_logprobs(model, out, k: int) -> None:
    want = oracle_logprobs(model, out.prompt_token_ids, out.token_ids)
    chosen = want[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), chosen, atol=2e-3, rtol=0)
    assert len(out.top_logprobs) == len(out.token_ids)
    for row, top, tok, lp in zip(want, out.top_logprobs, out.token_ids, out.logprobs):
        values = [v for _, v in top]
        assert len(top) == k and values == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values, dtype=torch.float64), row.topk(k).values, atol=2e-3, rtol=0)
        assert values[0] >= lp - 1e-6 and (tok not in dict(top) or dict(top)[tok] == pytest.approx(lp, abs=1e-5))


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", k=4)])
def test_logprobs_are_the_raw_log_softmax_of_the_model(real_model, speculative):
    """Greedy and sampled (raw logits: temperature does not change them), and through speculative verification,
    whose accepted drafts get theirs from the verify rows."""
    model, tok = real_model
    llm = LLM.from_model(model, tok, num_blocks=32, speculative=speculative)
    prompt = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat"
    params = [SamplingParams(max_tokens=10, logprobs=True, top_logprobs=5),
              SamplingParams(max_tokens=6, temperature=1.5, seed=4, logprobs=True, top_logprobs=3)]
    outs = llm.generate([prompt, "The capital of France is"], params)
    for out, p in zip(outs, params):
        check_logprobs(model, out, p.top_logprobs)
    assert all(outs[0].top_logprobs[i][0][0] == t for i, t in enumerate(outs[0].token_ids))  # greedy: the argmax
    if speculative is not None:
        assert llm.spec_stats.accepted > 0


def test_frequency_penalty_gives_fewer_repeats(real_model):
    model, tok = real_model
    llm = LLM.from_model(model, tok, num_blocks=32)
    plain, penalised = llm.generate([STORY] * 2, [SamplingParams(max_tokens=40, ignore_eos=True),
                                                  SamplingParams(max_tokens=40, ignore_eos=True,
                                                                 frequency_penalty=1.5)])

    def repeats(ids: list[int]) -> int:
        return len(ids) - len(set(ids))

    assert repeats(penalised.token_ids) < repeats(plain.token_ids), (plain.text, penalised.text)


def test_n_samples_reproducible_distinct_and_one_prefill(real_model):
    model, tok = real_model
    llm = LLM.from_model(model, tok, num_blocks=64, block_size=16, enable_prefix_caching=True)
    long_prompt = STORY + " " + STORY  # > 1 block: its full blocks are computed once and shared
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=4)
    first = llm.generate([long_prompt], seeded)
    assert len(first) == 4 and [o.request_id.rsplit("-", 1)[1] for o in first] == ["0", "1", "2", "3"]
    assert len({tuple(o.token_ids) for o in first}) > 1  # different seeds, different samples
    stats = llm.prefix_cache_stats
    n_blocks = (len(first[0].prompt_token_ids) - 1) // 16
    assert n_blocks >= 1 and stats.hit_tokens >= 3 * n_blocks * 16  # samples 1..3 reused sample 0's prompt
    again = llm.generate([long_prompt], seeded)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    alone = llm.generate([long_prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=13))[0]
    assert alone.token_ids == first[2].token_ids  # sample i is the request seeded with seed + i
    greedy = llm.generate([long_prompt, "Hi"], SamplingParams(max_tokens=6, n=3))
    assert len(greedy) == 6 and len({tuple(o.token_ids) for o in greedy[:3]}) == 1
    assert llm.num_free_blocks() == llm.block_manager.num_blocks


def test_min_tokens_suppresses_an_early_stop(real_model):
    model, tok = real_model
    llm = LLM.from_model(model, tok, num_blocks=32)
    short, forced = llm.chat([PARIS] * 2, [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, min_tokens=30)])
    assert short.finish_reason == "stop" and len(short.token_ids) < 30
    assert len(forced.token_ids) >= 30 and not set(forced.token_ids[:29]) & set(tok.stop_ids)


# ------------------------------------------------------------------------------------------------- over HTTP

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

from tests.test_server import running, sse, wait_clean  # noqa: E402  (after the skips: they need fastapi)

JSON = {"content-type": "application/json"}
ENGINE = {"num_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 256, "enable_prefix_caching": True}


@pytest.fixture(scope="module")
def server(real_model):
    model, tok = real_model
    with running(LLM.from_model(model, tok, **ENGINE), max_body_bytes=64 << 10) as s:
        yield s


@pytest.fixture(scope="module")
def oracle(real_model):
    model, tok = real_model
    return LLM.from_model(model, tok, **ENGINE)


@pytest.fixture(autouse=True)
def _clean_after(request):
    yield
    if "server" in request.fixturenames:
        wait_clean(request.getfixturevalue("server").llm)


def post(server, path: str, body: dict, stream: bool = False):
    """The JSON answer, or the stream's chunks (without [DONE])."""
    r = httpx.post(server.url + path, content=json.dumps({**body, "stream": stream}), headers=JSON, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    data = sse(r)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completions_logprobs_legacy_shape_equal_the_engine(server, oracle, real_model):
    tok = real_model[1]
    want = oracle.generate(["The capital of France is"], SamplingParams(max_tokens=6, logprobs=True,
                                                                        top_logprobs=3))[0]
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 3}
    lp = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    def text(t: int) -> str:
        return tok.token_bytes(t).decode("utf-8", errors="replace")

    strings = [text(t) for t in want.token_ids]
    assert lp["tokens"] == strings and lp["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
    assert lp["text_offset"] == [sum(map(len, strings[:i])) for i in range(len(strings))]
    for top, alts, s in zip(lp["top_logprobs"], want.top_logprobs, strings):
        assert set(top) == {text(a) for a, _ in alts} | {s}  # the 3 most likely and the chosen (OpenAI's rule)
    chunks = post(server, "/v1/completions", body, stream=True)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert sum((c["tokens"] for c in streamed), []) == lp["tokens"]
    assert sum((c["text_offset"] for c in streamed), []) == lp["text_offset"]
    zero = post(server, "/v1/completions", {**body, "logprobs": 0})["choices"][0]["logprobs"]
    assert all(list(d) == [s] for d, s in zip(zero["top_logprobs"], strings))


def test_chat_logprobs_content_equal_the_engine_streamed_or_not(server, oracle, real_model):
    tok = real_model[1]
    want = oracle.chat([PARIS], SamplingParams(max_tokens=12, logprobs=True, top_logprobs=2))[0]
    body = {"messages": PARIS, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = post(server, "/v1/chat/completions", body)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == len(want.token_ids) == r["usage"]["completion_tokens"]  # the stop token included
    for entry, t, lp, top in zip(content, want.token_ids, want.logprobs, want.top_logprobs):
        assert bytes(entry["bytes"]) == tok.token_bytes(t) and entry["logprob"] == pytest.approx(lp, abs=1e-4)
        assert [bytes(a["bytes"]) for a in entry["top_logprobs"]] == [tok.token_bytes(a) for a, _ in top]
        assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx([v for _, v in top], abs=1e-4)
    chunks = post(server, "/v1/chat/completions", body, stream=True)
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == content
    plain = post(server, "/v1/chat/completions", {"messages": PARIS, "max_tokens": 2})
    assert plain["choices"][0]["logprobs"] is None


def test_n_choices_are_indexed_seeded_and_counted(server, oracle):
    body = {"prompt": STORY, "max_tokens": 5, "temperature": 1.0, "seed": 5, "n": 3}
    r = post(server, "/v1/completions", body)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    want = oracle.generate([STORY], SamplingParams(max_tokens=5, temperature=1.0, seed=5, n=3))
    assert [c["text"] for c in r["choices"]] == [o.text for o in want]
    assert r["usage"]["prompt_tokens"] == len(want[0].prompt_token_ids)  # once, not n times
    assert r["usage"]["completion_tokens"] == 15
    chunks = post(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}}, stream=True)
    texts = ["", "", ""]
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        texts[ch["index"]] += ch["text"]
    assert texts == [o.text for o in want] and chunks[-1]["usage"]["completion_tokens"] == 15
    chat = post(server, "/v1/chat/completions", {"messages": PARIS, "max_tokens": 6, "temperature": 0, "n": 2})
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]  # greedy: n identical answers
    chat_body = {"messages": PARIS, "max_tokens": 3, "temperature": 1.0, "seed": 5, "n": 3}
    roles = [ch["index"] for c in post(server, "/v1/chat/completions", chat_body, stream=True)
             for ch in c["choices"] if ch["delta"].get("role")]
    assert roles == [0, 1, 2]  # each streamed chat choice announces its role


def test_penalties_min_tokens_and_seed_equal_the_engine(server, oracle):
    extra = {"presence_penalty": 0.8, "frequency_penalty": 1.2, "repetition_penalty": 1.3}
    params = SamplingParams(max_tokens=12, presence_penalty=0.8, frequency_penalty=1.2, repetition_penalty=1.3)
    want = oracle.generate([STORY], params)[0]
    r = post(server, "/v1/completions", {"prompt": STORY, "max_tokens": 12, "temperature": 0, **extra})
    assert r["choices"][0]["text"] == want.text
    chunks = post(server, "/v1/completions", {"prompt": STORY, "max_tokens": 12, "temperature": 0, **extra},
                  stream=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    forced = post(server, "/v1/chat/completions", {"messages": PARIS, "max_tokens": 30, "temperature": 0,
                                                   "min_tokens": 25})
    assert forced["usage"]["completion_tokens"] >= 25
    for path, body in (("/v1/completions", {"prompt": STORY}), ("/v1/chat/completions", {"messages": PARIS})):
        a, b, c = (post(server, path, {**body, "max_tokens": 8, "temperature": 1.0, "seed": s})["choices"][0]
                   for s in (3, 3, 4))
        assert a == b and a != c, path  # the seed reproduces an answer, another seed gives another


BAD = [
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 129}, "n"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"seed": -1}, "seed"),
]


@pytest.mark.parametrize("path,fields,param", BAD, ids=[f"{p[4:8]}-{f}" for p, f, _ in BAD])
def test_bad_values_get_a_400_naming_the_field(server, path, fields, param):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": PARIS}
    r = httpx.post(server.url + path, content=json.dumps({**body, **fields}), headers=JSON)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert not server.llm.has_unfinished()


def test_the_official_client_sends_them_all(server, oracle):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": PARIS[0]["content"], "name": "ada"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.7, seed=2, n=2,
                                       logprobs=True, top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.5)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in c.logprobs.content)
    # developer is a system turn and name has no place in the template: the engine with the same settings agrees
    want = oracle.chat([[{"role": "system", "content": "Answer briefly."}, PARIS[0]]],
                       SamplingParams(max_tokens=8, temperature=0.7, seed=2, n=2, presence_penalty=0.5,
                                      frequency_penalty=0.5))
    assert [c.message.content for c in r.choices] == [o.text for o in want]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in want)
    done = client.completions.create(model=MODEL, prompt=STORY, max_tokens=4, temperature=1.0, seed=9, logprobs=2,
                                     extra_body={"min_tokens": 4, "repetition_penalty": 1.2})
    assert len(done.choices[0].logprobs.tokens) == 4 and done.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2, top_logprobs=2)
