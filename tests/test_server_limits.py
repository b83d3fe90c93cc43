"""Issue 40: no request can stall the server. What one request may cost (stop strings, logprobs, n: bounded, with
400s that say the limit), how long and how many connections the server holds (slowloris: header and body
deadlines, a connection limit), and /metrics whose sums add up once aborts and errors are counted. A tiny random
model with the real tokenizer keeps generation cheap, so what is timed is the server itself."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx2")

from minillm.engine import LLM  # noqa: E402
from minillm.gguf.tokenizer import Tokenizer  # noqa: E402
from minillm.serving.connections import ConnectionLimits  # noqa: E402
from minillm.serving.metrics import Histogram  # noqa: E402
from minillm.serving.openai_protocol import MAX_LOGPROBS, MAX_STOP_CHARS, json_pieces  # noqa: E402
from minillm.serving.stop_strings import StopMatcher  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_server import _clean_after, _QuadraticStopMatcher, running, sse, wait_clean  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Once upon a time"
IDS = [81, 278, 265, 260]  # "a b c the": ids below 512, for the module's server


@pytest.fixture(scope="module")
def tok(real_meta):
    return Tokenizer.from_gguf_metadata(real_meta)


def tiny_llm(tok, vocab_size: int | None = None, **engine) -> LLM:
    """A tiny random model over the real vocabulary, or over its first `vocab_size` tokens (then prompts must be
    ids below it): a step of 16 sequences costs 13 ms, or 3 ms over 512 tokens (sampling over 49,152 dominates)."""
    return LLM.from_model(tiny_model(vocab_size=vocab_size or tok.vocab_size, max_seq_len=2048), tok,
                          **{"num_blocks": 256, "max_num_seqs": 16, **engine})


def post(url: str, path: str, body: dict, timeout: float = 120):
    return httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=timeout)


@contextlib.contextmanager
def health_polled(url: str):
    """Poll /health every 10 ms while the block runs; yields the list of latencies (s), complete on exit."""
    latencies, done = [], threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                assert c.get(url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        yield latencies
    finally:
        done.set()
        poller.join(30)


# ------------------------------------------------------------------------------- what one request may cost


@pytest.fixture(scope="module")
def server(tok):
    with running(tiny_llm(tok, vocab_size=512, num_blocks=1700, max_num_seqs=64)) as s:
        yield s




def test_the_largest_requests_allowed_do_not_stall_health(server):
    """The largest n (the waiting room, 64) with four stop strings of the longest length allowed, then the most
    log-probabilities one plain answer may carry: /health answers within 100 ms (99% of polls; none over 500 ms).
    Before: each of the 64 choices built its own stop tables on the event loop (50-160 ms), and writing then encoding
    the logprobs of the answer held it for 1.3-1.6 s at its end."""
    stops = [("ab" * MAX_STOP_CHARS)[:MAX_STOP_CHARS - i] for i in range(4)]
    n, max_tokens, top = 64, 390, 20
    assert n * max_tokens * (top + 1) <= MAX_LOGPROBS < n * (max_tokens + 1) * (top + 1)  # max_tokens: the most
    with health_polled(server.url) as latencies:
        r = post(server.url, "/v1/completions", {"prompt": IDS, "n": 64, "max_tokens": 8, "stop": stops,
                                                 "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 64, r.text
        r = post(server.url, "/v1/completions", {"prompt": IDS, "n": n, "max_tokens": max_tokens,
                                                 "logprobs": top, "ignore_eos": True})
        assert r.status_code == 200, r.text
        time.sleep(0.05)
    lp = r.json()["choices"][n - 1]["logprobs"]
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == max_tokens  # (its alternatives may share a string)
    # the stalls were long (1.3-1.6 s) or many (64 x 50-160 ms): a lone 160 ms poll is the shared machine's
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    assert len(latencies) > 20 and p99 < 0.1 and max(latencies) < 0.5, (
        f"/health took up to {max(latencies) * 1e3:.0f} ms, 99th percentile {p99 * 1e3:.0f} ms")


CHAT = {"messages": [{"role": "user", "content": PROMPT}]}


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": IDS, "stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop", [f"at most {MAX_STOP_CHARS} characters"]),
    ({"prompt": IDS, "n": 65}, "n", ["lets 64 requests wait", "--max-waiting"]),
    ({"prompt": IDS, "n": 32, "max_tokens": 1000, "logprobs": 20}, "logprobs",
     [f"32 x 1000 x 21 = 672000 log-probabilities, over this server's limit of {MAX_LOGPROBS}", "max_tokens"]),
    ({**CHAT, "n": 13, "logprobs": True, "top_logprobs": 20}, "logprobs", ["13 x 20", "x 21", "max_tokens"]),
], ids=["stop", "n", "logprobs", "chat-logprobs-unset-max-tokens-is-all-the-room"])
def test_requests_past_a_limit_get_a_400_that_says_it(server, body, param, words):
    r = post(server.url, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and all(w in err["message"] for w in words), err
    assert not server.llm.has_unfinished()


def test_unknown_fields_are_one_log_line_however_many(server, caplog):
    extra = {f"x{i}": i for i in range(2000)}
    with caplog.at_level(logging.INFO, logger="minillm.serving.openai_protocol"):
        r = post(server.url, "/v1/completions", {"prompt": IDS, "max_tokens": 1, **extra})
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "minillm.serving.openai_protocol"]
    assert len(lines) == 1 and "ignoring 2000 field(s)" in lines[0] and "'x0'" in lines[0], lines


def test_a_plain_answer_encoded_in_slices_is_what_json_response_writes(server):
    """The slices (encode_json) join to the same bytes one JSONResponse would have written."""
    from starlette.responses import JSONResponse

    r = post(server.url, "/v1/completions", {"prompt": IDS, "n": 3, "max_tokens": 4, "logprobs": 2})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.content == JSONResponse(r.json()).body
    assert [len(c["logprobs"]["tokens"]) for c in r.json()["choices"]] == [4, 4, 4]


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                                max_size=4),
                     max_leaves=40)


@given(_json)
def test_json_pieces_join_to_json_response_bytes(obj):
    from starlette.responses import JSONResponse

    for run in (64, 2):  # the answer's logprobs lists (depth 4) are encoded `run` tokens at a time
        assert "".join(json_pieces({"a": [{"b": {"c": obj}}]}, run=run)).encode() == JSONResponse(
            {"a": [{"b": {"c": obj}}]}).body
    assert "".join(json_pieces(obj)).encode() == JSONResponse(obj).body


@given(stops=st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=4),
       ops=st.lists(st.tuples(st.text("abc", max_size=5), st.sampled_from(["on", "off", "flush"])), max_size=12))
def test_stop_matchers_sharing_tables_and_flushing_equal_the_quadratic_one(stops, ops):
    """The n choices' matchers share one set of tables; a flush mid-stream starts matching afresh (the old
    matcher's empty buffer)."""
    first = StopMatcher(stops)
    new, old = StopMatcher(stops, first.tables), _QuadraticStopMatcher(stops)
    for text, op in ops:
        if op == "flush":
            assert new.flush() == old.flush()
            continue
        a, b = new.push(text, op == "on"), old.push(text, op == "on")
        assert a == b, (stops, ops)
        if a[1]:
            break


# ------------------------------------------------------------------------------------ slow clients (slowloris)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_after(sock: socket.socket, trickle: bytes = b"") -> tuple[float, bytes]:
    """Send `trickle` a byte every 0.1 s (then nothing) until the server closes; (seconds, what it sent)."""
    t0, got = time.monotonic(), b""
    sock.settimeout(0.1)
    for i in range(200):
        if i < len(trickle):
            try:
                sock.sendall(trickle[i:i + 1])
            except OSError:  # the server closed it: the next recv says so
                pass
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not data:
            break
        got += data
    return time.monotonic() - t0, got


def status_of(url: str, raw: bytes) -> int:
    with connect(url) as sock:
        sock.sendall(raw)
        _, got = closed_after(sock)
    return int(got.split(b" ", 2)[1]) if got else 0


GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def test_slow_headers_are_closed_and_a_slow_body_gets_408(tok):
    limits = ConnectionLimits(header_timeout=0.5, body_timeout=1.5)
    with running(tiny_llm(tok), limits=limits) as s:
        for trickle in (b"", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100):
            with connect(s.url) as sock:  # nothing at all; a request line and headers a byte at a time
                took, got = closed_after(sock, trickle)
            assert got == b"" and 0.4 < took < 0.5 + 1.0, (trickle[:20], took, got)
        with connect(s.url) as sock:  # kept alive after an answer: the next request's headers get the deadline
            sock.sendall(GET_HEALTH.replace(b"Connection: close\r\n", b""))
            time.sleep(0.8)  # idle longer than header_timeout: the keep-alive timeout (5 s) applies, not it
            took, got = closed_after(sock, b"GET /health HTTP/1.1\r\n")
            assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1") == 1 and 0.4 < took < 1.5, got

        body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        with connect(s.url) as sock:  # headers at once, the body over 1 s: past header_timeout, within body_timeout
            sock.sendall(head)
            for i in range(0, len(body), len(body) // 4 + 1):
                time.sleep(0.25)
                sock.sendall(body[i:i + len(body) // 4 + 1])
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        with connect(s.url) as sock:  # a body that stops arriving
            sock.sendall(head + body[:10])
            took, got = closed_after(sock)
        assert got.startswith(b"HTTP/1.1 408") and 1.4 < took < 1.5 + 1.0, (took, got)
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
        wait_clean(s.llm)


def test_connections_past_the_limit_get_503_and_past_twice_are_closed_unread(tok):
    with running(tiny_llm(tok), limits=ConnectionLimits(max_connections=2, header_timeout=5.0)) as s:
        idle = [connect(s.url)]
        assert status_of(s.url, GET_HEALTH) == 200  # 2 open: at the limit
        idle.append(connect(s.url))
        time.sleep(0.1)
        assert status_of(s.url, GET_HEALTH) == 503  # 3 open: uvicorn's "Service Unavailable"
        idle += [connect(s.url), connect(s.url)]
        time.sleep(0.1)
        with connect(s.url) as sock:  # the fifth open socket: closed at once, unread, unanswered
            took, got = closed_after(sock)
        assert got == b"" and took < 1.0
        for sock in idle:
            sock.close()
        time.sleep(0.1)
        assert status_of(s.url, GET_HEALTH) == 200


def test_serve_flags_set_the_connection_limits(monkeypatch, capsys):
    import minillm.engine
    import minillm.serving.server
    from minillm.cli import build_parser, main

    defaults = build_parser().parse_args(["serve"])
    assert ConnectionLimits(defaults.max_connections, defaults.header_timeout, defaults.body_timeout,
                            defaults.keep_alive_timeout) == ConnectionLimits()
    seen = {}
    monkeypatch.setattr(minillm.engine, "LLM", lambda model, **kw: object())
    monkeypatch.setattr(minillm.serving.server, "serve", lambda *a, **kw: seen.update(kw))
    assert main(["serve", "--max-connections", "9", "--header-timeout", "2", "--body-timeout", "3",
                 "--keep-alive-timeout", "4"]) == 0
    assert seen["limits"] == ConnectionLimits(9, 2.0, 3.0, 4.0)
    assert "9 at once (503 past that), headers within 2 s, bodies within 3 s" in capsys.readouterr().out
    assert main(["serve", "--header-timeout", "0"]) == 2
    assert "--header-timeout must be > 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the metrics


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base = name.split("{")[0]
            assert base in types or base.rsplit("_", 1)[0] in types, f"{name} has no # TYPE line"
            samples[name] = float(value)
    return samples


def histogram(m: dict[str, float], name: str) -> tuple[list[float], float, float]:
    buckets = [v for k, v in m.items() if k.startswith(f"minillm_{name}_bucket")]
    return buckets, m[f"minillm_{name}_sum"], m[f"minillm_{name}_count"]


def test_metrics_add_up_after_aborts_n_and_errors(tok):
    """Every request accepted ends once, by the reason its client got: requests_total is the sum of
    requests_finished_total; generated tokens are the engine's own count, and the usage of every answer that ran
    to its end; TTFT/TPOT have one observation per sequence that had a first/second token."""
    llm = tiny_llm(tok, enable_prefix_caching=True, max_num_seqs=4)
    story = PROMPT + ", a cat lived in a small house by the sea, and every morning it"  # > one block: cached
    prompt_len = len(tok.encode(story))
    with running(llm) as s:
        svc, retired = s.srv.app.state.service, {}
        record = svc.engine.on_retire

        def on_retire(out) -> None:  # the engine's own count of each sequence's tokens
            retired[out.request_id] = len(out.token_ids)
            record(out)

        svc.engine.on_retire = on_retire
        base, usage, prompts = {"prompt": story, "temperature": 0, "ignore_eos": True}, {}, 0
        for n, max_tokens in ((1, 5), (1, 8), (3, 4)):  # plain answers, one with 3 choices
            r = post(s.url, "/v1/completions", {**base, "n": n, "max_tokens": max_tokens}).json()
            usage[r["id"]] = (n, r["usage"])
        chat = {"messages": [{"role": "user", "content": story}], "n": 2, "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=chat, timeout=60) as r:
            events = [json.loads(e) for e in sse(r)[:-1]]
        usage[events[-1]["id"]] = (2, events[-1]["usage"])
        r = post(s.url, "/v1/completions", {**base, "max_tokens": 8}).json()
        text, usage[r["id"]] = r["choices"][0]["text"], (1, r["usage"])
        r = post(s.url, "/v1/completions", {**base, "max_tokens": 8, "stop": text[3:6]}).json()  # its own text
        assert len(text) >= 6 and r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] < 8
        prompts += r["usage"]["prompt_tokens"]  # its usage stops at the stop string; the engine may have gone on
        for bad in ({"n": 0}, {"stop": ""}):  # refused: never accepted, never counted
            assert post(s.url, "/v1/completions", {**base, **bad}).status_code == 400
        long = {**base, "max_tokens": 1500, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", s.url + "/v1/completions", json=long) as r:
            assert sum(1 for _, line in zip(range(8), r.iter_lines()) if line.startswith("data: ")) >= 3
        with pytest.raises(httpx.ReadTimeout):  # a plain request whose client gives up
            post(s.url, "/v1/completions", {**base, "max_tokens": 1500}, timeout=0.5)
        wait_clean(llm)
        real_step = llm.step

        def failing_step():
            llm.step = real_step
            raise RuntimeError("injected failure")

        llm.step = failing_step  # the next request fails before its first token
        assert post(s.url, "/v1/completions", {**base, "max_tokens": 50}).status_code == 500
        wait_clean(llm)
        m = scrape(s.url)
    prompts += sum(u["prompt_tokens"] for _, u in usage.values()) + 3 * prompt_len  # + 2 aborted, 1 failed
    finished = {k.split('"')[1]: v for k, v in m.items() if k.startswith("minillm_requests_finished_total")}
    assert finished == {"stop": 1, "length": 1 + 1 + 3 + 2 + 1, "abort": 2, "error": 1}, finished
    assert m["minillm_requests_total"] == sum(finished.values()) == len(retired) == 12
    assert m["minillm_generation_tokens_total"] == sum(retired.values())
    for rid, (n, u) in usage.items():  # answers that ran to their end: usage is what the engine generated
        assert u["completion_tokens"] == sum(retired[i] for i in ([rid] if n == 1 else [f"{rid}-{i}" for i in
                                                                                          range(n)])), rid
    assert m["minillm_prompt_tokens_total"] == prompts
    for name, least in (("time_to_first_token_seconds", 1), ("time_per_output_token_seconds", 2)):
        buckets, total, count = histogram(m, name)
        assert buckets == sorted(buckets) and buckets[-1] == count and total > 0, name
        assert count == sum(k >= least for k in retired.values()) < len(retired), name  # the failed one: none
    assert (m["minillm_requests_running"], m["minillm_requests_waiting"], m["minillm_kv_blocks_used"]) == (0, 0, 0)
    assert m["minillm_prefix_cache_queries_total"] >= m["minillm_prefix_cache_hits_total"] >= 16


def test_a_histogram_counts_a_value_on_a_bound_in_that_bucket():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    assert h.samples() == [('_bucket{le="0.1"}', 2), ('_bucket{le="1.0"}', 4), ('_bucket{le="+Inf"}', 5),
                           ("_sum", pytest.approx(8.65)), ("_count", 5)]
