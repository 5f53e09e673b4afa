"""Prompt sharing between concurrent requests: `n > 1` choices and identical prompts fork one another.

Requests with the same prompt and the same cache extra (tenant cache salt, adapter content id) form a
group. A waiting member whose group has a running member that has computed the whole prompt but its
last token forks it: its table shares those blocks, partial last block included, and it computes only
from the last prompt token on (the first write into the shared block copies it). While a member is
still prefilling the prompt, the others wait for it instead of computing the same prompt beside it.
"""
from __future__ import annotations

from services.engine.sequence import Sequence, Status

WAIT = object()  # `source` answer: a member is computing the prompt; wait for it


class PromptGroups:
    def __init__(self) -> None:
        self._groups: dict[tuple, list[Sequence]] = {}
        self._key_of: dict[str, tuple] = {}

    def add(self, seq: Sequence) -> None:
        key = (seq.cache_extra, tuple(seq.prompt_token_ids))
        self._key_of[seq.request_id] = key
        self._groups.setdefault(key, []).append(seq)

    def remove(self, seq: Sequence) -> None:
        key = self._key_of.pop(seq.request_id, None)
        if key is None:
            return
        group = self._groups[key]
        group.remove(seq)
        if not group:
            del self._groups[key]

    def source(self, seq: Sequence) -> Sequence | object | None:
        """The running member to fork `seq` from, WAIT while a member still computes the prompt, or None
        (compute it alone). A running member holds its blocks on the device; one admitted, forked or
        swapped in earlier in this step counts too: the step's block copies and forward run in order."""
        group = self._groups.get(self._key_of.get(seq.request_id))
        if not group or len(group) == 1:
            return None
        need = seq.num_prompt_tokens - 1
        waiting = False
        for other in group:
            if other is seq or other.status is not Status.RUNNING:
                continue
            if other.num_computed_tokens >= need:
                return other
            waiting = True
        return WAIT if waiting else None

    def __len__(self) -> int:
        return len(self._key_of)
