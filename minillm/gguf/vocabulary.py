"""Do two models speak the same token ids? The one check behind a student and its teacher (lesson 09), a draft and
its target (lesson 10) and a cascade's two models (lesson 13): ids that mean different tokens give wrong text with
no error, so a mismatch is refused before any token is compared."""

from __future__ import annotations


def _tokenizer_facts(tok) -> tuple:
    """What makes two tokenizers the same: size, special tokens, stop ids, and every token's bytes."""
    pieces = [tok.token_bytes(i) for i in range(len(tok))] if hasattr(tok, "token_bytes") else None
    specials = sorted(getattr(tok, "special_tokens", {}).items())
    return len(tok), specials, sorted(getattr(tok, "stop_ids", ())), pieces


def check_same_vocabulary(small, large, roles: tuple[str, str], why: str, tokenizer=None,
                          small_tokenizer=None) -> None:
    """Refuse two models whose token ids may mean different tokens: the one check behind a student and its
    teacher, a draft and its target (lesson 10), a cascade's two models. `roles` name them in the error;
    `tokenizer` (the large model's) must have the models' vocabulary size; `small_tokenizer`, be the same."""
    small_name, large_name = roles
    n_small, n_large = small.config.vocab_size, large.config.vocab_size
    if n_small != n_large:
        raise ValueError(f"the {small_name}'s vocabulary has {n_small} tokens, the {large_name}'s {n_large}: "
                         f"{why}")
    if tokenizer is not None and len(tokenizer) != n_large:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the models {n_large}: pass the "
                         f"models' tokenizer")
    if small_tokenizer is not None and small_tokenizer is not tokenizer and (
            tokenizer is None or _tokenizer_facts(small_tokenizer) != _tokenizer_facts(tokenizer)):
        raise ValueError(f"the {small_name}'s tokenizer differs from the {large_name}'s: {why}")
