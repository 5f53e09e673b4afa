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
        return Matcher(xgr.GrammarMatcher(self.get(Guide.parse(guide_text))))


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
    vocab = [b"" if i in tok.special_ids else b for i, b in enumerate(tok.token_bytes)]
    vocab += [b""] * (vocab_size - len(vocab))
    return xgr.TokenizerInfo(vocab[:vocab_size], xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=list(stop_ids), add_prefix_space=False)


class Matcher:
    """One constrained sequence's place in its grammar."""

    __slots__ = ("raw",)

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.raw = matcher

    def accept(self, token: int) -> bool:
        return self.raw.accept_token(token)

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
