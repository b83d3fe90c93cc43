"""`minillm serve` behind a real router: sglang-router from PyPI (minillm/cluster/http_router.py; lesson 13).

Two servers and the router on loopback, started once for the module (the kill test runs last: it takes a server
down). The router registers the servers through their /server_info and /model_info; chats that share a long system
prompt land on one server (each server's own /metrics say where every request went, and count its prefix-cache
hits); a server SIGKILLed mid-stream fails its in-flight request with a clear error, the router takes it out of
rotation, and the next requests succeed on the other server. Every call has a timeout; every process is stopped."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("sglang_router", reason="the router under test: pip install sglang-router")
httpx = pytest.importorskip("httpx2")

from minillm.cluster.http_router import counters, http_fleet, shared_prefix_chats, stream_chat

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
TIMEOUT = 120  # seconds for any one request: generous for 2 shared cores, finite so nothing hangs


@pytest.fixture(scope="module")
def fleet():
    # small limits: 4 sequences a step, 8 may wait; one torch thread per server
    with http_fleet(2, "cache_aware", server_options=("--max-num-seqs", "4", "--max-waiting", "8",
                                                      "--enable-prefix-caching")) as f:
        yield f


def requests_by_server(fleet) -> list[float]:
    return [counters(u)["requests_total"] for u in fleet.servers]


def served_by(fleet, before: list[float]) -> int:
    """The one server whose request count grew since `before`."""
    grew = [i for i, (a, b) in enumerate(zip(requests_by_server(fleet), before)) if a > b]
    assert len(grew) == 1, f"expected one server to take the request, counts went {before} -> {grew}"
    return grew[0]


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)
    return value


def test_the_router_registers_both_servers_under_the_model_name(fleet):
    workers = httpx.get(fleet.url + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.servers)
    assert all(w["is_healthy"] and w["model_id"] == MODEL for w in workers)
    assert [m["id"] for m in httpx.get(fleet.url + "/v1/models", timeout=10).json()["data"]] == [MODEL]
    info = httpx.get(fleet.servers[0] + "/server_info", timeout=10).json()
    assert info["served_model_name"] == MODEL and info["dp_size"] == 1 and info["enable_prefix_caching"] is True
    assert info["max_running_requests"] == 4
    assert httpx.get(fleet.servers[0] + "/get_model_info", timeout=10).json()["served_model_name"] == MODEL
    load = httpx.get(fleet.servers[0] + "/get_load", timeout=10).json()
    assert load[0]["num_reqs"] == 0 and load[0]["num_waiting_reqs"] == 0


def test_chats_sharing_a_prefix_land_on_one_server_and_hit_its_cache(fleet):
    """Group A's first chat is still running when group B's first arrives, so the router (no prefix match yet)
    sends B to the less loaded server; after that each chat matches its group's text and follows it."""
    chats, groups = shared_prefix_chats(2, 1, 1300)
    a, b = (chats[groups.index(g)][0] for g in (0, 1))  # each group's system turn

    def chat(system: dict, k: int) -> list[dict]:
        return [system, {"role": "user", "content": f"Question {k}: what is the first keyword it mentions?"}]

    hits0 = [counters(u)["prefix_cache_hits_total"] for u in fleet.servers]
    before = requests_by_server(fleet)
    first = {}
    runner = threading.Thread(target=lambda: first.update(stream_chat(fleet.url, chat(a, 0), 48, TIMEOUT)))
    runner.start()
    try:
        wait_until(lambda: requests_by_server(fleet) != before, 60, "group A's first chat to reach a server")
        where_a = served_by(fleet, before)
        before = requests_by_server(fleet)
        assert stream_chat(fleet.url, chat(b, 0), 4, TIMEOUT)["error"] is None
        where_b = served_by(fleet, before)
    finally:
        runner.join(TIMEOUT)
    assert not runner.is_alive() and first["error"] is None, first
    assert where_a != where_b, "group B's first chat should go to the idle server"
    for k in range(1, 3):
        for system, home in ((a, where_a), (b, where_b)):
            before = requests_by_server(fleet)
            r = stream_chat(fleet.url, chat(system, k), 4, TIMEOUT)
            assert r["error"] is None, r
            assert served_by(fleet, before) == home, f"chat {k} of its group left the server holding its prefix"
    for i, u in enumerate(fleet.servers):  # two repeats of a ~300-token system prompt on each server
        gained = counters(u)["prefix_cache_hits_total"] - hits0[i]
        assert gained >= 2 * 200, f"server {i}: only {gained} prompt tokens came from its prefix cache"


def test_a_killed_server_fails_its_stream_clearly_and_is_routed_around(fleet):
    """SIGKILL the server streaming a long answer: the client sees the stream break (the router cannot resume a
    stream already under way), within seconds, not a hang; the router marks the server unhealthy, and the next
    requests, the killed server's group included, are answered by the other one."""
    chats, _ = shared_prefix_chats(2, 2, 1300)
    result, before = {}, requests_by_server(fleet)
    runner = threading.Thread(target=lambda: result.update(stream_chat(fleet.url, chats[0], 400, TIMEOUT)))
    runner.start()
    try:
        wait_until(lambda: requests_by_server(fleet) != before, 60, "the long chat to reach a server")
        victim = served_by(fleet, before)
        wait_until(lambda: counters(fleet.servers[victim]).get("requests_running", 0) >= 1, 60, "it to run")
        time.sleep(1.0)  # into its decode
        killed_at = time.monotonic()
        fleet.processes[victim].kill()
    finally:
        runner.join(TIMEOUT)
    assert not runner.is_alive(), "the in-flight stream hung after its server was killed"
    assert result["error"] is not None or result["finish"] == "length", result  # failed clearly, or retried whole
    assert time.monotonic() - killed_at < 30
    survivor = 1 - victim
    wait_until(lambda: not next(w["is_healthy"] for w in httpx.get(fleet.url + "/workers", timeout=10).json()
                                ["workers"] if w["url"] == fleet.servers[victim]), 30, "the router to mark it down")
    start = counters(fleet.servers[survivor])["requests_total"]
    for chat in chats:
        t0 = time.monotonic()
        r = stream_chat(fleet.url, chat, 4, TIMEOUT)
        assert r["error"] is None and r["finish"] == "length", r
        assert time.monotonic() - t0 < TIMEOUT
    assert counters(fleet.servers[survivor])["requests_total"] - start == len(chats)
