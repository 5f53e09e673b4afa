"""The tool-call format, one owner: how tool definitions, assistant calls and tool results are written into
a prompt for a chat template that has no tool support of its own, what a call looks like in the model's
output (`<tool_call>` blocks, as Hermes/Qwen write them), and how output text is parsed back into OpenAI
`tool_calls`, whole or while streaming. The engine's grammar for forced calls is built from the same
strings (`call_prefix`, `CALL_SUFFIX`), so a forced call always parses here.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from services.common.wire import InvalidRequest

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_SUFFIX = "}\n" + CALL_CLOSE  # closes the call object and the block
CALL_SEPARATOR = "\n"  # between parallel calls
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"


def call_prefix(name: str) -> str:
    """Everything a call to `name` writes before its arguments object."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


def render_call(name: str, arguments: str) -> str:
    """An assistant's earlier call, as the model would have written it (arguments: JSON text)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        args = json.dumps(arguments, ensure_ascii=False)  # a client's malformed arguments stay text
    return call_prefix(name) + args + CALL_SUFFIX


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that offers the tools (compact JSON: small vocabularies spend a token a
    character on JSON punctuation)."""
    lines = [json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f}, ensure_ascii=False,
                        separators=(",", ":"))
             for f in (t["function"] for t in tools)]
    return (f'Tools. To call one, answer {CALL_OPEN}\n{{"name": ..., "arguments": {{...}}}}\n{CALL_CLOSE}\n'
            + "\n".join(lines))


def flatten_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages a plain system/user/assistant template can render: tools go into the system prompt, an
    assistant's `tool_calls` into its text, and `role: "tool"` results become user turns."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            content = m.get("content")
            out.append({"role": "user", "content": f"{RESULT_OPEN}\n{_text(content, i)}\n{RESULT_CLOSE}"})
        elif role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise InvalidRequest("tool_calls must be a list", f"messages[{i}].tool_calls")
            calls = [render_call(*_call_of(c, f"messages[{i}].tool_calls[{j}]")) for j, c in enumerate(m["tool_calls"])]
            text = _text(m.get("content"), i)
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + CALL_SEPARATOR.join(calls)})
        else:
            out.append(m)
    if tools:
        block = tools_block(tools)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": _text(out[0].get("content"), 0) + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise InvalidRequest("message content must be a string or a list of text parts", f"messages[{index}].content")


def _call_of(call: Any, param: str) -> tuple[str, str]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("a tool call must have a function with a name", param)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise InvalidRequest("a tool call's arguments must be a JSON text", f"{param}.function.arguments")
    return fn["name"], args


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(block: str) -> ToolCall | None:
    """The call in one `<tool_call>` block's body, or None if it is not one."""
    try:
        body = json.loads(block)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = body.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall("call_" + secrets.token_hex(12), body["name"], json.dumps(args, ensure_ascii=False))


@dataclass(slots=True)
class ToolCallStream:
    """Splits a choice's output text, piece by piece, into content and tool calls. Text that may be the
    start of a `<tool_call>` block is held until it is known, whitespace between calls is dropped, and a
    block that does not parse is given back as content (honest under `auto`)."""

    buf: str = ""
    in_call: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content, new = [], []
        while True:
            if self.in_call:
                end = self.buf.find(CALL_CLOSE)
                if end < 0:
                    break
                block, self.buf = self.buf[:end], self.buf[end + len(CALL_CLOSE):]
                self.in_call = False
                call = parse_call(block)
                if call is None:
                    content.append(CALL_OPEN + block + CALL_CLOSE)
                else:
                    new.append(call)
                continue
            start = self.buf.find(CALL_OPEN)
            if start >= 0:
                before = self.buf[:start].rstrip()  # whitespace before a call is layout, however it arrived
                if before:
                    content.append(before)
                self.buf, self.in_call = self.buf[start + len(CALL_OPEN):], True
                continue
            keep = _held(self.buf)
            emit, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            if emit.strip() or (emit and not self.calls and not new):
                content.append(emit)
            break
        self.calls += new
        return "".join(content), new

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The end of the output: what is still held is content (a call cut off by max_tokens included)."""
        rest = (CALL_OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        return (rest if rest.strip() or not self.calls else ""), []


def _held(text: str) -> int:
    """How many trailing characters could begin `<tool_call>` (or are whitespace that may precede one)."""
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return k + (len(text[:-k]) - len(text[:-k].rstrip()))
    return len(text) - len(text.rstrip())


def split_output(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when it is only calls) and calls: the streaming split, run at once."""
    s = ToolCallStream()
    content, calls = s.push(text)
    tail, _ = s.flush()
    content += tail
    if calls and not content.strip():
        return None, calls
    return content, calls
