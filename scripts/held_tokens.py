"""Greedy tokens of SmolLM2 on held prompts through every path (generate: contiguous, paged, speculative; the engine:
plain, prefix caching + int8 KV, speculative; disaggregated prefill/decode; two replicas), written as JSON. Run it
before and after a change that should not change any token, then compare:

    python scripts/held_tokens.py before.json     # on the old checkout
    python scripts/held_tokens.py after.json --compare before.json
"""

from __future__ import annotations

import argparse
import json

import torch

import minillm
from minillm import SamplingParams, SpeculativeConfig

PROMPTS = ["What is the capital of France?", "Write a haiku about caches.", "Name three prime numbers.",
           "Repeat exactly: the cat sat on the mat, the cat sat on the mat."]


def held_tokens(max_tokens: int = 24) -> dict[str, list[list[int]]]:
    from minillm.cluster.disagg import DisaggregatedLLM
    from minillm.cluster.replicas import ReplicaPool

    model, tok = minillm.load_model("smollm2-135m", dtype="float32")
    params = SamplingParams(max_tokens=max_tokens)

    def chat(**kw):
        return [minillm.chat(model, tok, p, max_new_tokens=max_tokens, **kw).token_ids for p in PROMPTS]

    def engine(prompts=PROMPTS, **kw):
        return [o.token_ids for o in minillm.LLM.from_model(model, tok, **kw).chat(prompts, params)]

    out = {"generate/contiguous": chat(cache="contiguous"), "generate/paged": chat(cache="paged"),
           "speculative/ngram": chat(speculative=SpeculativeConfig("ngram", k=4)),
           "speculative/early_exit": chat(speculative=SpeculativeConfig("early_exit", k=3, exit_layer=12)),
           "engine": engine(),
           "engine/prefix+int8kv": engine(PROMPTS + PROMPTS, enable_prefix_caching=True, kv_cache_dtype="int8"),
           "engine/speculative": engine(speculative=SpeculativeConfig("ngram", k=4))}
    disagg = DisaggregatedLLM("smollm2-135m")
    try:
        out["disaggregated"] = [o.token_ids for o in disagg.generate(PROMPTS, params, chat=True)]
    finally:
        disagg.close()
    with ReplicaPool("smollm2-135m", 2, "prefix_affinity") as pool:
        out["replicas"] = [o.token_ids for o in pool.generate(PROMPTS, params, chat=True)]
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--compare", help="a JSON file this script wrote before")
    args = ap.parse_args()
    torch.set_num_threads(1)
    got = held_tokens()
    with open(args.out, "w") as f:
        json.dump(got, f, indent=0)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        for path, ids in got.items():
            same = before.get(path) == ids
            print(f"{path:24s} {'identical' if same else 'DIFFERENT'} ({sum(map(len, ids))} tokens)")
