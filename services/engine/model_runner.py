"""Turns a step plan into batched tensors, runs the decoder over the paged KV cache, and samples.

The runner owns the KV cache tensors; block bookkeeping stays with the KV manager. The two meet in
the plan: block tables and how many tokens each sequence computes.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.config import KV_SCALE_DTYPE
from services.engine.grammar import MaskFiller
from services.engine.kernels.kv_fp8 import FP8_KV_DTYPE, Fp8WritePlan
from services.engine.kv.copies import BlockCopy, CopyKind, copy_batches
from services.engine.lora.step import slot_runs
from services.engine.model.attention import (AttnGroup, AttnMetadata, DecodeGroup, DecodeKernel, Fp8Writer, LayerKV,
                                             build_group, split_into_decode_rows)
from services.engine.model.layers import LoraHook
from services.engine.model.llama import LlamaModel
from services.engine.sampler import SamplerOutput, SamplingBatch, sample
from services.engine.scheduler import ScheduledSeq, StepPlan
from services.engine.spec.verify import sample_rows as verify_rows

# Prompt chunks of up to this many tokens attend through the native CPU decode kernel as one-row sequences
# (attention.split_into_decode_rows) rather than in a padded causal SDPA group. Measured on the serving bench's
# model (head_dim 32, 8/2 heads, block 16; AMD EPYC, 2 threads, stop 42): 256 fresh prompts of ~105 tokens spent
# 0.98 s in attention (0.41 s of it prefill) -> 0.75-0.82 s; a 1,000-token chunk's step 191 -> 171 ms, 500 tokens
# 132 -> 128 ms, 256 tokens equal. Longer chunks (their rows' work grows with the square) stay in SDPA.
PREFILL_DECODE_ROWS_MAX = 1024


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttnMetadata
    sample_rows: torch.Tensor  # [B] rows of the flattened batch whose logits are sampled
    sampled: list[ScheduledSeq]
    token_slots: torch.Tensor  # [T] adapter slot per token (-1 = base)
    has_lora: bool
    # (slot, first row, end row) runs of the flattened batch when its rows are grouped by slot (the
    # scheduler sorts them so), else None: the native CPU LoRA path plans from these directly.
    lora_runs: tuple[tuple[int, int, int], ...] | None = None


@dataclass(slots=True)
class PreparedStep:
    """Everything a step's forward and sampling need, built before it runs (ModelRunner.begin)."""

    inputs: StepInputs
    lora: LoraHook | None
    batch: SamplingBatch | None  # None: no row samples this step
    masks: object | None = None  # the grammar masks being filled (grammar.MaskFiller.start), if any row is guided


@dataclass(slots=True)
class CopyStats:
    """What a step's block copies moved, and the wall time of the host <-> device ones."""

    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    cow_blocks: int = 0
    swap_bytes: int = 0
    swap_seconds: float = 0.0


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, eos_token_ids: tuple[int, ...],
                 attention_kernel: DecodeKernel | None = None, kv_dtype: str = "auto",
                 fp8_writer: Fp8Writer | None = None):
        """kv_dtype "auto": K/V in the model's dtype; "fp8": e4m3 with per-(block, kv head) scales, written by
        `fp8_writer` (the native CPU writer) or else by torch (kernels/kv_fp8.py)."""
        cfg = model.config
        self.model = model
        self.attention_kernel = attention_kernel  # decode rows attended in place (native CPU / Triton kernel)
        self.block_size = block_size
        self.device = model.device
        self.eos_token_ids = eos_token_ids
        self.kv_fp8 = kv_dtype == "fp8"
        self.fp8_writer = fp8_writer if self.kv_fp8 else None
        # The native CPU kernel's library also does the layers' elementwise passes (fp32 only, like its attention).
        native = torch.device(self.device).type == "cpu" and model.dtype == torch.float32
        self.elementwise = attention_kernel if native and hasattr(attention_kernel, "rope_write_kv") else None
        self.kv_dtype = FP8_KV_DTYPE if self.kv_fp8 else model.dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

        def zeros(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.kv_caches = [
            LayerKV(zeros(shape, self.kv_dtype), zeros(shape, self.kv_dtype),
                    *((zeros(shape[::2], KV_SCALE_DTYPE), zeros(shape[::2], KV_SCALE_DTYPE)) if self.kv_fp8 else ()))
            for _ in range(cfg.num_layers)
        ]

        self.host_blocks: list[torch.Tensor] = []  # the host tier: one CPU tensor per kv_block_tensors() entry
        self._masks: MaskFiller | None = None  # made on the first constrained step

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_block_tensors())

    def kv_block_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding per-block KV state -- K and V of every layer and, with fp8, their scales --
        each indexed by block id in dim 0. Copying or swapping block b means moving index b of each: a block
        with its scales is self-contained. Block copies and swaps go over this list, never over K and V by
        name (moving fp8 ones as bytes: not every indexing op takes fp8)."""
        return [t for layer in self.kv_caches for t in layer.tensors()]

    @property
    def kv_bytes_per_token(self) -> float:
        """Cache bytes per token slot, scales included."""
        k = self.kv_caches[0].k
        return self.kv_cache_bytes / (k.shape[0] * k.shape[1])

    @property
    def block_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.kv_block_tensors())

    def allocate_host_blocks(self, num_blocks: int) -> None:
        """The host tier: CPU tensors shaped like kv_block_tensors(), `num_blocks` blocks each (pinned
        when the device is a GPU, so copies can use DMA). Pages are touched only when blocks are used."""
        pin = torch.device(self.device).type == "cuda"
        self.host_blocks = [
            torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)
            for t in map(_movable, self.kv_block_tensors())
        ] if num_blocks else []

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> CopyStats:
        """Run a step's block copies in their order (batched where they do not depend on each other)."""
        stats = CopyStats()
        dev = self.device
        for batch in copy_batches(copies):
            t0 = time.perf_counter()
            n = len(batch.src)
            src = torch.tensor(batch.src, dtype=torch.int64)
            dst = torch.tensor(batch.dst, dtype=torch.int64)
            if batch.kind is CopyKind.COW:
                src, dst = src.to(dev), dst.to(dev)
                for t in map(_movable, self.kv_block_tensors()):
                    t.index_copy_(0, dst, t.index_select(0, src))
                stats.cow_blocks += n
                continue
            assert self.host_blocks, "a swap without a host tier"
            for t, h in zip(map(_movable, self.kv_block_tensors()), self.host_blocks, strict=True):
                if batch.kind is CopyKind.SWAP_OUT:
                    h.index_copy_(0, dst, t.index_select(0, src.to(dev)).to("cpu"))
                else:
                    t.index_copy_(0, dst.to(dev), h.index_select(0, src).to(dev, non_blocking=True))
            if torch.device(dev).type == "cuda":
                torch.cuda.synchronize(dev)
            stats.swap_seconds += time.perf_counter() - t0
            stats.swap_bytes += n * self.block_bytes
            if batch.kind is CopyKind.SWAP_OUT:
                stats.swap_out_blocks += n
            else:
                stats.swap_in_blocks += n
        return stats

    def measure_copy_bandwidth(self, num_blocks: int = 16, repeats: int = 3) -> tuple[int, float]:
        """(bytes, seconds) of copying `num_blocks` blocks to the host tier and back, best of `repeats`:
        the swap cost model's first estimate, before any real swap is timed. Leaves the KV as it was
        (the blocks are copied back onto themselves)."""
        n = min(num_blocks, self.kv_caches[0].k.shape[0], self.host_blocks[0].shape[0] if self.host_blocks else 0)
        if n == 0:
            return 0, 0.0
        ids = list(range(n))
        best = float("inf")
        for _ in range(repeats):
            stats = self.copy_blocks([BlockCopy(CopyKind.SWAP_OUT, i, i) for i in ids]
                                     + [BlockCopy(CopyKind.SWAP_IN, i, i) for i in ids])
            best = min(best, stats.swap_seconds)
        return 2 * n * self.block_bytes, best

    def prepare(self, plan: StepPlan, token_ids: list[int] | None = None) -> StepInputs:
        """`token_ids`: the step's input ids when the plan's rows carry no sequences (a tensor-parallel
        worker rebuilds the plan from rank 0's broadcast: parallel/step_io.py)."""
        dev, bs = self.device, self.block_size
        scheduled = plan.scheduled
        ids = token_ids
        if ids is None:
            ids = []
            for s in scheduled:
                ids.extend(s.seq.token_ids[s.start : s.start + s.num_new_tokens - len(s.draft)])
                ids.extend(s.draft)  # speculative rows: verified by sampling every one of their positions
        n_seqs = len(scheduled)
        starts = torch.tensor([s.start for s in scheduled], dtype=torch.int64)
        lens = torch.tensor([s.num_new_tokens for s in scheduled], dtype=torch.int64)
        offsets = torch.cumsum(lens, 0) - lens  # first row of each sequence in the flattened batch
        seq_of_token = torch.repeat_interleave(torch.arange(n_seqs), lens)
        positions = starts[seq_of_token] + torch.arange(int(lens.sum())) - offsets[seq_of_token]
        tables = _block_tables(scheduled)
        slot_mapping = tables[seq_of_token, positions // bs] * bs + positions % bs
        ctx = starts + lens

        # A draft's k + 1 rows, and with the native CPU kernel a prompt chunk of up to PREFILL_DECODE_ROWS_MAX
        # tokens, attend as one-row sequences at consecutive positions: the decode kernel's rows.
        native = self.attention_kernel is not None and torch.device(self.device).type == "cpu"
        a_offsets, a_lens, a_ctx, a_tables = split_into_decode_rows(offsets, lens, ctx, tables, torch.tensor(
            [bool(s.draft) or (native and 1 < s.num_new_tokens <= PREFILL_DECODE_ROWS_MAX) for s in scheduled]))
        groups: list[AttnGroup | DecodeGroup] = []
        if self.attention_kernel is not None:
            decode = (a_lens == 1).nonzero().squeeze(1)
            if decode.numel():
                d_ctx = a_ctx[decode]
                groups.append(DecodeGroup(
                    rows=a_offsets[decode].to(dev), context_lens=d_ctx.to(dev),
                    block_tables=a_tables[decode, : int((d_ctx.max() + bs - 1) // bs)].contiguous().to(dev),
                    kernel=self.attention_kernel, sliding_window=self.model.config.sliding_window,
                    num_threads=torch.get_num_threads(),
                ))
            buckets = _prefill_buckets(a_lens, a_ctx, bs)
        else:
            buckets = _attention_buckets(a_lens, a_ctx, bs)
        for sel in buckets:
            g_ctx = a_ctx[sel]
            nblocks = int((g_ctx.max() + bs - 1) // bs)
            groups.append(
                build_group(
                    a_offsets[sel].to(dev),
                    a_lens[sel].to(dev),
                    g_ctx.to(dev),
                    a_tables[sel, :nblocks].to(dev),
                    bs,
                    self.model.config.sliding_window,
                    self.model.dtype,
                )
            )
        num_samples = torch.tensor([s.samples * (1 + len(s.draft)) for s in scheduled], dtype=torch.int64)
        sample_rows = verify_rows(offsets + lens, num_samples)
        slot_list = [s.lora_slot for s in scheduled]
        slots = torch.tensor(slot_list, dtype=torch.int64)
        has_lora = max(slot_list) >= 0
        slot_mapping = slot_mapping.to(dev)
        fp8_plan = Fp8WritePlan.build(slot_mapping, bs) if self.kv_fp8 and self.fp8_writer is None else None
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            attn=AttnMetadata(slot_mapping=slot_mapping, groups=tuple(groups), fp8_write=fp8_plan,
                              fp8_writer=self.fp8_writer, num_threads=torch.get_num_threads(),
                              elementwise=self.elementwise),
            sample_rows=sample_rows.to(dev),
            sampled=[s for s in scheduled if s.samples],
            token_slots=slots[seq_of_token].to(dev),
            has_lora=has_lora,
            lora_runs=_slot_runs(scheduled) if has_lora else None,
        )

    def sampling_batch(self, sampled: list[ScheduledSeq]) -> SamplingBatch:
        """One row per sampled position: a sequence with a k-token draft has k + 1, the j-th sampling output
        position n + j (its counter, and its min_tokens ban) as plain decoding would (spec/verify.py)."""
        reps = [1 + len(s.draft) for s in sampled]
        params = [s.seq.params for s, r in zip(sampled, reps) for _ in range(r)]
        temps = [p.temperature for p in params]
        top_p = [p.top_p for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        counters = [s.seq.num_output_tokens + j for s, r in zip(sampled, reps) for j in range(r)]
        banned_rows: list[int] = []
        banned_cols: list[int] = []
        for row, (p, n) in enumerate(zip(params, counters)):
            if n < p.min_tokens:
                for tok in (*self.eos_token_ids, *p.stop_token_ids):
                    banned_rows.append(row)
                    banned_cols.append(tok)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        dev = self.device
        return SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=dev),
            seeds=torch.tensor([s.seq.seed for s, r in zip(sampled, reps) for _ in range(r)], dtype=torch.int64, device=dev),
            counters=torch.tensor(counters, dtype=torch.int64, device=dev),
            banned_rows=torch.tensor(banned_rows, dtype=torch.int64, device=dev) if banned_rows else None,
            banned_cols=torch.tensor(banned_cols, dtype=torch.int64, device=dev) if banned_rows else None,
            num_logprobs=max(logprobs) if logprobs else -1,
            all_greedy=all(t == 0 for t in temps),
            any_filter=any(k > 0 for k in top_k) or any(p < 1 for p in top_p),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan, adapters=None) -> tuple[StepInputs, SamplerOutput | None]:
        step = self.begin(plan, adapters)
        return step.inputs, self.run(step)

    @torch.inference_mode()
    def begin(self, plan: StepPlan, adapters=None) -> PreparedStep:
        """A step's CPU-side work before its forward: input tensors, LoRA plan, sampling batch (and the grammar
        masks, filled on a thread while the forward runs). Async scheduling (overlap.py) calls it while the
        previous step's forward runs; it reads sequence state only, never the KV tensors."""
        return self.lora_and_sampling(self.prepare(plan), adapters)

    def lora_and_sampling(self, inputs: StepInputs, adapters=None) -> PreparedStep:
        """The LoRA plan, sampling batch and grammar masks of prepared inputs (a tensor-parallel rank 0 builds
        its inputs first, sends them, then this)."""
        lora: LoraHook | None = None
        if inputs.has_lora:
            from services.engine.lora.step import StepLora

            lora = StepLora(adapters, inputs.token_slots, inputs.lora_runs)
        guided = [row for row, s in enumerate(inputs.sampled) if s.seq.matcher is not None]
        masks = self._mask_filler().start([inputs.sampled[r].seq.matcher for r in guided]) if guided else None
        batch = self.sampling_batch(inputs.sampled) if inputs.sampled else None
        if masks is not None:
            # Constrained sequences get no draft (spec/controller.py): one row each, after others' drafts.
            first = list(itertools.accumulate((1 + len(s.draft) for s in inputs.sampled), initial=0))
            batch.guided_rows = torch.tensor([first[r] for r in guided], dtype=torch.int64, device=self.device)
        return PreparedStep(inputs, lora, batch, masks)

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> SamplerOutput | None:
        """The forward and the sampling of a prepared step: tensors only, no sequence state."""
        inputs = step.inputs
        # Only the sampled rows' final hidden states are computed past the last layer's attention (`keep`).
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches, step.lora,
                                    keep=inputs.sample_rows)
        if step.batch is None:
            return None
        logits = self.model.logits(hidden)
        if step.masks is not None:  # filled while the forward ran (grammar.MaskFiller)
            step.batch.bitmask = step.masks.result().to(self.device, non_blocking=True)
        return sample(logits, step.batch)

    def _mask_filler(self) -> MaskFiller:
        if self._masks is None:
            # On the CPU a fill overlaps the forward only on a core the forward does not use: with the forward's
            # threads on every core, the grammar thread takes a core from it (on 2 cores, 2 threads: TPOT overhead
            # at 64 of 64 rows constrained 10-12% with the hand-off against 6-9% inline, interleaved runs).
            spare_core = (os.cpu_count() or 1) > torch.get_num_threads()
            self._masks = MaskFiller(self.model.config.vocab_size,
                                     threaded=torch.device(self.device).type == "cpu" and spare_core)
        return self._masks


def _block_tables(scheduled: list[ScheduledSeq]) -> torch.Tensor:
    """The rows' block tables [n, widest], padded with block 0 (never read: context lengths bound every read).
    Filled through one mask from the tables laid end to end: a nested list through torch.tensor took ~250 us
    at 256 decode rows, this ~70."""
    n = len(scheduled)
    lens = np.fromiter((len(s.block_table) for s in scheduled), dtype=np.int64, count=n)
    flat = np.fromiter(itertools.chain.from_iterable(s.block_table for s in scheduled), dtype=np.int64,
                       count=int(lens.sum()))
    tables = np.zeros((n, int(lens.max())), dtype=np.int64)
    tables[np.arange(tables.shape[1]) < lens[:, None]] = flat
    return torch.from_numpy(tables)


def _slot_runs(scheduled: list[ScheduledSeq]) -> tuple[tuple[int, int, int], ...] | None:
    """The step's rows in runs of one adapter slot (lora/step.slot_runs), or None if they are not grouped."""
    return slot_runs((s.lora_slot, s.num_new_tokens) for s in scheduled)


def _attention_buckets(lens: torch.Tensor, ctx: torch.Tensor, block_size: int, max_buckets: int = 4) -> list[torch.Tensor]:
    """Index sets of sequences attended together. Prefill chunks form one group; decode rows are
    split by context length so that no row pays for the longest context in the batch (the padded
    key gather is most of a CPU decode step). Bucket edges are chosen where they save the most padding."""
    out = _prefill_buckets(lens, ctx, block_size, max_buckets)
    decode = (lens == 1).nonzero().squeeze(1)
    if decode.numel() == 0:
        return out
    blocks = (ctx[decode] + block_size - 1) // block_size
    order = torch.argsort(blocks)
    decode, blocks = decode[order], blocks[order].tolist()
    n = len(blocks)
    cuts = [0, n]
    for _ in range(max_buckets - 1):
        # Greedy: add the cut that removes the most padded blocks (rows * (bucket max - row length)).
        best, best_gain = None, 0
        for a, b in zip(cuts, cuts[1:]):
            top = blocks[b - 1]
            for c in range(a + 1, b):
                gain = (c - a) * (top - blocks[c - 1])
                if gain > best_gain and blocks[c - 1] != top:
                    best, best_gain = c, gain
        if best is None or best_gain * 4 < n:  # a bucket costs a kernel launch per layer: not for crumbs
            break
        cuts = sorted(cuts + [best])
    out += [decode[a:b] for a, b in zip(cuts, cuts[1:])]
    return out


def _prefill_buckets(lens: torch.Tensor, ctx: torch.Tensor, block_size: int, max_buckets: int = 4) -> list[torch.Tensor]:
    """Index sets of the prefill rows (more than one new token), attended as padded groups. A group
    computes every (query slot, key slot) pair of its rectangle, rows x longest chunk x longest context,
    and a step's chunks range from a whole fresh prompt to a few tokens after a cached prefix: in one
    group the bench workload's prefill computed 8.7x the causal pairs. Rows sorted by chunk length are
    cut where a cut removes the most rectangle, while a cut removes at least 1/16 of it."""
    prefill = (lens > 1).nonzero().squeeze(1)
    n = prefill.numel()
    if n <= 1:
        return [prefill] if n else []
    q, c = lens[prefill], (ctx[prefill] + block_size - 1) // block_size
    order = torch.argsort(q * (int(c.max()) + 1) + c)  # by chunk length, then by context
    prefill, q, c = prefill[order], q[order].tolist(), c[order].tolist()

    cuts = [0, n]
    total = n * q[-1] * max(c)
    for _ in range(max_buckets - 1):
        best, best_gain = None, 0
        for a, b in zip(cuts, cuts[1:]):
            suffix_max = c[a:b]  # suffix_max[i - a] = max(c[i:b])
            for i in range(b - 2, a - 1, -1):
                suffix_max[i - a] = max(suffix_max[i - a], suffix_max[i - a + 1])
            whole = (b - a) * q[b - 1] * suffix_max[0]
            prefix_max = 0
            for m in range(a + 1, b):
                prefix_max = max(prefix_max, c[m - 1])
                gain = whole - (m - a) * q[m - 1] * prefix_max - (b - m) * q[b - 1] * suffix_max[m - a]
                if gain > best_gain:
                    best, best_gain = m, gain
        if best is None or best_gain * 16 < total:
            break
        cuts = sorted(cuts + [best])
    return [prefill[a:b] for a, b in zip(cuts, cuts[1:])]


def _movable(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or for fp8 its bytes: block copies move bytes, and fp8 lacks some indexing ops."""
    return t.view(torch.uint8) if t.dtype == FP8_KV_DTYPE else t
