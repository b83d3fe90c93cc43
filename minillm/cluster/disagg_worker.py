"""Inside the two worker processes of disaggregated serving (lesson 13): the wire and the two loops.

Each side runs its own engine and KV pool; what crosses between them is one request's KV blocks, once, over a
two-rank torch.distributed group (gloo / NCCL): `send_handoff` / `recv_handoff` are that wire, `_worker_main` the
prefill (rank 0) and decode (rank 1) loops.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from minillm.cache.kv_transfer import KVHandoff
from minillm.request import prompt_to_ids

PREFILL, DECODE = 0, 1  # ranks
ENGINE_KWARGS = ("num_blocks", "kv_cache_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens",
                 "kv_cache_dtype", "enable_prefix_caching")
_GROUP_TIMEOUT_S = 24 * 3600  # the receiver idles until the next handoff; liveness is the coordinator's job

# -------------------------------------------------------------------------------------------------- the wire


def send_handoff(h: KVHandoff, dst: int, device) -> None:
    """Header length, pickled header, then each payload tensor in name order."""
    head = pickle.dumps(h.header())
    dist.send(torch.tensor([len(head)], dtype=torch.int64, device=device), dst)
    dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device), dst)
    for name in sorted(h.payload):
        dist.send(h.payload[name].contiguous(), dst)


def recv_handoff(src: int, device) -> KVHandoff | None:
    """The next handoff from `src`, or None when it says it closes (a negative length)."""
    n = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(n, src)
    if n.item() < 0:
        return None
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.recv(buf, src)
    head = pickle.loads(buf.cpu().numpy().tobytes())
    payload = {}
    for name, shape, dtype in head["tensors"]:
        payload[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(payload[name], src)
    return KVHandoff.from_header(head, payload)


# ----------------------------------------------------------------------------------------------- the workers


def _worker_main(link, rank: int, spec, dtype: str, threads: int, engine_kwargs: dict, port: int, device: str,
                 fault: tuple[str, int] | None) -> None:
    """One worker (cluster/workers.py runs it; an exception is sent to the coordinator as "fatal"): loads the model,
    builds its own LLM and KV pool, joins the two-rank group and loops.

      prefill (rank 0)  requests -> LLM.add_prefill -> step -> each KVHandoff: its first token to the coordinator,
                        the handoff to rank 1 (`send_handoff`: a length, a pickled header, the KV tensors);
      decode (rank 1)   a receiver thread takes handoffs off the wire (`recv_handoff`) and tells the coordinator
                        each one "arrived" (from then on the request no longer needs the prefill worker), or that
                        the link is lost (after every handoff that came before); each joins the engine
                        (LLM.add_prefilled) once the pool has room, and its tokens stream back to the coordinator."""
    from minillm.engine import LLM
    from minillm.gguf.loader import load_spec
    from minillm.parallel.distributed import init_group, weights_checksum

    torch.set_num_threads(threads)
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else "cpu")
    model, tok = load_spec(spec, dtype, dev)
    llm = LLM.from_model(model, tok, **engine_kwargs)
    pool = llm.cache.spec
    link.send("ready", {"checksum": weights_checksum(model), "block_size": pool.block_size,
                        "kv_dtype": str(pool.storage_dtype), "layers": pool.n_layers,
                        "kv_heads": pool.n_kv_heads, "head_dim": pool.head_dim, "num_blocks": pool.num_blocks,
                        "vocab_size": model.config.vocab_size, "tokenizer": tok is not None})
    init_group(rank, 2, port, "nccl" if device == "cuda" else "gloo", _GROUP_TIMEOUT_S)
    try:
        (_prefill_loop if rank == PREFILL else _decode_loop)(llm, dev, link, fault)
    finally:
        dist.destroy_process_group()


def _prefill_loop(llm, device, link, fault) -> None:
    decode_alive, n_sent = True, 0
    # tests only: ("hold", n) stops stepping after n handoffs, so a kill drill finds requests on both sides
    hold = fault[1] if fault is not None and fault[0] == "hold" else None
    while True:
        msg = link.recv(0.0 if llm.has_unfinished() else 0.02)
        while msg is not None:
            if msg[0] == "stop":
                if decode_alive:  # tell the receiver thread to stop
                    try:
                        dist.send(torch.tensor([-1], dtype=torch.int64, device=device), DECODE)
                    except Exception:
                        pass
                return
            if msg[0] == "abort":
                if llm.abort(msg[1]):  # still prefilling here: nothing to hand over
                    llm.pop_output(msg[1])
            else:
                _, rid, prompt, params, chat = msg
                try:  # text in the chat template here: add_prefill continues text or ids as they are
                    ids = prompt_to_ids(prompt, llm.tokenizer, llm.model.config.vocab_size, chat)
                    llm.add_prefill(ids, params, request_id=rid)
                except (ValueError, TypeError) as e:
                    link.send("error", rid, f"refused: {e}")
            msg = link.recv()
        if llm.has_unfinished() and (hold is None or n_sent < hold):
            llm.step()
        for h in llm.pop_handoffs():
            link.send("prefilled", h.request_id, {"prompt_ids": h.prompt_ids, "nbytes": h.nbytes,
                                                  "t": time.perf_counter()})
            if h.finish_reason is not None:  # the first token ended it: nothing to move
                tok = llm.tokenizer
                text = tok.decode([t for t in h.output_ids if t not in h.stop_ids]) if tok is not None else ""
                link.send("token", h.request_id, h.output_ids[0], text, True, h.finish_reason)
                continue
            if not decode_alive:
                link.send("error", h.request_id, "the decode worker is gone: cannot hand the KV over")
                continue
            injected = fault[0] if fault is not None and fault[1] == n_sent else None  # tests only
            n_sent += 1
            if injected == "corrupt":
                next(iter(h.payload.values())).view(-1)[0] += 1
            try:
                t0 = time.perf_counter()
                if injected == "die_mid_transfer":
                    dist.send(torch.tensor([10**6], dtype=torch.int64, device=device), DECODE)
                    os._exit(3)
                send_handoff(h, DECODE, device)
                link.send("sent", h.request_id, {"t_send": t0})
            except Exception as e:  # the peer died: report, keep prefilling what can end here
                decode_alive = False
                link.send("error", h.request_id, f"KV transfer to the decode worker failed: {e}")


def _decode_loop(llm, device, link, fault) -> None:
    if fault is not None and fault[0] == "unpack":  # write part of the KV, then fail: blocks must come back
        from minillm.cache import kv_transfer
        real_unpack = kv_transfer.unpack_kv_blocks

        def broken_unpack(pool, block_table, payload):
            real_unpack(pool, block_table[:1], {n: t[:, :1] for n, t in payload.items()})
            raise RuntimeError("injected fault while writing the KV blocks")
        kv_transfer.unpack_kv_blocks = broken_unpack
    arrived: queue.Queue = queue.Queue()

    def receive() -> None:  # the only thread that touches the process group here
        try:
            while (h := recv_handoff(PREFILL, device)) is not None:
                t = time.perf_counter()
                # told at once, in wire order: the coordinator knows which requests no longer need the prefill
                link.send("arrived", h.request_id, {"t_recv": t})
                arrived.put((h, t))
        except Exception as e:  # the prefill worker is gone: every handoff it sent was reported above
            link.send("link_lost", f"{e}")

    threading.Thread(target=receive, daemon=True, name="kv-receiver").start()
    sink: queue.SimpleQueue = queue.SimpleQueue()
    pending: deque = deque()  # handoffs with no room yet: kept in order, never dropped
    aborted: set[str] = set()  # aborted before their handoff arrived: dropped when it does
    while True:
        while (msg := link.recv()) is not None:
            if msg[0] == "stop":
                return
            if msg[0] == "abort" and not llm.abort(msg[1]):
                aborted.add(msg[1])
        busy = llm.has_unfinished() or bool(pending)
        try:
            item = arrived.get_nowait() if busy else arrived.get(timeout=0.02)
            while True:
                pending.append(item)
                item = arrived.get_nowait()
        except queue.Empty:
            pass
        while pending:
            h, t_recv = pending[0]
            if h.request_id in aborted:
                aborted.discard(h.request_id)
                pending.popleft()
                continue
            if not llm.can_add_prefilled(h) and llm.has_unfinished():
                break  # blocks come back as decodes finish
            pending.popleft()
            try:
                llm.add_prefilled(h, sink)
                link.send("received", h.request_id, {"t_recv": t_recv, "t_added": time.perf_counter()})
            except Exception as e:  # it failed to land (checksum, unpack): add_prefilled gave its blocks back
                link.send("error", h.request_id, f"the decode worker refused the KV: {e}",
                          {"free_blocks": llm.num_free_blocks()})
        if llm.has_unfinished():
            llm.step()
        while not sink.empty():
            ev = sink.get()
            link.send("token", ev.request_id, ev.token_id, ev.text, ev.finished, ev.finish_reason)
            if ev.finished:
                llm.pop_output(ev.request_id)
                link.send("free_blocks", llm.num_free_blocks())
