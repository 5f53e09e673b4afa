"""Turns OpenAI-style prompts and chat messages into token ids, exactly as Hugging Face would.

The gateway uses it to count prompt tokens before reserving quota; the engine's own OpenAI
endpoints use it too, so both sides agree on every token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.common.tool_calls import flatten_tool_messages
from services.common.wire import InvalidRequest


def _raise(message: str) -> None:
    raise TemplateError(message)


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequest(
                    "only text content parts are supported by this model", f"messages[{index}].content"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRequest("message content must be a string or a list of text parts", f"messages[{index}].content")


class PromptBuilder:
    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if template is None and (model_dir / "chat_template.jinja").exists():
            template = (model_dir / "chat_template.jinja").read_text()
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        # Token-id prompts are checked against the model's embedding rows (config.json may pad past the
        # tokenizer's vocabulary); a bare tokenizer dir falls back to the tokenizer's size.
        model_cfg = model_dir / "config.json"
        vocab = json.loads(model_cfg.read_text()).get("vocab_size") if model_cfg.exists() else None
        self.vocab_size: int = int(vocab) if vocab else self.tokenizer.get_vocab_size(with_added_tokens=True)
        # The longest text one token can stand for (byte-level vocabularies: one character per byte).
        self.max_token_chars = max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True))
        self._template = None
        # A template that reads `tools` renders tool definitions, calls and results itself (HF convention);
        # for one that does not, tool_calls.flatten_tool_messages writes them into plain turns.
        self.native_tools = bool(template) and "tools" in template
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)

    def max_chars(self, max_model_len: int) -> int:
        """A text longer than this cannot fit `max_model_len` tokens: each token stands for at most
        `max_token_chars` characters; x2 covers normalizers that shorten text before it is split."""
        return 2 * max_model_len * self.max_token_chars

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        if not messages:
            raise InvalidRequest("messages must not be empty", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                role = m.get("role") if isinstance(m, dict) else None
                raise InvalidRequest(f"unsupported role {role!r}", f"messages[{i}].role")
        extra: dict[str, Any] = {}
        if self.native_tools:
            extra["tools"] = tools or None
        else:
            messages = flatten_tool_messages(messages, tools)
        clean = []
        for i, m in enumerate(messages):
            role = m["role"]
            item = {"role": "system" if role == "developer" else role, "content": _message_text(m.get("content"), i)}
            for key in ("tool_calls", "tool_call_id", "name"):
                if self.native_tools and key in m:
                    item[key] = m[key]
            clean.append(item)
        try:
            return self._template.render(
                messages=clean,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateError as exc:
            raise InvalidRequest(f"messages do not fit the chat template: {exc}", "messages") from None

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template already writes the special tokens, as in HF's apply_chat_template(tokenize=True).
        return self.tokenizer.encode(self.render_chat(messages, tools=tools), add_special_tokens=False).ids

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def count(self, ids_or_text: str | list[int]) -> int:
        return len(ids_or_text) if isinstance(ids_or_text, list) else len(self.text_ids(ids_or_text))


def _token_str(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""

