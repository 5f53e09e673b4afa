"""The draft-model drafter: a small decoder with the target's tokenizer guesses the next tokens greedily.

One call drafts for every sequence that uses it: a forward that catches each sequence's draft cache up
with its tokens (the whole prompt the first time, then the one or two tokens the last verification added)
and yields the first draft token, then one batched single-token forward per further draft position. Drafts
are greedy, so a proposal is a point mass and the verification rule (spec/verify.py) stays exact and keeps
seeded outputs identical to plain decoding.

Its KV lives in a cache of its own: each sequence holds a slot, a contiguous run of blocks of the draft
model's paged cache, read through the engine's own attention code (model/attention.py). The slot remembers
the token ids whose K/V it holds, so it never has to be told what happened to a draft: a sequence's tokens
only grow (preemption by recompute or swap keeps them), so the valid part of the slot is the common prefix
of what it holds and the sequence's tokens -- rejected draft tokens fall out of it by themselves and are
overwritten. Slots are reused least recently used first; a sequence that lost its slot is prefilled again.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.engine.config import ConfigError
from services.engine.model.attention import AttnMetadata, DecodeGroup, LayerKV, build_group
from services.engine.model.loader import load_model

if TYPE_CHECKING:  # drafter.py builds this drafter: a runtime import back would be a cycle
    from services.engine.spec.drafter import DraftRequest

BLOCK = 16  # tokens per block of the draft cache (a slot's blocks are contiguous: no table to keep)
LONG_ROWS = 8  # catch-up rows longer than this (new prompts) attend in a padded group of their own


@dataclass(slots=True)
class _Slot:
    index: int
    ids: np.ndarray  # token ids whose K/V the slot holds, by position
    fed: int = 0  # positions written (real tokens, then draft tokens)
    real: int = 0  # of those, the leading ones known to be the sequence's tokens


class DraftModelDrafter:
    name = "draft_model"

    def __init__(self, model_dir: Path, *, vocab_size: int, max_seqs: int, dtype: torch.dtype, device: str,
                 kernel=None, pack: bool = True):
        """`kernel`: the engine's paged decode kernel (kernels/choice.py), or None for gather + SDPA; `pack`: its
        weights prepacked for the CPU's oneDNN GEMM (EngineConfig.cpu_packed_gemm)."""
        from services.engine.kernels.attention_native import NativeAttention

        self.model = load_model(Path(model_dir), dtype=dtype, device=device, pack=pack)
        cfg = self.model.config
        # The native CPU kernel where it takes this shape (the draft's cache is in the compute dtype, never fp8).
        ok = isinstance(kernel, NativeAttention) and kernel.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                                     BLOCK, dtype)
        self.kernel = kernel if ok else None
        if cfg.vocab_size != vocab_size:
            raise ConfigError(f"draft model {model_dir}: vocabulary {cfg.vocab_size} != the target's {vocab_size} "
                              "(it must share the target's tokenizer)")
        self.device = device
        self.max_len = cfg.max_position_embeddings
        self.blocks_per_slot = -(-self.max_len // BLOCK)
        self.num_slots = max_seqs
        shape = (max_seqs * self.blocks_per_slot, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [LayerKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(cfg.num_layers)]
        # Seconds per single-token draft forward (one batched position), decayed: what the controller charges a
        # draft token. Catch-up forwards (new prompts) are left out: a one-off per sequence, and a spike that
        # would price the drafter out for good (a drafter that never drafts never measures again).
        self.cost_per_position = 0.0
        # Seconds per token of a catch-up forward (a sequence's tokens the draft model has not seen), decayed.
        self.cost_per_catchup_token = 0.0
        self._slots: OrderedDict[str, _Slot] = OrderedDict()  # least recently used first
        self._free = list(range(max_seqs - 1, -1, -1))
        self._warm_up()

    def _warm_up(self) -> None:
        """One untimed catch-up and draft position through a slot left free: a process's first forwards pay
        one-off costs (allocations, thread pools; 9 ms for a 60-token catch-up that then takes 2 ms on the demo
        draft model), and the first timed catch-up would otherwise price every catch-up ~4x too high -- enough to
        keep the draft model off sequences it pays on until the decayed estimate came back down."""
        n = min(2 * LONG_ROWS, self.max_len - 1)
        if n < 2:
            return
        self._run([_Slot(0, np.zeros(self.max_len, dtype=np.int64))], [[0] * n], [0], [n], [2], timed=False)

    def catchup_cost(self, seq: DraftRequest) -> float:
        """Seconds the forward that brings this sequence's draft state up to date would take beyond the one
        token every draft feeds (0 until a catch-up has been measured)."""
        if not self.cost_per_catchup_token:
            return 0.0
        slot = self._slots.get(seq.request_id)
        tokens = seq.all_token_ids
        have = self._valid_prefix(slot, tokens) if slot is not None else 0
        return max(0, len(tokens) - have - 1) * self.cost_per_catchup_token

    def forget(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot.index)

    def propose(self, seqs: list[DraftRequest], ks: list[int]) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = [()] * len(seqs)
        rows, slots, new_ids, starts, lens, depth = [], [], [], [], [], []
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            tokens = seq.all_token_ids
            k = min(k, self.max_len - len(tokens) + 1)  # the draft model's own context limit
            if k <= 0 or len(rows) == self.num_slots:  # (max_seqs is the controller's max_running: never hit)
                continue
            slot = self._slot(seq.request_id)
            have = self._valid_prefix(slot, tokens)
            rows.append(i)
            slots.append(slot)
            new_ids.append(tokens[have:])
            starts.append(have)
            lens.append(len(tokens))
            depth.append(k)
        if not rows:
            return out
        drafts = self._run(slots, new_ids, starts, lens, depth)
        for i, slot, ids, start, n, k, d in zip(rows, slots, new_ids, starts, lens, depth, drafts, strict=True):
            slot.ids[start:n] = ids
            slot.ids[n : n + k - 1] = d[: k - 1]
            slot.real, slot.fed = n, n + k - 1
            out[i] = tuple(d[:k])
        return out

    def check_integrity(self, live: set[str]) -> None:
        assert set(self._slots) <= live, set(self._slots) - live
        held = [s.index for s in self._slots.values()]
        assert sorted(held + self._free) == list(range(self.num_slots))
        assert all(s.real <= s.fed <= self.max_len for s in self._slots.values())

    def _slot(self, request_id: str) -> _Slot:
        slot = self._slots.pop(request_id, None)
        if slot is None:
            if not self._free:  # every slot taken: the least recently drafting sequence gives its up
                _, lru = self._slots.popitem(last=False)
                self._free.append(lru.index)
            slot = _Slot(self._free.pop(), np.zeros(self.max_len, dtype=np.int64))
        self._slots[request_id] = slot  # most recently used
        return slot

    @staticmethod
    def _valid_prefix(slot: _Slot, tokens: list[int]) -> int:
        """Positions whose K/V in the slot belong to the sequence's tokens: the known-real ones, then the
        fed draft tokens the sequence went on to accept. The last token is always fed again (its logits
        give the first draft token)."""
        upto = min(slot.fed, len(tokens) - 1)
        if upto <= slot.real:
            return upto
        same = slot.ids[slot.real : upto] == np.asarray(tokens[slot.real : upto], dtype=np.int64)
        return slot.real + int(np.argmin(same)) if not same.all() else upto

    @torch.inference_mode()
    def _run(self, slots: list[_Slot], new_ids: list[list[int]], starts: list[int], lens: list[int],
             depth: list[int], timed: bool = True) -> list[list[int]]:
        dev = self.device
        base = torch.tensor([s.index * self.blocks_per_slot for s in slots], device=dev)
        start = torch.tensor(starts, device=dev)
        ctx = torch.tensor(lens, device=dev)
        q = ctx - start
        # Catch-up: every sequence's missing tokens in one flattened forward; its last row's argmax is d_1.
        ids = torch.tensor([t for row in new_ids for t in row], dtype=torch.int64, device=dev)
        ends = torch.cumsum(q, 0)
        first = ends - q
        if int(ends[-1]) == len(slots):  # one new token each (the usual case after the first draft)
            positions = start
            slot_map = base * BLOCK + positions
        else:
            positions = torch.arange(int(ends[-1]), device=dev) - torch.repeat_interleave(first - start, q)
            slot_map = torch.repeat_interleave(base, q) * BLOCK + positions
        t_catch = time.perf_counter()
        token = self._next(ids, positions, AttnMetadata(slot_mapping=slot_map, groups=self._groups(first, q, ctx, base)),
                           ends - 1)
        extra = int(ends[-1]) - len(slots)
        # A real catch-up (not one token a sequence): the forward's time over its extra tokens (an upper bound:
        # the forward's fixed cost is in it). On CUDA this times the launch; the drafts' .tolist() syncs later.
        if extra >= 8 and timed:
            per = (time.perf_counter() - t_catch) / extra
            c = self.cost_per_catchup_token
            self.cost_per_catchup_token = per if not c else 0.8 * c + 0.2 * per
        steps = [token]
        k = torch.tensor(depth, device=dev)
        one = torch.ones_like(q)
        rows = torch.arange(len(slots), device=dev)
        # Further positions: the previous draft token of every sequence still drafting, one row each.
        t0 = time.perf_counter()
        for j in range(1, max(depth)):
            live = rows if min(depth) > j else torch.nonzero(k > j).squeeze(1)
            n = live.numel()
            pos = ctx.index_select(0, live) + (j - 1)
            b = base.index_select(0, live)
            meta = AttnMetadata(slot_mapping=b * BLOCK + pos, groups=self._groups(rows[:n], one[:n], pos + 1, b))
            if n == len(slots):
                token = self._next(token, pos, meta, rows)
            else:
                nxt = torch.full_like(token, -1)
                nxt[live] = self._next(token.index_select(0, live), pos, meta, rows[:n])
                token = nxt
            steps.append(token)
        drafts = torch.stack(steps, 1).tolist()
        if max(depth) > 1 and timed:
            per = (time.perf_counter() - t0) / (max(depth) - 1)
            self.cost_per_position = per if not self.cost_per_position else 0.9 * self.cost_per_position + 0.1 * per
        return drafts

    def _groups(self, token_starts, query_lens, context_lens, slot_base) -> tuple:
        """Attention groups: one-token rows through the engine's paged decode kernel (in place, when it has
        one), longer rows (new prompts) padded per length class."""
        single = query_lens == 1
        if self.kernel is not None and bool(single.all()):
            return (self._decode_group(token_starts, context_lens, slot_base),)
        groups = []
        if self.kernel is not None and bool(single.any()):
            sel = single.nonzero().squeeze(1)
            groups.append(self._decode_group(token_starts[sel], context_lens[sel], slot_base[sel]))
            single = ~single
            token_starts, query_lens, context_lens, slot_base = (
                t[single] for t in (token_starts, query_lens, context_lens, slot_base))
        long = query_lens > LONG_ROWS
        for m in (long, ~long):
            if bool(m.any()):
                groups.append(build_group(token_starts[m], query_lens[m], context_lens[m],
                                          self._tables(context_lens[m], slot_base[m]), BLOCK,
                                          self.model.config.sliding_window, self.model.dtype))
        return tuple(groups)

    def _decode_group(self, rows, context_lens, slot_base) -> DecodeGroup:
        return DecodeGroup(rows=rows, context_lens=context_lens, block_tables=self._tables(context_lens, slot_base),
                           kernel=self.kernel, sliding_window=self.model.config.sliding_window,
                           num_threads=torch.get_num_threads())

    @staticmethod
    def _tables(context_lens, slot_base) -> torch.Tensor:
        nb = -(-int(context_lens.max()) // BLOCK)
        return slot_base[:, None] + torch.arange(nb, device=slot_base.device)[None, :]

    def _next(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, rows: torch.Tensor) -> torch.Tensor:
        hidden = self.model.forward(ids, positions, meta, self.caches)
        if rows.numel() != hidden.shape[0]:
            hidden = hidden.index_select(0, rows)
        return self.model.logits(hidden).argmax(-1)
