"""Sampler: greedy, filters, seeded reproducibility independent of batch mates, logprobs, bans."""
import json

import torch

from services.engine.sampler import LOGPROB_FLOOR, SamplingBatch, sample, uniform_from


def make_batch(n, temperature=1.0, top_p=1.0, top_k=0, seeds=None, counters=None, **kw) -> SamplingBatch:
    t = torch.full((n,), float(temperature))
    return SamplingBatch(
        temperature=t,
        top_p=torch.full((n,), float(top_p)),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        seeds=torch.tensor(seeds if seeds is not None else list(range(n)), dtype=torch.int64),
        counters=torch.tensor(counters if counters is not None else [0] * n, dtype=torch.int64),
        all_greedy=temperature == 0,
        any_filter=top_k > 0 or top_p < 1,
        **kw,
    )


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = sample(logits, make_batch(5, temperature=0))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, 40)
    assert sample(logits, make_batch(6, top_k=1)).token_ids == logits.argmax(-1).tolist()
    assert sample(logits, make_batch(6, top_p=1e-6)).token_ids == logits.argmax(-1).tolist()


def test_a_seeded_row_samples_the_same_token_whatever_its_batch_mates():
    torch.manual_seed(0)
    row = torch.randn(1, 100)
    alone = sample(row, make_batch(1, seeds=[1234], counters=[5])).token_ids[0]
    mates = torch.randn(16, 100)
    mates[9] = row[0]
    seeds = list(range(16))
    seeds[9] = 1234
    counters = [3] * 16
    counters[9] = 5
    batched = sample(mates, make_batch(16, seeds=seeds, counters=counters)).token_ids[9]
    assert alone == batched


def test_uniforms_are_deterministic_distinct_and_in_open_interval():
    seeds = torch.tensor([0, 0, 1, -5, 2**62], dtype=torch.int64)
    counters = torch.tensor([0, 1, 0, 0, 7], dtype=torch.int64)
    u1, u2 = uniform_from(seeds, counters), uniform_from(seeds, counters)
    assert torch.equal(u1, u2)
    assert len(set(u1.tolist())) == 5
    assert bool(((u1 > 0) & (u1 < 1)).all())


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    out = sample(logits, make_batch(4000, seeds=list(range(4000))))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_top_k_and_top_p_never_pick_filtered_tokens():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().repeat(2000, 1)
    k2 = sample(logits, make_batch(2000, top_k=2, seeds=list(range(2000)))).token_ids
    assert set(k2) == {0, 1}
    p = sample(logits, make_batch(2000, top_p=0.65, seeds=list(range(2000)))).token_ids
    assert set(p) == {0, 1}  # 0.4 + 0.3 reaches 0.65; token 2 is outside the nucleus


def test_temperature_sharpens():
    probs = torch.tensor([0.6, 0.4])
    logits = probs.log().repeat(3000, 1)
    cold = sample(logits, make_batch(3000, temperature=0.2, seeds=list(range(3000)))).token_ids
    assert sum(t == 0 for t in cold) / 3000 > 0.85


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = torch.randn(3, 30)
    out = sample(logits, make_batch(3, temperature=0, num_logprobs=4))
    ref = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out.token_ids):
        assert abs(out.logprobs[i] - ref[i, tok].item()) < 1e-6
        assert out.top_ids[i] == ref[i].topk(4).indices.tolist()


def test_impossible_tokens_are_reported_at_the_floor_so_any_response_encodes():
    """More alternatives asked than a row has possible tokens (a banned token here; a grammar mask the same):
    the impossible ones are reported at LOGPROB_FLOOR, not -inf, which JSON cannot encode (`make fuzz` found
    an engine 500 on json_object + top_logprobs)."""
    logits = torch.zeros(2, 3)
    batch = make_batch(2, temperature=0, num_logprobs=3, banned_rows=torch.tensor([0, 0]),
                       banned_cols=torch.tensor([0, 1]))
    out = sample(logits, batch)
    assert out.token_ids[0] == 2 and out.logprobs[0] == 0.0
    assert out.top_ids[0][0] == 2 and sorted(out.top_logprobs[0][1:]) == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    json.dumps({"logprobs": out.logprobs, "top": out.top_logprobs}, allow_nan=False)  # encodes


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(2, 5)
    logits[:, 3] = 10.0
    batch = make_batch(2, temperature=0, banned_rows=torch.tensor([0]), banned_cols=torch.tensor([3]))
    out = sample(logits, batch)
    assert out.token_ids[0] != 3 and out.token_ids[1] == 3


def test_grammar_mask_sets_exactly_the_disallowed_tokens_of_the_guided_rows_to_minus_inf():
    """Every row constrained (the one-op path) and some rows constrained (gather, mask, scatter): the result
    is the logits with each guided row's disallowed tokens at -inf, other rows and the input untouched."""
    from services.engine.sampler import apply_bitmask

    g = torch.Generator().manual_seed(0)
    vocab, rows = 70, 6  # 70: the last bitmask word is partly past the vocabulary
    logits = torch.randn(rows, vocab, generator=g)
    before = logits.clone()
    for guided in ([0, 1, 2, 3, 4, 5], [1, 4], [5]):
        bits = torch.randint(-2**31, 2**31 - 1, (len(guided), 3), dtype=torch.int32, generator=g)
        out = apply_bitmask(logits, torch.tensor(guided), bits)
        want = before.clone()
        for i, r in enumerate(guided):
            for t in range(vocab):
                if not (int(bits[i, t // 32]) >> (t % 32)) & 1:
                    want[r, t] = float("-inf")
        assert torch.equal(out, want) and torch.equal(logits, before)
        masked = out.isinf().any(-1).nonzero().flatten().tolist()
        assert set(masked) <= set(guided)
