"""Incremental, UTF-8-safe detokenization and stop-string matching across token boundaries.

Byte-level BPE tokenizers get an exact fast path: every token id maps to its raw bytes, and an
incremental UTF-8 decoder emits only whole characters. Other tokenizers decode a sliding window and
hold text back while it ends in an incomplete character.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path

from tokenizers import Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    # The GPT-2 byte <-> printable-unicode table used by byte-level BPE vocabularies.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenizerInfo:
    """A loaded tokenizer plus what incremental decoding needs (per-token bytes, special ids)."""

    def __init__(self, model_dir: Path):
        path = Path(model_dir) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(path))
        spec = json.loads(path.read_text())
        self.special_ids = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.token_bytes: list[bytes] | None = None
        if _is_byte_level(spec.get("decoder")):
            inverse = {c: b for b, c in _bytes_to_unicode().items()}
            table: list[bytes] = [b""] * self.vocab_size
            added = {t["id"]: t for t in spec.get("added_tokens", [])}
            for token, idx in self.tokenizer.get_vocab(with_added_tokens=True).items():
                if idx in added:
                    table[idx] = added[idx]["content"].encode()
                else:
                    table[idx] = bytes(inverse[ch] for ch in token)
            self.token_bytes = table

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token on its own (for logprobs), decoded leniently."""
        if self.token_bytes is not None and 0 <= token_id < len(self.token_bytes):
            return self.token_bytes[token_id].decode("utf-8", errors="replace")
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(_is_byte_level(d) for d in decoder.get("decoders", []))


class DecodeStream:
    """Turns one sequence's token ids into text, never emitting half a character."""

    def __init__(self, info: TokenizerInfo, skip_special_tokens: bool = True):
        self.info = info
        self.skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # sliding-window path: decode from here
        self._read = 0  # sliding-window path: text up to here was emitted

    def push(self, token_id: int) -> str:
        if self.skip_special and token_id in self.info.special_ids:
            return ""
        if self.info.token_bytes is not None:
            if not 0 <= token_id < len(self.info.token_bytes):
                # The model's vocabulary may be padded past the tokenizer's; like HF's decode, such
                # ids carry no text (they must not crash the step loop).
                return ""
            return self._utf8.decode(self.info.token_bytes[token_id])
        self._ids.append(token_id)
        prefix_text = self.info.decode(self._ids[self._prefix : self._read], self.skip_special)
        full_text = self.info.decode(self._ids[self._prefix :], self.skip_special)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        if self.info.token_bytes is not None:
            return self._utf8.decode(b"", final=True)
        prefix_text = self.info.decode(self._ids[self._prefix : self._read], self.skip_special)
        full_text = self.info.decode(self._ids[self._prefix :], self.skip_special)
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could still start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._held = ""
        self.text = ""  # everything released so far

    def push(self, new_text: str, check: bool = True) -> tuple[str, bool]:
        """Returns (text safe to emit now, stopped). On a stop, text ends right before the stop string.

        With check=False (before min_tokens) stop strings are not matched and nothing is held back.
        """
        if not check:
            emit, self._held = self._held + new_text, ""
            self.text += emit
            return emit, False
        if not self.stops:
            self.text += new_text
            return new_text, False
        buf = self._held + new_text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.text += buf[:cut]
            return buf[:cut], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        emit, self._held = buf[: len(buf) - hold], buf[len(buf) - hold :]
        self.text += emit
        return emit, False

    def flush(self) -> str:
        emit, self._held = self._held, ""
        self.text += emit
        return emit
