"""The native CPU paged decode attention (kernels/attention_cpu_native.c) against a float64 torch reference
over the paged cache; its refusals; its compiler fallback; engine equivalence with the gather + SDPA path;
the runner's prefill buckets and the prompt chunks it attends as decode rows."""
import logging
import math
import platform
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.config import ConfigError
from services.engine.kernels import attention_native
from services.engine.kernels.attention_native import NativeAttention
from services.engine import model_runner
from services.engine.model.attention import AttnGroup, DecodeGroup, split_into_decode_rows
from services.engine.model_runner import _attention_buckets, _prefill_buckets
from services.engine.sequence import SamplingParams
from tests.engine.conftest import make_engine, run_all

SENTINEL = 7.25  # what `out` holds before a call: rows and columns the kernel must not write keep it


@pytest.fixture(scope="module")
def kernel() -> NativeAttention:
    return attention_native.load()


def reference(q, k_cache, v_cache, rows, ctx_lens, tables, *, scale, window) -> dict[int, torch.Tensor]:
    """{query row: [H, D] float64}: each sequence's keys/values gathered through its block table, positions
    [lo, ctx) (lo = ctx - window with a sliding window), softmax(scale q.k) v per query head; query head h
    reads kv head h // (H // KVH)."""
    _, block_size, kv_heads, _ = k_cache.shape
    kv_of_head = torch.arange(q.shape[1]) // (q.shape[1] // kv_heads)
    want = {}
    for b in range(rows.shape[0]):
        ctx = int(ctx_lens[b])
        lo = max(0, ctx - window) if window else 0
        pos = torch.arange(lo, ctx)
        blocks = tables[b, pos // block_size]
        keys = k_cache[blocks, pos % block_size].double()[:, kv_of_head]  # [L, H, D]
        values = v_cache[blocks, pos % block_size].double()[:, kv_of_head]
        scores = scale * torch.einsum("hd,lhd->hl", q[int(rows[b])].double(), keys)
        want[int(rows[b])] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return want


def rows_of(n_rows: int, heads: int, head_dim: int, pad: int, gen: torch.Generator, fill: float | None = None):
    """A [n_rows, heads, head_dim] tensor; with pad > 0 a column window of a wider [n_rows, ...] tensor (row
    stride heads*head_dim + pad), as q is inside the fused qkv projection. Returns (tensor, its storage)."""
    width = heads * head_dim + pad
    full = torch.full((n_rows, width), fill) if fill is not None else torch.randn(n_rows, width, generator=gen)
    off = pad // 2
    return full[:, off : off + heads * head_dim].view(n_rows, heads, head_dim), full


def check_against_reference(kernel, q, out, out_full, k_cache, v_cache, rows, ctx_lens, tables, *, scale, window,
                            num_threads, atol=1e-5, rtol=1e-5):
    before = out_full.clone()
    kernel.decode(q, out, k_cache, v_cache, rows, ctx_lens, tables, scale=scale, window=window, num_threads=num_threads)
    want = reference(q, k_cache, v_cache, rows, ctx_lens, tables, scale=scale, window=window)
    for r, w in want.items():
        assert torch.isfinite(out[r]).all(), f"row {r}: {out[r]}"
        torch.testing.assert_close(out[r].double(), w, atol=atol, rtol=rtol, msg=lambda m: f"row {r}: {m}")
    # Everything else in out's storage -- rows not named, columns outside the [H*D] window -- is untouched.
    assert out_full.is_contiguous() and out_full.storage_offset() == 0
    assert out.untyped_storage().data_ptr() == out_full.data_ptr()  # out is a view of out_full
    written = torch.zeros_like(out_full, dtype=torch.bool)
    written.as_strided(out.shape, out.stride(), out.storage_offset())[list(want)] = True
    assert torch.equal(out_full[~written], before[~written]), "the kernel wrote outside the rows it was given"


@st.composite
def decode_cases(draw):
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.one_of(st.integers(1, 5), st.just(8)))  # 1, 2, 4, 8: the register path's groups
    head_dim = draw(st.one_of(st.integers(1, 40), st.sampled_from([7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 56, 64])))
    block_size = draw(st.sampled_from([1, 3, 8, 16, 32]))  # 32: two key tiles a block
    n_seqs = draw(st.integers(1, 6))
    max_ctx = max(6 * block_size, 20)
    ctx_lens = draw(st.lists(
        st.one_of(st.integers(1, max_ctx),  # anywhere
                  st.integers(1, max_ctx // block_size).map(lambda k: k * block_size),  # a full last block
                  st.integers(1, max_ctx // block_size).map(lambda k: k * block_size + 1)),  # one past a boundary
        min_size=n_seqs, max_size=n_seqs))
    window = draw(st.one_of(st.none(), st.integers(1, max(ctx_lens) + 2)))
    return dict(
        kv_heads=kv_heads, group=group, head_dim=head_dim, block_size=block_size, ctx_lens=ctx_lens, window=window,
        extra_width=draw(st.integers(0, 3)),  # table entries beyond the widest sequence's blocks
        pad_entry=draw(st.sampled_from(["zero", "minus_one", "past_the_cache", "valid"])),
        spare_blocks=draw(st.integers(0, 4)),
        extra_rows=draw(st.integers(0, 4)),  # q rows that no sequence names
        q_pad=draw(st.sampled_from([0, 0, 5, 64])),
        out_pad=draw(st.sampled_from([0, 0, 3, 64])),
        scale=draw(st.sampled_from([None, 0.1, 0.7, 1.5])),  # None: 1/sqrt(head_dim)
        num_threads=draw(st.sampled_from([1, 2])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build_case(c):
    """Caches, block tables (random, non-contiguous, possibly shared between sequences, padded), rows."""
    gen = torch.Generator().manual_seed(c["seed"])
    bs, kvh, d = c["block_size"], c["kv_heads"], c["head_dim"]
    heads = kvh * c["group"]
    ctx_lens = torch.tensor(c["ctx_lens"], dtype=torch.int64)
    n = ctx_lens.shape[0]
    need = ((ctx_lens + bs - 1) // bs).tolist()
    num_blocks = max(need) + c["spare_blocks"] + 1
    width = max(need) + c["extra_width"]
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    pad_value = {"zero": 0, "minus_one": -1, "past_the_cache": num_blocks + 3}.get(c["pad_entry"])
    tables = torch.empty(n, width, dtype=torch.int64)
    for b in range(n):
        tables[b] = torch.randint(0, num_blocks, (width,), generator=gen) if pad_value is None else pad_value
        tables[b, : need[b]] = torch.randperm(num_blocks, generator=gen)[: need[b]]
    n_rows = n + c["extra_rows"]
    rows = torch.randperm(n_rows, generator=gen)[:n].contiguous()
    q, _ = rows_of(n_rows, heads, d, c["q_pad"], gen)
    out, out_full = rows_of(n_rows, heads, d, c["out_pad"], gen, fill=SENTINEL)
    return q, out, out_full, k_cache, v_cache, rows, ctx_lens, tables


@settings(max_examples=60, deadline=None)
@given(c=decode_cases())
def test_decode_matches_the_float64_reference(kernel, c):
    q, out, out_full, k_cache, v_cache, rows, ctx_lens, tables = build_case(c)
    scale = c["scale"] or 1 / math.sqrt(c["head_dim"])
    check_against_reference(kernel, q, out, out_full, k_cache, v_cache, rows, ctx_lens, tables, scale=scale,
                            window=c["window"], num_threads=c["num_threads"])


def paged(gen, num_blocks, block_size, kv_heads, head_dim, ctx_lens, magnitude=1.0):
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * magnitude
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    width = max((c + block_size - 1) // block_size for c in ctx_lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in ctx_lens])
    return k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int64)


def test_threads_share_out_sequences_without_changing_a_bit(kernel):
    gen = torch.Generator().manual_seed(1)
    ctx = [1, 8, 9, 40, 77, 128, 3, 64, 100, 17]
    k_cache, v_cache, tables, ctx_lens = paged(gen, 40, 8, 2, 24, ctx)
    q = torch.randn(12, 8, 24, generator=gen)
    rows = torch.randperm(12, generator=gen)[: len(ctx)].contiguous()
    outs = []
    for threads in (1, 2, 4):
        out = torch.full_like(q, SENTINEL)
        kernel.decode(q, out, k_cache, v_cache, rows, ctx_lens, tables, scale=0.2, window=None, num_threads=threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    want = reference(q, k_cache, v_cache, rows, ctx_lens, tables, scale=0.2, window=None)
    for r, w in want.items():
        torch.testing.assert_close(outs[0][r].double(), w, atol=1e-5, rtol=1e-5)


def test_shapes_at_the_kernel_limits(kernel):
    """16 query heads per kv head, head_dim 256, block_size 256: the C stack buffers' full size."""
    gen = torch.Generator().manual_seed(2)
    lim = attention_native
    k_cache, v_cache, tables, ctx_lens = paged(gen, 4, lim.MAX_BLOCK, 1, lim.MAX_HEAD_DIM, [700, 256, 1])
    q = torch.randn(3, lim.MAX_GROUP, lim.MAX_HEAD_DIM, generator=gen)
    for window in (None, 300):
        out = torch.full_like(q, SENTINEL)
        check_against_reference(kernel, q, out, out, k_cache, v_cache, torch.tensor([2, 0, 1]), ctx_lens, tables,
                                scale=1 / 16, window=window, num_threads=2)


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_large_scores_rescale_the_running_softmax(kernel, block_size):
    """q and k ~30x: scores in the hundreds, so the running max jumps between chunks and everything
    accumulated before must be rescaled by exp(old max - new max) (the first chunk's exp(-inf) included)."""
    gen = torch.Generator().manual_seed(block_size)
    heads, kvh, d = 8, 2, 32
    ctx = [1, block_size, 3 * block_size + 1, 150, 97]
    k_cache, v_cache, tables, ctx_lens = paged(gen, 200, block_size, kvh, d, ctx, magnitude=30.0)
    q = torch.randn(len(ctx), heads, d, generator=gen) * 30
    rows = torch.arange(len(ctx))
    for window in (None, 50):
        out = torch.full_like(q, SENTINEL)
        # fp32 scores of ~1e3 are rounded by ~1e-4 (the reference's are exact): a looser tolerance than the
        # property test's, still far below what a missing rescale or a wrong exp costs (O(1)).
        check_against_reference(kernel, q, out, out, k_cache, v_cache, rows, ctx_lens, tables, scale=1 / math.sqrt(d),
                                window=window, num_threads=2, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("direction", ["rising", "falling", "zigzag"])
def test_large_scores_spread_over_several_blocks(kernel, direction):
    """Scores around 900 whose softmax mass spans several blocks: with rising scores the max grows in every
    chunk (each rescales the accumulator), with falling ones it never moves after the first chunk."""
    gen = torch.Generator().manual_seed(3)
    block_size, heads, kvh, d, ctx = 8, 4, 1, 16, 80
    u = torch.nn.functional.normalize(torch.randn(d, generator=gen), dim=0)
    j = torch.arange(ctx, dtype=torch.float64)
    step = {"rising": j, "falling": -j, "zigzag": (j % 2) * 40 + j / 4}[direction]
    scores = 900 + 0.35 * step  # the top ~10-20 keys share the mass
    scale, q_norm = 1 / math.sqrt(d), 30.0
    alpha = (scores / (scale * q_norm)).float()  # k_j = alpha_j u, so scale * q . k_j = scores_j
    k_cache = torch.zeros(ctx // block_size, block_size, kvh, d)
    k_cache.view(ctx, d)[:] = alpha[:, None] * u[None, :]
    v_cache = torch.randn(ctx // block_size, block_size, kvh, d, generator=gen)
    perm = torch.randperm(ctx // block_size, generator=gen)
    k_cache, v_cache = k_cache[perm].contiguous(), v_cache[perm].contiguous()
    tables = torch.argsort(perm)[None, :].contiguous()  # table[i] = where logical block i now lives
    q = (q_norm * u).expand(1, heads, d).contiguous()
    out = torch.full_like(q, SENTINEL)
    check_against_reference(kernel, q, out, out, k_cache, v_cache, torch.tensor([0]), torch.tensor([ctx]), tables,
                            scale=scale, window=None, num_threads=1, atol=2e-4, rtol=2e-4)  # as above
    weights = torch.softmax(scale * (k_cache.view(-1, d).double() @ q[0, 0].double()), 0)
    assert (weights > 0.01).sum() >= 5  # really a spread over many keys, not one-hot


def test_the_kernel_refuses_what_it_would_index_out_of_bounds(kernel):
    gen = torch.Generator().manual_seed(5)
    block_size, num_blocks = 4, 10
    k_cache, v_cache, tables, ctx_lens = paged(gen, num_blocks, block_size, 2, 8, [6, 11])
    tables = torch.cat([tables, torch.zeros(2, 1, dtype=torch.int64)], 1)  # width 4: contexts up to 16
    q = torch.randn(3, 4, 8, generator=gen)
    rows = torch.tensor([2, 0])
    ok = dict(q=q, k_cache=k_cache, v_cache=v_cache, rows=rows, ctx_lens=ctx_lens, tables=tables)

    def refused(match, **kw):
        args = {**ok, **kw}
        out = torch.full((args["q"].shape[0], *args["q"].shape[1:]), SENTINEL)
        with pytest.raises(ValueError, match=match):
            kernel.decode(args["q"], out, args["k_cache"], args["v_cache"], args["rows"], args["ctx_lens"],
                          args["tables"], scale=0.3, window=args.get("window"), num_threads=2)
        assert (out == SENTINEL).all(), "a refused call wrote to out"

    def table_with(b, j, value):
        t = tables.clone()
        t[b, j] = value
        return t

    # The C kernel's checks, through `decode`: every one refuses before anything is written (the first
    # sequence is valid each time, the second is not).
    refused("query row is outside", rows=torch.tensor([2, 3]))
    refused("query row is outside", rows=torch.tensor([2, -1]))
    refused("context length", ctx_lens=torch.tensor([6, 0]))
    refused("context length", ctx_lens=torch.tensor([6, 17]))  # width 4 x block_size 4 = 16
    refused("context length", ctx_lens=torch.tensor([6, -3]))
    refused("block id is outside", tables=table_with(1, 2, -1))  # block 2 holds tokens 8..10 of context 11
    refused("block id is outside", tables=table_with(1, 2, num_blocks))
    refused("block id is outside", tables=table_with(1, 0, num_blocks), window=8)  # tokens 3..10: block 0 read
    refused("head counts", q=torch.randn(3, 3, 8))  # 3 query heads over 2 kv heads
    refused("exceed the kernel's limits", q=torch.randn(3, 34, 8))  # 17 query heads per kv head
    big = torch.zeros(2, 257, 1, 4)
    refused("exceed the kernel's limits", q=torch.randn(3, 1, 4), k_cache=big, v_cache=big,
            tables=torch.zeros(2, 1, dtype=torch.int64))
    wide = torch.zeros(2, 2, 1, 257)
    refused("exceed the kernel's limits", q=torch.randn(3, 1, 257), k_cache=wide, v_cache=wide)

    # The Python-side checks: dtype, layout, matching shapes.
    refused("fp32", q=q.double())
    refused("fp32", q=q.bfloat16())
    refused("packed heads", q=q.transpose(0, 1).contiguous().transpose(0, 1))
    refused("packed heads", q=torch.randn(3, 4, 16)[:, :, ::2])
    refused("contiguous 4-D fp32", k_cache=torch.randn(num_blocks, block_size, 2, 16)[..., :8])
    refused("contiguous 4-D fp32", v_cache=v_cache.transpose(1, 2).contiguous().transpose(1, 2))
    refused("contiguous 4-D fp32", k_cache=k_cache.double())
    refused("do not fit", v_cache=v_cache[:5].contiguous())
    narrow = torch.randn(num_blocks, block_size, 2, 4)
    refused("do not fit", k_cache=narrow, v_cache=narrow)  # head_dim 4 under q's 8
    refused("int64", rows=rows.int())
    refused("int64", tables=tables.t().contiguous().t())
    refused("differ", ctx_lens=torch.tensor([6]))
    refused("differ", tables=tables[:1])
    with pytest.raises(ValueError, match="differ"):
        kernel.decode(q, torch.zeros(2, 4, 8), k_cache, v_cache, rows, ctx_lens, tables, scale=0.3, window=None,
                      num_threads=1)
    # The well-formed call still works after all the refusals.
    out = torch.full_like(q, SENTINEL)
    check_against_reference(kernel, q, out, out, k_cache, v_cache, rows, ctx_lens, tables, scale=0.3, window=None,
                            num_threads=2)
    empty = torch.zeros(0, dtype=torch.int64)
    kernel.decode(q, out, k_cache, v_cache, empty, empty, torch.zeros(0, 4, dtype=torch.int64), scale=0.3,
                  window=None, num_threads=2)  # no sequences: a no-op


def test_supports_only_fp32_and_shapes_within_the_stack_buffers():
    ok = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float32)
    assert NativeAttention.supports(**ok)
    assert NativeAttention.supports(**{**ok, "num_heads": 16, "num_kv_heads": 1, "head_dim": 256, "block_size": 256})
    assert not NativeAttention.supports(**{**ok, "dtype": torch.bfloat16})
    assert not NativeAttention.supports(**{**ok, "dtype": torch.float16})
    assert not NativeAttention.supports(**{**ok, "num_heads": 17, "num_kv_heads": 1})  # 17 per kv head
    assert not NativeAttention.supports(**{**ok, "num_heads": 12, "num_kv_heads": 8})  # not a multiple
    assert not NativeAttention.supports(**{**ok, "head_dim": 257})
    assert not NativeAttention.supports(**{**ok, "block_size": 512})


def test_without_a_compiler_auto_falls_back_to_torch_and_native_refuses(tiny_model, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MPLEX_HOME", str(tmp_path))  # no cached library there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    attention_native.load.cache_clear()
    try:
        with pytest.raises(attention_native.NativeKernelUnavailable, match="no-such-cc"):
            attention_native.load()
        with caplog.at_level(logging.WARNING, logger="mplex.engine"):
            engine = make_engine(tiny_model, lora_kernel="torch")
        assert engine.runner.attention_kernel is None
        warned = [r for r in caplog.records if r.name == "mplex.engine" and r.levelno == logging.WARNING]
        assert any("native CPU attention unavailable" in r.getMessage() and "no-such-cc" in r.getMessage()
                   for r in warned), caplog.text
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert len(run_all(engine, [{"id": "a", "prompt": [5, 9, 13], "params": params}])["a"]) == 4
        with pytest.raises(ConfigError, match="cpu_attention=native"):
            make_engine(tiny_model, lora_kernel="torch", cpu_attention="native")
    finally:
        attention_native.load.cache_clear()
    monkeypatch.undo()
    assert make_engine(tiny_model, lora_kernel="torch").runner.attention_kernel is not None
    assert make_engine(tiny_model, lora_kernel="torch", cpu_attention="native").runner.attention_kernel is not None
    assert make_engine(tiny_model, lora_kernel="torch", cpu_attention="torch").runner.attention_kernel is None


def test_bf16_refuses_native_and_auto_quietly_uses_sdpa(tiny_model, caplog):
    with pytest.raises(ConfigError, match="cpu_attention=native.*fp32"):
        make_engine(tiny_model, dtype="bfloat16", lora_kernel="torch", cpu_attention="native")
    with caplog.at_level(logging.WARNING, logger="mplex.engine"):
        engine = make_engine(tiny_model, dtype="bfloat16", lora_kernel="torch")
    assert engine.runner.attention_kernel is None
    assert "native CPU attention" not in caplog.text
    with pytest.raises(ConfigError, match="cpu_attention must be"):
        make_engine(tiny_model, cpu_attention="fast")


@pytest.fixture(scope="module", params=["llama", "mistral-window"])
def equivalence_model(request, tiny_model, tmp_path_factory):
    if request.param == "llama":
        return tiny_model
    from services.modelkit import build_tiny_random

    return build_tiny_random(tmp_path_factory.mktemp("window") / "m", arch="mistral", seed=4, sliding_window=20,
                             max_position_embeddings=256)


@pytest.mark.parametrize("chunk_rows_max", [model_runner.PREFILL_DECODE_ROWS_MAX, 8])
def test_native_and_torch_attention_give_identical_greedy_tokens(equivalence_model, chunk_rows_max, monkeypatch):
    """The same batch, greedy, through the native decode kernel and through gather + SDPA: prompts of mixed
    lengths (several blocks long), decoding across block boundaries, a small chunked-prefill budget, and
    chunks following prefix-cache hits from a shared prefix computed first. The prompt seed is one where no
    greedy step is a near-tie (top-2 logit gap ~1e-3, the two paths' logits differ by ~1e-6). The native engine
    attends prompt chunks as decode rows up to `chunk_rows_max` tokens, the longer ones through SDPA."""
    from services.engine.config import ModelConfig

    monkeypatch.setattr(model_runner, "PREFILL_DECODE_ROWS_MAX", chunk_rows_max)

    cfg = ModelConfig.from_dir(equivalence_model)
    rng = random.Random(13)

    def tokens(n):
        return [rng.randrange(5, cfg.vocab_size - 5) for _ in range(n)]

    shared = tokens(37)
    prompts = [shared + tokens(n) if i % 3 == 0 else tokens(n)
               for i, n in enumerate([2, 5, 8, 9, 16, 23, 40, 57, 75, 96, 120, 150])]
    warm = shared + tokens(3)
    results = {}
    for attention in ("native", "torch"):
        engine = make_engine(equivalence_model, block_size=8, budget=48, cpu_attention=attention, lora_kernel="torch")
        assert (engine.runner.attention_kernel is not None) == (attention == "native")
        run_all(engine, [{"id": "warm", "prompt": warm, "params": SamplingParams(max_tokens=1, temperature=0)}])
        hits = engine.metrics.prefix_hit_tokens._value.get()
        for i, p in enumerate(prompts):
            params = SamplingParams(max_tokens=17 + 3 * i, temperature=0, ignore_eos=True, logprobs=2)
            engine.add_request(f"p{i}", p, params)
        got = {f"p{i}": ([], [], []) for i in range(len(prompts))}  # tokens, their logprobs, top-2 gaps
        while engine.has_unfinished():
            for o in engine.step():
                assert o.error is None, o.error
                tok, lps, gaps = got[o.request_id]
                tok += o.new_token_ids
                for lp in o.logprobs or []:
                    lps.append(lp.logprob)
                    top = sorted((x[1] for x in lp.top), reverse=True)
                    gaps.append(top[0] - top[1])
            engine.check_integrity()
        assert engine.metrics.prefix_hit_tokens._value.get() - hits >= 4 * 32  # the shared prefix's 4 full blocks
        assert all(len(tok) == len(lps) == 17 + 3 * i for i, (tok, lps, _) in enumerate(got.values()))
        results[attention] = got
    assert min(g for _, _, gaps in results["torch"].values() for g in gaps) > 1e-4  # no near-tie to flip
    for rid, (tok, lps, _) in results["native"].items():
        want_tok, want_lps, _ = results["torch"][rid]
        assert tok == want_tok, rid
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=2e-5, rtol=0, msg=rid)


def test_split_into_decode_rows_gives_each_chunk_row_its_own_context():
    """Sequences (first row, rows, context after the step, table): the split ones become one-row sequences whose
    row j sees the context up to its own position; the others pass unchanged, in order."""
    offsets = torch.tensor([0, 5, 6, 9, 12])
    lens = torch.tensor([5, 1, 3, 3, 1])
    ctx = torch.tensor([5, 40, 20, 3, 7])
    tables = torch.arange(10).view(5, 2)
    split = torch.tensor([True, False, True, False, True])
    o, n, c, t = split_into_decode_rows(offsets, lens, ctx, tables, split)
    want = ([(0 + j, 1, 1 + j, 0) for j in range(5)] + [(5, 1, 40, 1)] + [(6 + j, 1, 18 + j, 2) for j in range(3)]
            + [(9, 3, 3, 3), (12, 1, 7, 4)])
    assert list(zip(o.tolist(), n.tolist(), c.tolist(), (t[:, 0] // 2).tolist())) == want
    assert torch.equal(t, tables[[r[3] for r in want]])
    same = split_into_decode_rows(offsets, lens, ctx, tables, torch.zeros(5, dtype=torch.bool))
    assert all(a is b for a, b in zip(same, (offsets, lens, ctx, tables)))


def test_the_runner_sends_chunks_up_to_the_limit_to_the_decode_kernel(equivalence_model, monkeypatch):
    """With the native kernel, a prompt chunk of up to PREFILL_DECODE_ROWS_MAX tokens is attended as decode rows
    (in the step's one DecodeGroup); a longer one in a padded SDPA group; the torch path keeps every chunk in SDPA."""
    monkeypatch.setattr(model_runner, "PREFILL_DECODE_ROWS_MAX", 20)
    seen = {}
    for attention in ("native", "torch"):
        engine = make_engine(equivalence_model, block_size=8, budget=256, cpu_attention=attention, lora_kernel="torch")
        prepare = engine.runner.prepare

        def spy(plan, *args, _prepare=prepare, _name=attention, **kw):
            inputs = _prepare(plan, *args, **kw)
            seen.setdefault(_name, []).append(inputs.attn.groups)
            return inputs

        monkeypatch.setattr(engine.runner, "prepare", spy)
        rng = random.Random(3)
        run_all(engine, [{"id": f"p{n}", "prompt": [rng.randrange(5, 200) for _ in range(n)],
                          "params": SamplingParams(max_tokens=1, temperature=0)} for n in (12, 20, 21, 50)])
    first = seen["native"][0]
    decode = [g for g in first if isinstance(g, DecodeGroup)]
    padded = [g for g in first if isinstance(g, AttnGroup)]
    assert len(decode) == 1 and decode[0].num_seqs == 12 + 20  # one row each for the 12- and 20-token chunks
    assert sorted(decode[0].context_lens.tolist()) == sorted(list(range(1, 13)) + list(range(1, 21)))
    assert sum(int(g.valid.any(1).sum()) for g in padded) == 2  # the 21- and 50-token chunks
    assert not any(isinstance(g, DecodeGroup) for g in seen["torch"][0])


def _rectangle(sel, lens, ctx, block_size):
    return sel.numel() * int(lens[sel].max()) * int(((ctx[sel] + block_size - 1) // block_size).max())


def _check_partition(buckets, lens, ctx, block_size, max_buckets):
    prefill = sorted((lens > 1).nonzero().squeeze(1).tolist())
    named = sorted(i for b in buckets for i in b.tolist())
    assert named == prefill  # every prefill row in exactly one bucket, no decode row
    assert len(buckets) <= max_buckets and all(b.numel() for b in buckets)
    if prefill:
        whole = _rectangle(torch.tensor(prefill), lens, ctx, block_size)
        assert sum(_rectangle(b, lens, ctx, block_size) for b in buckets) <= whole


def test_prefill_buckets_cut_the_padded_rectangle():
    bs = 16
    lens = torch.tensor([337, 1, 16, 80, 1, 275, 246, 16, 1, 14, 40])
    ctx = lens + torch.tensor([0, 500, 0, 0, 37, 0, 0, 0, 3, 0, 0])  # fresh prompts; decode rows with long contexts
    buckets = _prefill_buckets(lens, ctx, bs)
    _check_partition(buckets, lens, ctx, bs, 4)
    prefill = (lens > 1).nonzero().squeeze(1)
    cut = sum(_rectangle(b, lens, ctx, bs) for b in buckets)
    assert cut < 0.5 * _rectangle(prefill, lens, ctx, bs)
    # Chunks after cached prefixes (context far beyond the chunk) are split the same way.
    ctx2 = lens + torch.tensor([0, 500, 320, 0, 37, 0, 0, 200, 3, 100, 60])
    buckets = _prefill_buckets(lens, ctx2, bs)
    _check_partition(buckets, lens, ctx2, bs, 4)
    assert sum(_rectangle(b, lens, ctx2, bs) for b in buckets) < 0.5 * _rectangle(prefill, lens, ctx2, bs)
    assert len(_prefill_buckets(lens, ctx, bs, max_buckets=2)) <= 2
    # One prefill row: one bucket; none: no bucket.
    one = _prefill_buckets(torch.tensor([1, 30, 1]), torch.tensor([9, 30, 70]), bs)
    assert [b.tolist() for b in one] == [[1]]
    assert _prefill_buckets(torch.tensor([1, 1, 1]), torch.tensor([5, 17, 90]), bs) == []
    assert _prefill_buckets(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), bs) == []
    # Equal chunks and contexts: nothing to gain from a cut.
    assert len(_prefill_buckets(torch.tensor([64] * 6), torch.tensor([64] * 6), bs)) == 1


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.one_of(st.just(1), st.integers(2, 400)), st.integers(0, 400)), max_size=14),
    block_size=st.sampled_from([1, 4, 16]),
    max_buckets=st.integers(1, 4),
)
def test_buckets_partition_the_rows(rows, block_size, max_buckets):
    lens = torch.tensor([q for q, _ in rows], dtype=torch.int64)
    ctx = lens + torch.tensor([c for _, c in rows], dtype=torch.int64)
    _check_partition(_prefill_buckets(lens, ctx, block_size, max_buckets), lens, ctx, block_size, max_buckets)
    # The torch path's buckets: the prefill buckets plus the decode rows, each row exactly once.
    every = sorted(i for b in _attention_buckets(lens, ctx, block_size, max_buckets) for i in b.tolist())
    assert every == list(range(len(rows)))


# -- fp8 caches (kernels/kv_fp8.py): e4m3 bytes with a scale per (block, kv head), decoded in registers --------


def fp8_cache(gen, shape, exp_range=(-12, -3)):
    """Random bytes (every code, stale ones included, decodes to a finite value) and power-of-two scales."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    scales = torch.ldexp(torch.ones(shape[0], shape[2]), torch.randint(*exp_range, (shape[0], shape[2]), generator=gen))
    return codes, scales


def fp8_reference(q, k_cache, v_cache, k_scales, v_scales, rows, ctx_lens, tables, *, scale, window):
    from services.engine.kernels.decode_attention_ref import paged_decode_attention_ref

    return paged_decode_attention_ref(q, k_cache, v_cache, rows, ctx_lens, tables, scale=scale, window=window,
                                      k_scales=k_scales, v_scales=v_scales)


@settings(max_examples=60, deadline=None)
@given(c=decode_cases())
def test_fp8_decode_matches_the_float64_reference(kernel, c):
    q, out, out_full, k32, _, rows, ctx_lens, tables = build_case(c)
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    k_cache, k_scales = fp8_cache(gen, k32.shape)
    v_cache, v_scales = fp8_cache(gen, k32.shape)
    scale = c["scale"] or 1 / math.sqrt(c["head_dim"])
    before = out_full.clone()
    kernel.decode(q, out, k_cache, v_cache, rows, ctx_lens, tables, scale=scale, window=c["window"],
                  num_threads=c["num_threads"], k_scales=k_scales, v_scales=v_scales)
    want = fp8_reference(q, k_cache, v_cache, k_scales, v_scales, rows, ctx_lens, tables, scale=scale, window=c["window"])
    # fp32's own error: a logit s carries ~2^-24 |s| of rounding, which the softmax turns into that relative
    # error on a weight, so on the output up to 2^-24 |s|max |v|max. Decoded fp8 values run to 448 x scale,
    # logits to hundreds: a kernel exact to fp32 misses by ~3e-5 there (hypothesis found 5.1e-5 against a flat
    # 1e-5), while a wrong block, position or scale misses by the size of a value.
    from services.engine.kernels.kv_fp8 import dequantize

    logit_max = scale * float(q[rows].abs().sum(-1).max()) * float(dequantize(k_cache, k_scales).abs().max())
    atol = 1e-5 + 2**-24 * logit_max * float(dequantize(v_cache, v_scales).abs().max())
    for r, w in want.items():
        torch.testing.assert_close(out[r].double(), w, atol=atol, rtol=1e-5, msg=lambda m: f"row {r}: {m}")
    written = torch.zeros_like(out_full, dtype=torch.bool)
    written.as_strided(out.shape, out.stride(), out.storage_offset())[list(want)] = True
    assert torch.equal(out_full[~written], before[~written]), "the kernel wrote outside the rows it was given"


def test_fp8_decode_reads_what_the_writer_wrote(kernel):
    """End to end on the scheme: K/V written token by token through the native writer, then attended; the
    result is attention over the dequantized cache, and within fp8's error of attention over the fp32 rows."""
    from services.engine.kernels.kv_fp8 import dequantize

    gen = torch.Generator().manual_seed(11)
    block_size, kvh, group, d, ctx = 8, 2, 4, 24, 45
    k_cache = torch.zeros(8, block_size, kvh, d, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k_scales, v_scales = torch.zeros(8, kvh), torch.zeros(8, kvh)
    keys, values = torch.randn(ctx, kvh, d, generator=gen), torch.randn(ctx, kvh, d, generator=gen)
    table = torch.tensor([[5, 2, 7, 0, 3, 1]])
    slots = table[0, torch.arange(ctx) // block_size] * block_size + torch.arange(ctx) % block_size
    for t in range(ctx):
        kernel.write_fp8(k_cache, k_scales, v_cache, v_scales, keys[t : t + 1], values[t : t + 1], slots[t : t + 1],
                         num_threads=1)
    q = torch.randn(1, kvh * group, d, generator=gen)
    out = torch.zeros_like(q)
    args = (torch.tensor([0]), torch.tensor([ctx]), table)
    kernel.decode(q, out, k_cache, v_cache, *args, scale=0.2, window=None, num_threads=2, k_scales=k_scales,
                  v_scales=v_scales)
    want = fp8_reference(q, k_cache, v_cache, k_scales, v_scales, *args, scale=0.2, window=None)[0]
    torch.testing.assert_close(out[0].double(), want, atol=1e-5, rtol=1e-5)
    dense_k, dense_v = dequantize(k_cache, k_scales), dequantize(v_cache, v_scales)
    assert ((dense_k.view(-1, kvh, d)[slots] - keys).abs() <= keys.abs().amax() * 2**-8 + keys.abs() * 2**-4).all()
    # Against attention over the fp32 rows themselves (one block of ctx tokens): fp8's few % per element,
    # averaged by attention.
    exact = reference(q, keys[None], values[None], torch.tensor([0]), torch.tensor([ctx]), torch.tensor([[0]]),
                      scale=0.2, window=None)[0]
    assert (out[0].double() - exact).abs().max() < 0.06  # measured 0.03 here


def test_fp8_decode_refuses_missing_or_misshapen_scales(kernel):
    gen = torch.Generator().manual_seed(12)
    k_cache, k_scales = fp8_cache(gen, (6, 4, 2, 8))
    v_cache, v_scales = fp8_cache(gen, (6, 4, 2, 8))
    q = torch.randn(2, 4, 8)
    ok = dict(k_cache=k_cache, v_cache=v_cache, k_scales=k_scales, v_scales=v_scales)
    args = (torch.tensor([0, 1]), torch.tensor([3, 9]), torch.tensor([[0, 1, 2], [3, 4, 5]]))

    def refused(match, **kw):
        a = {**ok, **kw}
        with pytest.raises(ValueError, match=match):
            kernel.decode(q, torch.zeros_like(q), a["k_cache"], a["v_cache"], *args, scale=0.3, window=None,
                          num_threads=1, k_scales=a["k_scales"], v_scales=a["v_scales"])

    refused("k_scales must be", k_scales=None)
    refused("v_scales must be", v_scales=v_scales[:5])
    refused("k_scales must be", k_scales=k_scales.double())
    refused("k_scales must be", k_scales=k_scales.t().contiguous().t())
    refused("differ in dtype", v_cache=torch.randn(6, 4, 2, 8))
    refused("scales are for an fp8 cache", k_cache=torch.randn(6, 4, 2, 8), v_cache=torch.randn(6, 4, 2, 8))
    # Scales for 6 blocks beside a cache of 4: one scale per block of the cache, or nothing is read.
    refused("k_scales must be", k_cache=k_cache[:4].contiguous(), v_cache=v_cache[:4].contiguous())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="F16C is an x86 extension")
def test_fp8_decode_without_f16c_uses_the_portable_decoder():
    """Where the compiler targets no F16C, fp8 bytes are decoded by integer bit moves instead of the fp16
    conversion instruction: the same values, so the same results."""
    from services.engine.kernels.native_build import FLAGS, library

    portable = NativeAttention(library(attention_native.SOURCE, "attention-no-f16c", FLAGS + ("-mno-f16c",)))
    gen = torch.Generator().manual_seed(21)
    block_size, kvh, group, d = 8, 2, 3, 13  # 13: eight-lane and scalar decoding
    k_cache, k_scales = fp8_cache(gen, (10, block_size, kvh, d))
    v_cache, v_scales = fp8_cache(gen, (10, block_size, kvh, d))
    q = torch.randn(3, kvh * group, d, generator=gen)
    args = (torch.tensor([2, 0, 1]), torch.tensor([1, 17, 40]), torch.randint(0, 10, (3, 5), generator=gen))
    want = fp8_reference(q, k_cache, v_cache, k_scales, v_scales, *args, scale=0.3, window=None)
    for kernel in (portable, attention_native.load()):
        out = torch.zeros_like(q)
        kernel.decode(q, out, k_cache, v_cache, *args, scale=0.3, window=None, num_threads=1, k_scales=k_scales,
                      v_scales=v_scales)
        for r, w in want.items():
            torch.testing.assert_close(out[r].double(), w, atol=1e-5, rtol=1e-5)
