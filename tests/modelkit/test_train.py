"""The kit's training batches: packed rows must compute exactly what one example per row would."""
from __future__ import annotations

import random

import pytest
import torch

from services.modelkit.train import Encoded, batch_loss, collate

PAD = 0


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from services.modelkit import build_tiny_random

    path = build_tiny_random(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _examples(n: int, seed: int, vocab: int) -> list[Encoded]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, answer = rng.randint(3, 20), rng.randint(1, 8)
        out.append(Encoded([rng.randrange(1, vocab) for _ in range(prompt + answer)], prompt))
    return out


def test_rows_hold_several_examples_and_every_answer_token_once():
    batch = _examples(48, seed=1, vocab=100)
    b = collate(batch, PAD)
    assert b.ids.shape[0] < len(batch)  # packing happened
    assert b.ids.shape[1] == max(len(e.ids) for e in batch)
    # Every example's answer tokens (and its end token) are targets exactly once, in order.
    assert int(b.loss_mask.sum()) == sum(len(e.ids) - e.prompt_len for e in batch)
    assert sorted(b.targets[b.loss_mask].tolist()) == sorted(t for e in batch for t in e.ids[e.prompt_len :])
    # Each example sits in its row intact, with positions restarting at 0.
    found = 0
    for row_ids, row_pos in zip(b.ids.tolist(), b.positions.tolist()):
        starts = [i for i, p in enumerate(row_pos) if p == 0]
        for s in starts:
            e = next(e for e in batch if row_ids[s : s + len(e.ids)] == e.ids)
            assert row_pos[s : s + len(e.ids)] == list(range(len(e.ids)))
            found += 1
    assert found == len(batch)


def test_packed_loss_equals_one_example_at_a_time(tiny_lm):
    """If examples could see each other inside a row (or the pads leaked in), the loss would differ."""
    vocab = tiny_lm.config.vocab_size
    batch = _examples(24, seed=2, vocab=vocab)
    b = collate(batch, PAD)
    assert (b.positions[:, 1:] == 0).any()  # some row holds more than one example
    with torch.no_grad():
        packed = batch_loss(tiny_lm, b)
        total, count = 0.0, 0
        for e in batch:
            ids = torch.tensor([e.ids])
            logits = tiny_lm(input_ids=ids, use_cache=False).logits[0]
            answer = slice(e.prompt_len - 1, len(e.ids) - 1)
            total += torch.nn.functional.cross_entropy(logits[answer], ids[0, answer.start + 1 : answer.stop + 1],
                                                       reduction="sum").item()
            count += answer.stop - answer.start
    assert packed.item() == pytest.approx(total / count, rel=1e-5)


def test_gradients_match_one_example_at_a_time(tiny_lm):
    batch = _examples(12, seed=4, vocab=tiny_lm.config.vocab_size)
    params = [p for n, p in tiny_lm.named_parameters() if "layers.0.self_attn.q_proj" in n]
    tiny_lm.zero_grad()
    batch_loss(tiny_lm, collate(batch, PAD)).backward()
    packed = [p.grad.clone() for p in params]
    tiny_lm.zero_grad()
    n_answer = sum(len(e.ids) - e.prompt_len for e in batch)
    for e in batch:  # the batch loss is a mean over answer tokens: weight each example by its share
        share = (len(e.ids) - e.prompt_len) / n_answer
        (batch_loss(tiny_lm, collate([e], PAD)) * share).backward()
    for g, p in zip(packed, params):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    tiny_lm.zero_grad()
