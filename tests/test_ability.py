"""Ability-transfer distillation and LoRA recovery (lesson 09): the chat data's held-out split, the answer-only
batches and loss against a hand-computed oracle, LoRA's zero start and exact merge, the shipped recipe rebuilding the
merged student, the teacher's answers cached once, the 'same first sentence' measure, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.compress.ability import (AbilityConfig, chat_batch_at, distill_ability, first_sentence, masked_step,
                                      top1_agreement)
from minillm.recipes.small_model import open_prompts, teacher_answers
from minillm.compress.chat_data import (ALWAYS_HELD_OUT, CASCADE_QUESTIONS, SPECULATIVE_CHAT, chat_prompts,
                                        is_held_out, split)
from minillm.compress.distill import distillation_loss
from minillm.compress.lora import LoRALinear, add_lora, lora_state, merge_lora
from minillm.compress.pruning import drop_blocks
from tests.test_distill import pair, text

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------------- data


def test_held_out_prompts_are_never_in_the_training_split():
    prompts = chat_prompts()
    train, held = split(prompts)
    assert len(prompts) > 2000 and len(set(prompts)) == len(prompts)
    assert not set(train) & set(held) and len(train) + len(held) == len(prompts)
    assert all(is_held_out(p) for p in ALWAYS_HELD_OUT)  # what lessons 10 and 13 measure on is never trained on
    assert set(CASCADE_QUESTIONS) <= set(held) and "Write a short poem about the sea." in held
    assert set(CASCADE_QUESTIONS) | set(SPECULATIVE_CHAT) == ALWAYS_HELD_OUT
    assert 0.05 < len(held) / len(prompts) < 0.15
    assert chat_prompts() == prompts and all(is_held_out(p) for p in held)  # stable: a hash, not a draw


class _Tok:
    eos_id = 2
    stop_ids = frozenset({2})

    def encode_chat(self, messages):
        return [3] + [ord(c) % 50 + 5 for c in messages[0]["content"]][:10]

    def decode(self, ids):
        return "".join(". " if i == 7 else "w" for i in ids)


def test_teacher_answers_are_generated_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from minillm.engine.llm import LLM

    _, t = pair()
    cache = tmp_path / "answers.json"
    answers = teacher_answers(t, _Tok(), ["ab", "cde"], 5, cache=cache, progress=False)
    assert [len(a) for a in answers] == [5, 5] or any(a[-1] == 2 for a in answers)
    def no_engine(*a, **k):
        raise AssertionError("the engine ran")

    monkeypatch.setattr(LLM, "from_model", no_engine)
    assert teacher_answers(t, _Tok(), ["ab", "cde"], 5, cache=cache, progress=False) == answers
    with pytest.raises(AssertionError, match="engine ran"):  # another prompt set is another key: it regenerates
        teacher_answers(t, _Tok(), ["ab"], 5, cache=cache, progress=False)


class _ChatTok:
    """A template with the SmolLM2 markers: a character is a token, <|im_start|> 1, <|im_end|> 2."""
    special_tokens = {"<|im_start|>": 1, "<|im_end|>": 2}

    def encode_chat(self, messages):
        return self.encode(f"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n{messages[0]['content']}"
                           "<|im_end|>\n<|im_start|>assistant\n", allow_special=True)

    def encode(self, text, allow_special=False):
        out = []
        while text:
            for mark, i in self.special_tokens.items():
                if allow_special and text.startswith(mark):
                    out.append(i)
                    text = text[len(mark):]
                    break
            else:
                out.append(ord(text[0]) + 10)
                text = text[1:]
        return out

    def decode(self, ids):
        names = {v: k for k, v in self.special_tokens.items()}
        return "".join(names.get(i, chr(i - 10) if i >= 10 else "?") for i in ids)


def test_open_prompts_keep_closed_new_printable_questions_and_cache_them(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from minillm.engine.llm import LLM

    tok, seen = _ChatTok(), []
    turns = ["What is a good book to read?", "What is a good book to read?", "ok then",  # a repeat, two words
             "Write a short poem about the sea.", "Say h\u00e9llo to everyone please", "Open turn never closed",
             "How do I bake bread at home?", "Tell me about\x07 bells now"]

    class Engine:
        def generate(self, prompts, params):
            seen.append((prompts, params))
            outs = []
            for j, p in enumerate(params):
                text = turns[(len(seen) - 1) * len(params) + j] if (len(seen) - 1) * len(params) + j < len(turns) \
                    else f"Question number {len(seen)} {j} here?"
                ids = tok.encode(text) + ([] if text.startswith("Open") else [2])
                outs.append(SimpleNamespace(token_ids=ids))
            return outs

    monkeypatch.setattr(LLM, "from_model", lambda *a, **k: Engine())
    got = open_prompts(None, tok, 3, seed=5, cache=tmp_path / "open.json", progress=False)
    # closed, 3+ words, ASCII and printable, new, and never a prompt a lesson measures on
    assert got == ["What is a good book to read?", "How do I bake bread at home?", "Question number 1 8 here?"]
    prompts, params = seen[0]
    assert tok.decode(prompts[0]).endswith("<|im_start|>user\n") and "assistant" not in tok.decode(prompts[0])
    assert {p.seed for p in params} == set(range(5, 5 + len(params))) and all(p.temperature == 1.0 for p in params)
    monkeypatch.setattr(LLM, "from_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("the engine ran")))
    assert open_prompts(None, tok, 3, seed=5, cache=tmp_path / "open.json", progress=False) == got
    with pytest.raises(AssertionError, match="engine ran"):  # another seed is another set
        open_prompts(None, tok, 3, seed=6, cache=tmp_path / "open.json", progress=False)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=6),
       step=st.integers(0, 50), batch=st.integers(1, 5))
def test_chat_batch_masks_exactly_the_answer_positions(lens, step, batch):
    examples = [([10 + i] * p, [40 + i] * a) for i, (p, a) in enumerate(lens)]
    cfg = AbilityConfig(batch_size=batch, seq_len=64, steps=1)
    x, mask = chat_batch_at(examples, step, cfg, pad_id=0)
    x2, mask2 = chat_batch_at(examples, step, cfg, pad_id=0)
    assert torch.equal(x, x2) and torch.equal(mask, mask2)  # from (seed, step) alone: a resumed run is the same
    assert x.shape[0] == batch and mask.shape == (batch, x.shape[1] - 1)
    for row, m in zip(x, mask):
        targets = row[1:][m].tolist()  # what the masked positions predict: the answer, all of it, nothing else
        assert targets and all(t >= 40 for t in targets)
        assert targets == [t for t in row.tolist() if t >= 40]


def test_masked_step_is_the_answer_only_kd_plus_ce_oracle():
    student, teacher = pair()
    x = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    cfg = AbilityConfig(steps=1, kd=1.0, ce=0.5, temperature=2.0, lr=0.0, warmup=1)
    with torch.no_grad():
        s_all, t_all = student(x[:, :-1]), teacher(x[:, :-1])
        want = distillation_loss(s_all[mask], t_all[mask], 2.0) + 0.5 * F.cross_entropy(s_all[mask], x[:, 1:][mask])
    opt = torch.optim.SGD([p for p in student.parameters()], lr=0.0)
    student.requires_grad_(True)
    got = masked_step(student, teacher, x, mask, opt, cfg)
    assert got["loss"] == pytest.approx(want.item(), rel=1e-5)


def test_first_sentence_and_top1_agreement():
    tok = _Tok()
    assert first_sentence([9, 9, 7, 9, 7], tok) == [9, 9, 7]
    assert first_sentence([9] * 40, tok, cap=32) == [9] * 32
    _, teacher = pair()
    answers = [([1, 2, 3], teacher(torch.tensor([[1, 2, 3]]))[0, -1:].argmax(-1).tolist())]
    assert top1_agreement(teacher, answers) == 1.0


# ----------------------------------------------------------------------------------------------------- LoRA


def test_lora_starts_as_the_base_and_merges_exactly():
    student, _ = pair()
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        before = student(x)
    names = add_lora(student, rank=4, alpha=8.0)
    assert len(names) == 7 * len(student.layers)
    assert all(not p.requires_grad for n, p in student.named_parameters() if ".base." in n or n.startswith("embed"))
    with torch.no_grad():
        torch.testing.assert_close(student(x), before)  # B = 0: nothing changed yet
        for m in student.modules():
            if isinstance(m, LoRALinear):
                m.B.normal_(0, 0.1)
        adapted = student(x)
        assert not torch.allclose(adapted, before)
        plain = merge_lora(copy.deepcopy(student))
        assert not any(isinstance(m, LoRALinear) for m in plain.modules())
        torch.testing.assert_close(plain(x), adapted, rtol=1e-5, atol=1e-5)


def test_ability_training_learns_and_trains_only_adapters_and_norms():
    student, teacher = pair()
    frozen = {k: v.clone() for k, v in student.state_dict().items()}
    add_lora(student, rank=4, alpha=8.0)
    examples = [([1, 2, 3, 4], t) for t in ([5, 6, 7], [8, 9], [5, 9, 6])]
    ids = text()
    cfg = AbilityConfig(steps=30, batch_size=4, seq_len=16, lr=1e-2, warmup=2, kd=1.0, ce=1.0, text_share=0.3,
                        text_len=12)
    hist = distill_ability(student, teacher, examples, ids, cfg, pad_id=0, progress=False)
    assert {h["kind"] for h in hist} == {"chat", "text"}
    chat = [h["loss"] for h in hist if h["kind"] == "chat"]
    assert sum(chat[-4:]) < sum(chat[:4])
    merged = merge_lora(copy.deepcopy(student)).state_dict()
    for k, v in frozen.items():  # only block weights (via their update) and block norms moved
        if k.startswith("embed") or k == "norm.weight":
            assert torch.equal(merged[k], v), k


def test_recipe_rebuilds_the_merged_student(tmp_path, monkeypatch):
    """What ships (dropped blocks + factors + norms, fp16) rebuilds the merged student through load_model."""
    import minillm.gguf.loader as loader
    import minillm.gguf.saved as saved

    real, _ = loader.load_from_file("smollm2-135m", dtype="float32")
    student = drop_blocks(copy.deepcopy(real), [1, 3])
    add_lora(student, rank=2, alpha=4.0)
    with torch.no_grad():
        for m in student.modules():
            if isinstance(m, LoRALinear):
                m.A.copy_(m.A.half().float())
                m.B.normal_(0, 0.01).copy_(m.B.half().float())
    monkeypatch.setattr(saved, "saved_model_dir", lambda name: tmp_path / "saved" / name)
    monkeypatch.setattr(saved, "ASSETS", tmp_path)
    path = saved.write_recipe("tiny-student", "smollm2-135m", [1, 3], lora_state(student), {"note": "test"})
    assert path == tmp_path / "tiny-student.pt" and saved.recipe_path("tiny-student") == path
    built, _ = loader.load_from_file("tiny-student", dtype="float32")
    want = merge_lora(student)
    x = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(built(x), want(x), rtol=1e-3, atol=1e-3)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # corrupted after a rebuild: the next rebuild refuses it
    saved.saved_model_dir("tiny-student").joinpath("config.json").unlink()
    with pytest.raises(RuntimeError, match="sha256"):
        loader.load_from_file("tiny-student")


def test_bad_input():
    student, teacher = pair()
    with pytest.raises(ValueError, match="rank"):
        LoRALinear(torch.nn.Linear(4, 4), 0, 1.0)
    with pytest.raises(ValueError, match="text_share"):
        AbilityConfig(text_share=1.5)
    with pytest.raises(ValueError, match="nothing to train"):
        distill_ability(student.requires_grad_(False), teacher, [([1], [2])], text(), AbilityConfig(steps=1), 0,
                        progress=False)
    with pytest.raises(ValueError, match="no chat examples"):
        distill_ability(student, teacher, [], text(), AbilityConfig(steps=1), 0, progress=False)
    fused = copy.deepcopy(student)
    for blk in fused.layers:
        blk.attn.wq = torch.nn.Identity()
        blk.attn.wk = blk.attn.wv = blk.attn.wo = torch.nn.Identity()
        blk.mlp.gate = blk.mlp.up = blk.mlp.down = torch.nn.Identity()
    with pytest.raises(ValueError, match="no nn.Linear"):
        add_lora(fused)


def test_retained_ability_is_one_for_the_teacher_itself_and_less_for_a_pruned_student():
    from minillm.api import generate_ids
    from minillm.recipes.small_model import retained_ability
    from minillm.sampling import SamplingParams

    student, teacher = pair()
    prompts = [[3, 5 + i, 9, 11 + i] for i in range(6)]
    examples = [(p, list(generate_ids(teacher, p, SamplingParams(max_tokens=10)))) for p in prompts]
    same = retained_ability(teacher, _Tok(), examples)
    assert same["answer_match"] == 1.0 and same["top1_agree"] == 1.0 and same["n_prompts"] == 6
    other = retained_ability(student, _Tok(), examples)
    assert other["top1_agree"] < 1.0 and 0 <= other["answer_match"] <= 1
