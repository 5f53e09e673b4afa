"""Drafters: cheap guesses of a sequence's next tokens, verified by the target model in the next forward.

Every drafter answers one call for the whole batch: the n-gram drafter searches each sequence's own tokens,
one vectorised search per sequence; the draft-model drafter (draft_model.py) runs batched forwards of a
small model.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from services.engine.config import SpeculativeConfig


class DraftRequest(Protocol):
    """What a drafter reads of a sequence."""

    request_id: str

    @property
    def all_token_ids(self) -> list[int]: ...


class Drafter(Protocol):
    """Proposes up to `ks[i]` next tokens for `seqs[i]`, from its prompt and output so far.

    Contract: deterministic (a proposal is a point mass, so verification by sampling the target at each
    position and keeping the matching prefix is exact rejection sampling); never longer than asked; an
    empty tuple means no guess (the sequence decodes one token as usual)."""

    name: str
    cost_per_position: float  # seconds a drafted position costs the step (0 for a drafter that runs no model)

    def propose(self, seqs: list[DraftRequest], ks: list[int]) -> list[tuple[int, ...]]: ...

    def forget(self, request_id: str) -> None:
        """The request left the engine: drop anything kept for it."""

    def check_integrity(self, live: set[str]) -> None:
        """Asserts that what it keeps is consistent and held only for requests still in the engine."""


class NgramDrafter:
    """Prompt lookup: the longest suffix of the sequence (`max_n` down to `min_n` tokens) that occurred
    earlier in it -- prompt or output -- and the tokens that followed its latest occurrence. Outputs that
    copy spans of the prompt (extraction, rewriting, formatting) or repeat themselves get long accepted
    drafts; nothing is loaded and nothing is run on the model."""

    name = "ngram"
    cost_per_position = 0.0  # a numpy search per sequence: microseconds, within the step-cost model's noise

    def __init__(self, min_n: int = 1, max_n: int = 4):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self._arrays: dict[str, np.ndarray] = {}  # token ids as a growing int64 buffer per request

    def propose(self, seqs: list[DraftRequest], ks: list[int]) -> list[tuple[int, ...]]:
        return [self._one(s, k) if k > 0 else () for s, k in zip(seqs, ks, strict=True)]

    def forget(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)

    def check_integrity(self, live: set[str]) -> None:
        assert set(self._arrays) <= live, set(self._arrays) - live

    def _tokens(self, seq: DraftRequest) -> np.ndarray:
        """The sequence's tokens as an array, appending only what is new since the last call (a preempted
        and recomputed sequence keeps its tokens, so the prefix never changes)."""
        ids = seq.all_token_ids
        arr = self._arrays.get(seq.request_id)
        n = 0 if arr is None else len(arr)
        if arr is None or n > len(ids):
            arr = np.asarray(ids, dtype=np.int64)
        elif n < len(ids):
            arr = np.concatenate([arr, np.asarray(ids[n:], dtype=np.int64)])
        self._arrays[seq.request_id] = arr
        return arr

    def _one(self, seq: DraftRequest, k: int) -> tuple[int, ...]:
        t = self._tokens(seq)
        last = len(t) - 1
        # Earlier occurrences of the last token (each with a token after it), then how far each match
        # extends backwards, up to max_n: one pass over the sequence, then a few ops over the candidates.
        cand = np.flatnonzero(t[:last] == t[last])
        if cand.size == 0:
            return ()
        length = np.ones(cand.size, dtype=np.int64)
        alive = np.ones(cand.size, dtype=bool)
        for m in range(1, min(self.max_n, last + 1)):
            alive &= (cand >= m) & (t[np.maximum(cand - m, 0)] == t[last - m])
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return ()
        start = int(cand[np.flatnonzero(length == best)[-1]]) + 1  # the latest of the longest matches
        return tuple(t[start : start + k].tolist())

def make_drafters(config: SpeculativeConfig, *, vocab_size: int, dtype, device: str,
                  attention_kernel=None, pack: bool = True) -> dict[str, Drafter]:
    """The drafters a configuration uses, by name (SpeculativeConfig.drafter_for picks one per sequence)."""
    drafters: dict[str, Drafter] = {}
    for name in config.drafter_names:
        if name == "ngram":
            drafters[name] = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        elif name == "draft_model":
            from services.engine.spec.draft_model import DraftModelDrafter

            drafters[name] = DraftModelDrafter(config.draft_model, vocab_size=vocab_size, max_seqs=config.max_running,
                                               dtype=dtype, device=device, kernel=attention_kernel, pack=pack)
        else:
            raise ValueError(f"no drafter named {name!r}")
    return drafters
