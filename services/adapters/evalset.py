"""Quality-gate eval sets: JSONL, one item per line — `{"prompt": str, "expected": str}` (a single user
turn) or `{"messages": [{"role", "content"}, ...], "expected": str}` — parsed strictly with line numbers,
and the platform's defaults when an upload brings none."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_EVAL_SET = Path(__file__).resolve().parent / "data" / "default_eval.jsonl"
_ROLES = ("system", "user", "assistant")
MAX_TEXT_CHARS = 20_000


class EvalSetError(ValueError):
    """A malformed eval set; `code` is `invalid_eval_set`, the message names the line."""

    code = "invalid_eval_set"


@dataclass(frozen=True, slots=True)
class EvalItem:
    messages: tuple[tuple[str, str], ...]  # (role, content), ending with a user turn
    expected: str

    @property
    def prompt(self) -> str:
        """The last user turn (what the examples table shows)."""
        return self.messages[-1][1]

    def chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def parse_eval_set(data: bytes, *, max_items: int) -> list[EvalItem]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise EvalSetError("the eval set is not UTF-8 text") from None
    items: list[EvalItem] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(items) >= max_items:
            raise EvalSetError(f"the eval set has more than {max_items} items")
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise EvalSetError(f"line {lineno}: not valid JSON ({exc})") from None
        items.append(_item(row, lineno))
    if not items:
        raise EvalSetError("the eval set has no items")
    return items


def _item(row: object, lineno: int) -> EvalItem:
    if not isinstance(row, dict):
        raise EvalSetError(f"line {lineno}: expected a JSON object")
    expected = row.get("expected")
    if not isinstance(expected, str) or len(expected) > MAX_TEXT_CHARS:
        raise EvalSetError(f"line {lineno}: 'expected' must be a string of at most {MAX_TEXT_CHARS} characters")
    if "messages" in row:
        raw = row["messages"]
        if not isinstance(raw, list) or not raw or len(raw) > 64:
            raise EvalSetError(f"line {lineno}: 'messages' must be a non-empty list (at most 64 turns)")
        messages = []
        for m in raw:
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise EvalSetError(f"line {lineno}: each message needs a role ({', '.join(_ROLES)}) and string content")
            messages.append((m["role"], m["content"]))
        if messages[-1][0] != "user":
            raise EvalSetError(f"line {lineno}: the last message must be the user's turn")
    elif isinstance(row.get("prompt"), str):
        messages = [("user", row["prompt"])]
    else:
        raise EvalSetError(f"line {lineno}: needs 'prompt' (a string) or 'messages'")
    if sum(len(c) for _, c in messages) > MAX_TEXT_CHARS:
        raise EvalSetError(f"line {lineno}: the prompt is longer than {MAX_TEXT_CHARS} characters")
    return EvalItem(tuple(messages), expected)


def read_eval_file(path: Path, *, max_items: int = 100_000) -> list[EvalItem]:
    return parse_eval_set(Path(path).read_bytes(), max_items=max_items)


def sample(items: list[EvalItem], n: int, *, seed: str) -> list[EvalItem]:
    """At most `n` items, the same ones every time for the same seed (the version's content id)."""
    if len(items) <= n:
        return list(items)
    return random.Random(seed).sample(items, n)
