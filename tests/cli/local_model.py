"""A local Hugging Face model directory for the CLI tests, built here (no download): a word-level
tokenizer with a chat template and a tiny Qwen3."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

WORDS = "what is the color of sky grass sun snow blue green yellow white it say hello hi please thanks".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% if m['role'] == 'assistant' %}<eos> {% "
    "endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def word_tokenizer() -> Any:
    """A word-level tokenizer with a chat template, built in code."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<eos>",
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
"""The local model's sizes (beyond :func:`roundpipe.models.configs.tiny_config`'s): two layers of width 64, two
query heads of 32 sharing one key/value head."""


def make_local_model(path: str, tokenizer: Any, tie: bool = True, positions: int = 128) -> str:
    """A tiny Qwen3 (random init, seed 0) and ``tokenizer`` saved to ``path``, as save_pretrained writes them."""
    from transformers import Qwen3ForCausalLM

    from roundpipe.models import configs

    torch.manual_seed(0)
    cfg = configs.tiny_config(
        "qwen3",
        **SIZES,
        **HEADS,
        vocab_size=len(tokenizer),
        max_position_embeddings=positions,
        tie_word_embeddings=tie,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def chat_rows() -> List[Dict[str, Any]]:
    """Chat rows in the tokenizer's words: four one-turn facts and one two-turn conversation."""
    facts = [("sky", "blue"), ("grass", "green"), ("sun", "yellow"), ("snow", "white")]
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is the color of the {x}"},
                {"role": "assistant", "content": f"it is {c}"},
            ]
        }
        for x, c in facts
    ]
    rows.append(
        {
            "messages": [
                {"role": "system", "content": "say hello"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "hello please"},
            ]
        }
    )
    return rows
