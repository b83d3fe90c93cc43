"""The serving engine (lesson 05): continuous batching over the paged KV cache, split by job like nano-vllm.

    sequence.py      one request's state          block_manager.py  which KV blocks each sequence owns
    scheduler.py     who runs this step (plain data, no tensors); config.py: EngineConfig, the engine's knobs
    model_runner.py  schedule -> packed tensors -> model -> per-request sampling
    llm.py           LLM: add_request / step / generate / stream / abort
    output.py        tokens out (StreamEvents, outputs)       handoff.py  a request's KV to another engine (13)
    speculation.py   draft slots, drafts, acceptance (10)    static.py   the static-batching baseline
"""

from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM, RequestOutput
from minillm.engine.output import StreamEvent
from minillm.engine.sequence import Sequence, SequenceStatus

__all__ = ["LLM", "EngineConfig", "RequestOutput", "Sequence", "SequenceStatus", "StreamEvent"]
