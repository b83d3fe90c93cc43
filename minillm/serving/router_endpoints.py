"""What a router asks a worker before it sends it traffic (lesson 13): `minillm serve` behind sglang-router.

A fleet of servers sits behind a router that is not ours (sglang-router from PyPI; vllm-router is its fork). To
register a worker it GETs /health (server.py), /server_info and /model_info (the older /get_* names as fallbacks);
/get_load reports the load for its power_of_two policy. Everything else it forwards as it came: /v1/* already
speaks OpenAI. The hit counters the cache-aware policy is judged by are in /metrics (metrics.py).
"""

from __future__ import annotations

from importlib import metadata

from fastapi import FastAPI


def add_router_endpoints(app: FastAPI) -> None:
    """Add the router's worker endpoints to the app build_app made (its Service is app.state.service)."""
    svc = app.state.service
    llm, name = svc.llm, svc.model_name
    try:
        version = "minillm " + metadata.version("minillm")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        version = "minillm"

    async def model_info() -> dict:
        """No model_path or tokenizer_path on purpose: sglang-router would try to fetch a tokenizer for that path
        from Hugging Face. Over HTTP it routes on the request's text and needs none; served_model_name alone names
        the model in the router's /v1/models and its per-model policy."""
        return {"served_model_name": name, "is_generation": True, "model_type": "llama",
                "max_model_len": llm.max_model_len}

    async def server_info() -> dict:
        """One engine, no data or tensor parallel inside it (dp_size 1: the router makes one worker of it), and the
        engine limits a reader of the router's /workers wants to see."""
        bm = llm.block_manager
        return {"served_model_name": name, "version": version, "dp_size": 1, "tp_size": 1,
                "max_running_requests": llm.scheduler.max_num_seqs,
                "max_num_batched_tokens": llm.scheduler.max_num_batched_tokens,
                "max_total_num_tokens": bm.num_blocks * bm.block_size, "page_size": bm.block_size,
                "enable_prefix_caching": bm.prefix_caching, "max_model_len": llm.max_model_len}

    async def load() -> list[dict]:
        """SGLang's shape, one entry per data-parallel rank: requests in the engine, waiting, KV tokens held. Read
        without the engine's lock, as /health does: a snapshot a step may be changing, good enough to balance on."""
        bm = llm.block_manager
        return [{"dp_rank": 0, "num_reqs": len(svc.engine.in_flight), "num_waiting_reqs": len(llm.scheduler.waiting),
                 "num_tokens": (bm.num_blocks - llm.num_free_blocks()) * bm.block_size}]

    for path, fn in (("/model_info", model_info), ("/get_model_info", model_info), ("/server_info", server_info),
                     ("/get_server_info", server_info), ("/get_load", load)):
        app.add_api_route(path, fn, methods=["GET"])


__all__ = ["add_router_endpoints"]
