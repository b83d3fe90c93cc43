"""Where the engine's tokens go (lesson 05): each request's own queue while it runs, its RequestOutput once it ends.

Every sampled token becomes a StreamEvent in its request's sink, detokenized incrementally, so no consumer polls
the engine's state or re-decodes the whole text per token, and any number of streams share one engine, each
getting exactly its own events. LLM holds one OutputCollector and hands it each step's new tokens.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import NamedTuple

from minillm.engine.sequence import Sequence
from minillm.request import RequestOutput


class StreamEvent(NamedTuple):
    request_id: str
    token_id: int | None  # None only in the event that reports an abort
    text: str  # the text this token completes ("" inside a multi-byte character or for a stop token)
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    logprob: float | None = None  # the token's raw log-probability, when params.logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # [(id, logprob)] most likely first, params.top_logprobs


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of the n samples of one request (LLM.add_samples): request_id itself when n == 1, else
    f"{request_id}-{i}"."""
    return [str(request_id)] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


class OutputCollector:
    """Per request: a sink (and its incremental detokenizer) while it runs, if it has one; its RequestOutput
    from the moment it ends until `pop`. The engine's lock guards every call."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.sinks: dict[str, queue.SimpleQueue] = {}  # request id -> where its StreamEvents go
        self.decoders: dict = {}  # request id -> incremental detokenizer, for requests with a sink
        self.finished: dict[str, RequestOutput] = {}  # ended requests whose output nobody took yet

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.finished

    def attach(self, request_id: str, sink: queue.SimpleQueue | None) -> None:
        if sink is None:
            return
        self.sinks[request_id] = sink
        if self.tokenizer is not None:
            self.decoders[request_id] = self.tokenizer.stream_decoder()

    def detach(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)
        self.decoders.pop(request_id, None)

    def emit(self, seq: Sequence, token: int | None, last: bool = True, index: int = -1) -> None:
        """Put one StreamEvent into the request's sink (token None: it was aborted); index: the token's
        position in seq.output_ids (for its logprobs)."""
        sink = self.sinks.get(seq.request_id)
        if sink is None:
            return
        decoder = self.decoders.get(seq.request_id)
        text = ""
        if decoder is not None and token is not None and token not in seq.stop_ids:
            text = decoder.push(token)
        done = seq.is_finished and last
        if done and decoder is not None:
            text += decoder.flush()
        logprob = top = None
        if token is not None and seq.params.logprobs:
            logprob = seq.logprobs[index]
            top = seq.top_logprobs[index] if seq.params.top_logprobs else None
        sink.put(StreamEvent(seq.request_id, token, text, done, seq.finish_reason if done else None, logprob, top))
        if done:
            self.detach(seq.request_id)

    def emit_step(self, new_tokens: list[tuple[Sequence, list[int]]]) -> list[tuple[Sequence, int]]:
        """Each sequence's new tokens (the tail of its output_ids) into its sink; returns (sequence, token) for
        each."""
        out = []
        for seq, tokens in new_tokens:
            start = seq.num_output_tokens - len(tokens)
            for i, tok in enumerate(tokens):
                out.append((seq, tok))
                self.emit(seq, tok, last=i == len(tokens) - 1, index=start + i)
        return out

    def finish(self, seq: Sequence) -> None:
        self.finished[seq.request_id] = seq.to_output(self.tokenizer)

    def pop(self, request_id: str) -> RequestOutput:
        return self.finished.pop(request_id)

    def discard(self, request_id: str) -> None:
        self.finished.pop(request_id, None)


def follow(sink: queue.SimpleQueue, request_ids: list[str], pump: Callable[[queue.SimpleQueue], None],
           has_unfinished: Callable[[], bool]) -> Iterator[StreamEvent]:
    """Yield the events of `request_ids` from their shared sink until each has had its last one, calling
    pump(sink) (one engine step, unless the sink got events meanwhile) whenever the sink is empty."""
    remaining = set(request_ids)
    while remaining:
        try:
            event = sink.get_nowait()
        except queue.Empty:
            if not has_unfinished() and sink.empty():
                raise RuntimeError(f"requests {sorted(remaining)} left the engine without a last event")
            pump(sink)
            continue
        if event.finished:
            remaining.discard(event.request_id)
        yield event


__all__ = ["OutputCollector", "StreamEvent", "follow", "sample_ids"]
