"""The demo byte-level BPE tokenizer: training with `tokenizers` and saving it in Hugging Face format."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<s>", "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Ids follow this order: <pad>=0, <s>=1, <|end|>=2, <|system|>=3, <|user|>=4, <|assistant|>=5.
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS.values())

# Every turn is `<|role|>\n{content}<|end|>\n`; the generation prompt opens an assistant turn, so
# the model's answer is terminated by <|end|> (the eos). `render_chat` below is the same format in
# Python (used to tokenize the training set fast); tests check that the two agree.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    parts = [BOS]
    for m in messages:
        parts.append(f"{ROLE_TOKENS[m['role']]}\n{m['content']}{EOS}\n")
    if add_generation_prompt:
        parts.append(f"{ROLE_TOKENS['assistant']}\n")
    return "".join(parts)


def render_prompt(user: str) -> str:
    """A single-turn user prompt ready for generation (what `apply_chat_template` produces)."""
    return render_chat([{"role": "user", "content": user}], add_generation_prompt=True)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, min_frequency: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text (any emoji) encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, *, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) + special_tokens_map.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    roles = list(ROLE_TOKENS.values())
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": roles}
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "added_tokens_decoder": added,
        "add_bos_token": False,  # the chat template writes <s> itself
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def special_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert all(i is not None for i in ids.values()), ids
    return ids
