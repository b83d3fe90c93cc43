"""A learned drafter (lesson 10): a small head that guesses the target's next tokens from the target's own features.

A draft model pays a full forward of its own per guess, so it must be much smaller than the target *and* agree
with it; a pruned student is at best ~1.7x cheaper. EAGLE (Li et al. 2024) drafts from what the target already
computed: its last hidden state f_t (the feature its LM head turns into token t+1) already says what comes next.
`DraftHead` turns it into guesses for ~4% of a target step; `LearnedDrafter` drafts with it, exactly (sampling
stays the target's distribution). Training: train_drafter.py (features of the teacher's answers).
"""

from __future__ import annotations

import io
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.gguf.weights import read_verified, write_with_digest
from minillm.model import RMSNorm
from minillm.sampling import SamplingParams, logits_to_probs, sample
from minillm.speculative.drafters import Drafter

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DRAFTER = "smollm2-135m-drafter"  # the shipped head, trained for SmolLM2-135M-Instruct


class DraftHead(nn.Module):
    """(feature f_t, token x_{t+1}) -> (predicted feature f_{t+1}, logits over vocab_ids).

    One linear layer and one SwiGLU MLP, no attention (the feature carries the context); it scores only
    `vocab_ids`, the few thousand tokens the target actually writes, with the target's own LM-head rows: a guess
    costs ~4% of a target step. Guesses chain on predicted features."""

    def __init__(self, dim: int, hidden: int, vocab_ids: Tensor, eps: float = 1e-5):
        super().__init__()
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim, eps)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.out_norm = RMSNorm(dim, eps)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.embed: Tensor | None = None  # the target's (vocab, dim) embedding, attached by bind(); not saved
        self.head: Tensor | None = None  # its LM-head rows for vocab_ids

    def bind(self, target) -> DraftHead:
        """Borrow the target's embedding and LM-head rows (frozen, never copied into the saved head)."""
        if target.config.dim != self.fc.out_features:
            raise ValueError(f"this draft head was trained for a {self.fc.out_features}-wide target, not "
                             f"{target.config.dim}")
        if int(self.vocab_ids.max()) >= target.config.vocab_size:
            raise ValueError("the draft head's vocabulary does not fit the target's: another tokenizer")
        head, embed = target.lm_head, target.embed
        # a quantized target (lesson 07/14) stores codes, not rows: dequantize only the few thousand rows scored (the
        # whole 49,152-row table took 0.9 s per drafter on the 8-bit head, longer than 64 tokens of decode), and
        # look embeddings up through its own (quantized) embedding rather than expanding the whole table
        if hasattr(head, "embedding"):
            self.head = head.embedding(self.vocab_ids.to(head.weight_storage.device), torch.float32)
        else:
            self.head = head.weight.detach()[self.vocab_ids.to(head.weight.device)]
        rows = self.head
        self.embed = None if hasattr(embed, "head") else embed.weight.detach()  # QuantizedEmbedding: no float table
        self._lookup = [embed]  # a list: the target's module, not a submodule of the head (never saved)
        return self.to(rows.device)

    def int8_copy(self) -> DraftHead:
        """This bound head with its matmuls and LM-head rows in int8 on the CPU kernels (lesson 07): beside a 4-bit
        target its float32 weights (23 MB: fc, the MLP, 4,096 head rows) were a third of the bytes a target step
        reads, so a guess cost ~0.3 of a step; int8 reads a quarter of that."""
        from minillm.compress.quant import Int8Linear, quantize_int8

        if self.head is None:
            raise RuntimeError("bind(target) first: the LM-head rows come from the target")
        out = DraftHead(self.fc.out_features, self.gate.out_features, self.vocab_ids)
        out.load_state_dict(self.state_dict())
        for name in ("fc", "gate", "up", "down"):
            setattr(out, name, Int8Linear.from_linear(getattr(self, name)))
        out.embed, out._lookup = self.embed, self._lookup
        out.head, out.head_int8 = self.head, Int8Linear(*quantize_int8(self.head))
        return out.eval()

    def forward(self, f: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        if self.head is None:
            raise RuntimeError("bind(target) first: the head scores with the target's own embedding and LM head")
        dtype = self.mlp_norm.weight.dtype  # not fc's: an int8 copy's fc holds int8 codes
        e = (self.embed[tokens] if self.embed is not None else self._lookup[0](tokens)).to(dtype)
        h = self.fc(torch.cat([f.to(e.dtype), e], dim=-1))
        x = self.mlp_norm(h)
        h = h + self.down(F.silu(self.gate(x)) * self.up(x))
        f_next = self.out_norm(h)  # like the target's feature: after a final RMSNorm
        if getattr(self, "head_int8", None) is not None:
            return f_next, self.head_int8(f_next)
        return f_next, f_next @ self.head.to(f_next.dtype).t()


# --------------------------------------------------------------------------------------------------- the drafter


class LearnedDrafter(Drafter):
    """Drafts with a DraftHead from the target's features. observe() after every target forward, then propose().

    It reads f from the target's final norm (a forward hook): after each target forward the engine (or
    generate_speculative) calls `observe` with which sequence and position each logits row is; `propose` then
    drafts from the feature of the position that produced the last token. Greedy output stays the target's
    (verification keeps only agreeing drafts) and sampling stays exact: q is the head's distribution, zero outside
    vocab_ids.

    Draft length adapts (EAGLE-2's insight: the head knows when it is guessing): with `min_confidence` > 0 a chain
    stops before guess i once the product of the head's top probabilities up to i falls below it. A rejected guess
    costs verify width for nothing, and on a CPU each extra verified row is far from free (lesson 10 measures v); a
    step with no confident guess is a plain decode. The rule reads q_i before x_i is drawn, so x_i ~ q_i still
    holds whenever it is drafted and rejection sampling stays exact."""

    wants_features = True  # observe() keeps the features it reads

    def __init__(self, target, head: DraftHead, min_confidence: float = 0.0):
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1) (0: always draft k), got {min_confidence!r}")
        self.target, self.head = target, prepare(target, head)
        self.min_confidence = min_confidence
        self.features: dict[str, tuple[int, Tensor]] = {}  # key -> (position of the first row, rows (n, dim))
        self._captured: Tensor | None = None
        me = weakref.ref(self)  # the hook must not keep a dropped drafter (and its features) alive with the target

        def capture(module, args, output: Tensor) -> None:
            if (drafter := me()) is not None:
                drafter._captured = output.detach()

        self._hook = target.norm.register_forward_hook(capture)

    def __del__(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()

    def check_target(self, target) -> None:
        if target is not self.target:
            raise ValueError("a LearnedDrafter reads one target's features: build it with that target")

    def observe(self, rows: list[tuple[str, int, int]]) -> None:
        """rows: (key, position of its first logits row, number of rows), in the order of the last forward's
        logits rows. Keeps each sequence's latest features; a position past a rejection is overwritten next time."""
        if not any(n for _, _, n in rows):  # nothing was sampled: no features to keep
            self._captured = None
            return
        if self._captured is None:
            raise RuntimeError("no target forward was seen: observe() follows a forward of the target")
        feats = self._captured.reshape(-1, self._captured.shape[-1])
        if feats.shape[0] != sum(n for _, _, n in rows):
            raise RuntimeError(f"the last forward produced {feats.shape[0]} feature rows, observe() describes "
                               f"{sum(n for _, _, n in rows)}: call it right after the forward it describes")
        at = 0
        for key, first, n in rows:
            if n:
                self.features[key] = (first, feats[at:at + n])
            at += n
        self._captured = None

    def release(self, key: str) -> None:
        self.features.pop(key, None)

    @torch.inference_mode()
    def propose(self, batch: list[tuple[str, list[int], int]], params: list[SamplingParams],
                generators: list) -> list[tuple[list[int], Tensor | None]]:
        out: list[tuple[list[int], Tensor | None]] = [([], None) for _ in batch]
        live, f, last = [], [], []
        for i, (key, ids, k) in enumerate(batch):
            first, feats = self.features.get(key, (0, None))
            pos = len(ids) - 2  # the position whose logits chose ids[-1]
            if k > 0 and feats is not None and first <= pos < first + feats.shape[0]:
                live.append(i)
                f.append(feats[pos - first])
                last.append(ids[-1])
        if not live:
            return out
        f_t, tok = torch.stack(f), torch.tensor(last, device=f[0].device)
        vocab = self.target.config.vocab_size
        drafts: dict[int, list[int]] = {i: [] for i in live}
        qs: dict[int, list[Tensor]] = {i: [] for i in live}
        path = torch.ones(len(live), device=f_t.device)  # the head's own estimate that the chain so far survives
        stopped = [False] * len(live)
        for step in range(max(batch[i][2] for i in live)):
            f_t, sub_logits = self.head(f_t, tok)
            if self.min_confidence:
                path = path * torch.softmax(sub_logits.float(), -1).amax(-1)
                stopped = [s or float(c) < self.min_confidence for s, c in zip(stopped, path)]
                if all(stopped):
                    break
            if any(params[i].temperature > 0 for i in live):  # sampling: q over the whole vocabulary, 0 outside
                full = torch.full((len(live), vocab), float("-inf"), device=sub_logits.device)
                full[:, self.head.vocab_ids] = sub_logits.float()
            nxt = []
            for row, i in enumerate(live):
                p = params[i]
                if p.temperature == 0:
                    t = int(self.head.vocab_ids[sub_logits[row].argmax()])
                    q = None
                else:
                    q = logits_to_probs(full[row:row + 1], p.temperature, p.top_k, p.top_p)[0]
                    t = int(sample(q[None], generators[i])[0])
                if step < batch[i][2] and not stopped[row]:
                    drafts[i].append(t)
                    if q is not None:
                        qs[i].append(q)
                nxt.append(t)
            tok = torch.tensor(nxt, device=tok.device)
        for i in live:  # greedy drafts are one-hot guesses (q None), as the n-gram drafter's
            out[i] = (drafts[i], torch.stack(qs[i]) if qs[i] else None)
        return out


def prepare(target, head: DraftHead) -> DraftHead:
    """`head` ready to draft for `target`: bound to its embedding and LM-head rows, and an int8 copy beside a
    low-bit or native-step target on the CPU (a float32 head cost a third of a 4-bit step, and 0.07 of a native
    float32 one: 1.4 ms a guess, by hand, against 20 ms). Once per (target, head)."""
    ready = getattr(head, "_ready_for", None)
    if ready is not None and ready() is target:
        return head
    info = getattr(head, "info", None)
    head = head.bind(target).eval()
    fast_target = hasattr(target.lm_head, "embedding") or getattr(target, "native_step", None) is not None
    if fast_target and target.device.type == "cpu":
        head = head.int8_copy()
    if info is not None:  # the record it was loaded with (sha256, recipe): benches cite which head drafted
        head.info = info
    head._ready_for = weakref.ref(target)
    return head


_READY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {name: its prepared head}


def draft_head_for(target, name: str = DRAFTER) -> DraftHead:
    """The saved head `name`, loaded, verified and prepared for `target` once per target: generate() makes a
    drafter per call, and reading, hashing and quantizing the head each time cost more than a short answer."""
    per_target = _READY.setdefault(target, {})
    if name not in per_target:
        per_target[name] = prepare(target, load_draft_head(name))
    return per_target[name]


# ---------------------------------------------------------------------------------------------- saving, loading


def save_draft_head(head: DraftHead, path: Path, info: dict) -> str:
    """fp16 weights + the vocabulary, one file; returns its sha256 (recorded next to it in <path>.json)."""
    sd = {k: (v.half() if v.is_floating_point() else v).cpu() for k, v in head.state_dict().items()}
    buf = io.BytesIO()
    torch.save({"state": sd, "dim": head.fc.out_features, "hidden": head.gate.out_features, "info": info}, buf)
    return write_with_digest(Path(path), buf.getvalue(), info)


def load_draft_head(name_or_path: str | Path = DRAFTER) -> DraftHead:
    """A saved DraftHead (a name under minillm/assets, or a path), checked against its recorded sha256."""
    path = Path(name_or_path)
    if not path.suffix:
        path = ASSETS / f"{name_or_path}.pt"
    meta_path = Path(str(path) + ".json")
    if not path.exists() or not meta_path.exists():
        raise FileNotFoundError(f"no draft head at {path}: train one with `python -m minillm.recipes.small_model "
                                f"drafter` (~1 h on 2 CPU cores)")
    raw, meta = read_verified(path, meta_path, f"restore it from git (`git checkout -- {path.name}`) or retrain it")
    blob = torch.load(io.BytesIO(raw), weights_only=True)
    head = DraftHead(blob["dim"], blob["hidden"], blob["state"]["vocab_ids"])
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in blob["state"].items()})
    head.info = meta
    return head
