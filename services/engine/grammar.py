"""Constrained decoding with xgrammar: a structured.Guide compiled once into a grammar (cached by the
guide's content hash, bounded LRU), a matcher per constrained sequence, and the step's token bitmask for
the constrained rows, filled on a worker thread while the forward runs.

Why xgrammar and not llguidance: on this sampler (docs/engine.md, "Structured outputs") filling a 64-row
mask took 0.08 ms with xgrammar and 0.87 ms with llguidance (0.61 ms with its parallel fill), with equal
compile times; both enforce the same JSON Schema subset we accept.

A matcher's state is a function of the sequence's output tokens, which the engine never drops: a
sequence preempted by recompute or swap keeps its tokens and so keeps its matcher as it is.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from services.common.structured import GUIDE_JSON_OBJECT, GUIDE_JSON_SCHEMA, Guide
from services.common.tool_calls import CALL_OPEN, CALL_SEPARATOR, CALL_SUFFIX, call_prefix
from services.common.wire import InvalidRequest
from services.engine.detokenizer import TokenizerInfo

DEFAULT_CACHE_ENTRIES = 256


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0


class GrammarCache:
    """Compiled grammars by guide content hash (sha256 of its canonical text): equal specs from any tenant
    share one entry, and nothing tenant-specific is in the key or the value. Bounded: least recently
    used entries go first."""

    def __init__(self, tokenizer: TokenizerInfo, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_entries: int = DEFAULT_CACHE_ENTRIES):
        self.vocab_size = vocab_size
        self.info = _tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.utf8 = Utf8Guard.of(tokenizer, vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._entries: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, guide: Guide) -> xgr.CompiledGrammar:
        key = guide.key
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return hit
        t0 = time.perf_counter()
        compiled = self._compile(guide)
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds += time.perf_counter() - t0
            self._entries[key] = compiled
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return compiled

    def _compile(self, guide: Guide) -> xgr.CompiledGrammar:
        try:
            if guide.kind == GUIDE_JSON_OBJECT:
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if guide.kind == GUIDE_JSON_SCHEMA:
                return self._compiler.compile_json_schema(json.dumps(_bounded_strings(guide.schema)),
                                                          any_whitespace=False, strict_mode=True)
            return self._compiler.compile_structural_tag(json.dumps(_tool_calls_tag(guide)))
        except (RuntimeError, ValueError) as exc:  # xgrammar's refusal of a schema it cannot build
            raise InvalidRequest(f"the schema cannot be compiled into a grammar: {_first_line(exc)}",
                                 "response_format" if guide.kind != "tool_calls" else "tools",
                                 "invalid_schema") from None

    def matcher(self, guide_text: str) -> Matcher:
        return Matcher(xgr.GrammarMatcher(self.get(Guide.parse(guide_text))), self.utf8)


def _tool_calls_tag(guide: Guide) -> dict:
    """One or more `<tool_call>` blocks (tool_calls.py's format), each a call to one of the guide's tools
    whose arguments match that tool's schema; nothing else. The arguments are written without free
    whitespace, as json_schema output is (a structural tag's own json_schema content allows any).
    Optional (`tool_choice: auto`): free text, in which writing `<tool_call>` opens such a call."""
    tags = [{"type": "tag", "begin": call_prefix(t.name), "end": CALL_SUFFIX,
             "content": {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(
                 json.dumps(_bounded_strings(t.parameters)), any_whitespace=False, strict_mode=True))}}
            for t in guide.tools]
    if guide.optional:
        return {"type": "structural_tag",
                "format": {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags,
                           "at_least_one": False, "stop_after_first": not guide.parallel}}
    return {"type": "structural_tag",
            "format": {"type": "tags_with_separator", "tags": tags, "separator": CALL_SEPARATOR,
                       "at_least_one": True, "stop_after_first": not guide.parallel}}


def _bounded_strings(schema):
    """The schema with each length-bounded string written as a pattern. xgrammar 0.2.8 builds minLength /
    maxLength strings from `[^"\\\r\n]`, which lets raw control characters through (not JSON); the
    pattern keeps the bounds and admits only characters that need no escape."""
    if isinstance(schema, list):
        return [_bounded_strings(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_strings(v) for k, v in schema.items()}
    if ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out:
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{lo},{hi}}}$'
    return out


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text.split(": ", 1)[-1][:300] if text.startswith("[") else text[:300]


def _tokenizer_info(tok: TokenizerInfo, vocab_size: int, stop_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """The vocabulary as raw bytes per token. Special tokens (role markers, eos) get no bytes, so a grammar
    never admits one as text (detokenization would drop it); the stop tokens are what ends a grammar."""
    if tok.token_bytes is None:
        from transformers import PreTrainedTokenizerFast  # non-byte-level vocabularies: xgrammar reads HF's

        hf = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer)
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
    vocab = _text_bytes(tok)
    vocab += [b""] * (vocab_size - len(vocab))
    return xgr.TokenizerInfo(vocab[:vocab_size], xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=list(stop_ids), add_prefix_space=False)


# -- strict UTF-8 for constrained output ------------------------------------------------------------------
# xgrammar matches a character class (a JSON string's `[^"\\]`, our length patterns) byte-wise by a lead
# byte's length only: after F0 it takes any continuation byte, so F0 89 99 82 (overlong, not UTF-8) passed as
# one character of a `maxLength: 10` string, and the client's JSON held four U+FFFD for it -- 13 characters,
# schema-invalid (found by tests/engine/test_structured.py on the stop-39 kit, sampled at temperature 1). The
# guard tracks each constrained sequence's UTF-8 decoder state and masks the tokens whose bytes would not
# continue valid UTF-8 (RFC 3629: no overlongs, no surrogates, nothing above U+10FFFF).
_S0, _C1, _C2, _C3, _E0, _ED, _F0, _F4, _BAD = range(9)  # ready; 1-3 continuations due; constrained 2nd byte


def _utf8_table() -> np.ndarray:
    """next state [state, byte] of a strict UTF-8 decoder (_BAD: invalid, and stays so)."""
    t = np.full((9, 256), _BAD, dtype=np.int8)
    t[_S0, 0x00:0x80] = _S0
    t[_S0, 0xC2:0xE0] = _C1
    t[_S0, 0xE0], t[_S0, 0xED] = _E0, _ED
    t[_S0, 0xE1:0xED] = t[_S0, 0xEE:0xF0] = _C2
    t[_S0, 0xF0], t[_S0, 0xF4] = _F0, _F4
    t[_S0, 0xF1:0xF4] = _C3
    t[_C1, 0x80:0xC0] = _S0
    t[_C2, 0x80:0xC0] = _C1
    t[_C3, 0x80:0xC0] = _C2
    t[_E0, 0xA0:0xC0] = _C1
    t[_ED, 0x80:0xA0] = _C1
    t[_F0, 0x90:0xC0] = _C2
    t[_F4, 0x80:0x90] = _C2
    return t


class Utf8Guard:
    """Per vocabulary: for each decoder state, the tokens that keep the output valid UTF-8 (a packed bitmask in
    xgrammar's layout) and the state each leads to. Tokens without bytes (special, stop, padding) only at a
    character boundary."""

    STATES = 8

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        table = _utf8_table()
        n = vocab_size
        width = max(1, max((len(b) for b in token_bytes[:n]), default=1))
        raw = np.zeros((n, width), dtype=np.int16)
        lens = np.zeros(n, dtype=np.int64)
        for i, b in enumerate(token_bytes[:n]):
            raw[i, :len(b)] = np.frombuffer(b, dtype=np.uint8)
            lens[i] = len(b)
        state = np.repeat(np.arange(self.STATES, dtype=np.int8)[:, None], n, axis=1)  # [states, vocab]
        for j in range(width):
            live = lens > j
            state[:, live] = table[state[:, live].astype(np.int64), raw[live, j]]
        empty = lens == 0
        state[:, empty] = _BAD
        state[_S0, empty] = _S0
        self.next = state  # [states, vocab]: the state after the token (_BAD: not allowed)
        ok = np.zeros((self.STATES, (n + 31) // 32 * 32), dtype=bool)
        ok[:, :n] = state != _BAD
        bits = np.packbits(ok.reshape(self.STATES, -1, 32), axis=-1, bitorder="little")  # [states, words, 4] bytes
        self.masks = torch.from_numpy(bits.copy().view(np.int32).reshape(self.STATES, -1))  # little-endian words

    @classmethod
    def of(cls, tok: TokenizerInfo, vocab_size: int) -> Utf8Guard | None:
        """None for a vocabulary without byte-level tokens (xgrammar then reads HF's; not guarded)."""
        if tok.token_bytes is None:
            return None
        return cls(_text_bytes(tok), vocab_size)

    def apply(self, bitmask: torch.Tensor, states: list[int]) -> None:
        """AND each row of `bitmask` with its state's mask; a row the guard would empty (the grammar offers only
        what is not UTF-8) keeps the grammar's mask -- never an all-masked row."""
        guarded = bitmask & self.masks[torch.tensor(states, dtype=torch.int64)]
        empty = (guarded == 0).all(dim=1)
        bitmask.copy_(torch.where(empty[:, None], bitmask, guarded))


def _text_bytes(tok: TokenizerInfo) -> list[bytes]:
    """Each token's bytes as text (a byte-level vocabulary); special tokens none, so no grammar admits one."""
    assert tok.token_bytes is not None
    return [b"" if i in tok.special_ids else b for i, b in enumerate(tok.token_bytes)]


class Matcher:
    """One constrained sequence's place in its grammar, and its UTF-8 decoder state (Utf8Guard)."""

    __slots__ = ("raw", "guard", "utf8")

    def __init__(self, matcher: xgr.GrammarMatcher, guard: Utf8Guard | None = None):
        self.raw = matcher
        self.guard = guard
        self.utf8 = _S0

    def accept(self, token: int) -> bool:
        if not self.raw.accept_token(token):
            return False
        if self.guard is not None and 0 <= token < self.guard.next.shape[1]:
            nxt = int(self.guard.next[self.utf8, token])
            self.utf8 = nxt if nxt != _BAD else _S0  # (a fallback row's invalid byte: start afresh)
        return True

    @property
    def is_terminated(self) -> bool:
        return self.raw.is_terminated()


class MaskFiller:
    """Fills the step's bitmask ([constrained rows, ceil(vocab / 32)] int32) while the forward runs.

    On a GPU the forward's kernels are queued asynchronously, so filling on the step thread after launching
    them already overlaps the GPU's work. On the CPU the forward holds the step thread, so the fill goes to
    one worker thread -- when it is long enough to pay for the hand-off (~0.1 ms): a fill measured shorter
    than `INLINE_BELOW_S` (small vocabularies, few rows) is done after the forward instead."""

    INLINE_BELOW_S = 2e-4

    def __init__(self, vocab_size: int, threaded: bool):
        self.words = (vocab_size + 31) // 32
        self.threaded = threaded
        self.fill_seconds = 0.0  # exponential mean of recent fills
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask") if threaded else None
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def start(self, matchers: list[Matcher]) -> PendingMask:
        if self._pool is not None and self.fill_seconds >= self.INLINE_BELOW_S:
            return PendingMask(self._pool.submit(self.fill, matchers), None, self)
        return PendingMask(None, matchers, self)

    def fill(self, matchers: list[Matcher]) -> torch.Tensor:
        t0 = time.perf_counter()
        bitmask = torch.empty((len(matchers), self.words), dtype=torch.int32)
        self._batch.batch_fill_next_token_bitmask([m.raw for m in matchers], bitmask)
        guard = matchers[0].guard if matchers else None
        if guard is not None:
            guard.apply(bitmask, [m.utf8 for m in matchers])
        self.fill_seconds = 0.9 * self.fill_seconds + 0.1 * (time.perf_counter() - t0)
        return bitmask


@dataclass(slots=True)
class PendingMask:
    """A step's mask being filled on the worker thread (`future`), or to be filled when asked (`matchers`)."""

    future: Future[torch.Tensor] | None
    matchers: list[Matcher] | None
    filler: MaskFiller

    def result(self) -> torch.Tensor:
        if self.future is not None:
            return self.future.result()
        assert self.matchers is not None
        return self.filler.fill(self.matchers)
