"""Verifying drafts in the forward that computes them: which rows are sampled, and how much is accepted.

A sequence with a k-token draft d_1..d_k computes k + 1 query rows in the step (its last token, then the
draft), and all k + 1 rows are sampled, the j-th with the counter of output position n + j, exactly as
plain decoding would sample that position (same seed, same temperature / top-k / top-p / min_tokens
treatment). The draft is accepted up to the first position whose sampled token differs from it; the
step emits the accepted tokens and the token sampled at the first mismatch (or after the whole draft).

Why this is exact: a drafter's proposal is a point mass q = 1{d}. Standard speculative rejection
sampling accepts d with probability min(1, p(d)/q(d)) = p(d) and on rejection samples the residual
max(0, p - q) / Z = p restricted to tokens other than d. Sampling x ~ p and accepting iff x == d has the
same law (P[accept] = p(d); given a rejection, x ~ p(. | x != d)) -- and because x is drawn with the
per-request counter-based uniform the non-speculative path would use for that position, every emitted
token is the very token plain decoding would have produced: greedy and seeded outputs are identical
with and without speculation, not just equal in distribution.
"""
from __future__ import annotations

import torch


def sample_rows(ends: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of the flattened batch to sample: the last `counts[i]` rows before `ends[i]` for each sequence
    (0 for a prefill chunk that does not finish its prompt, 1 for a decode, k + 1 for a k-token draft)."""
    # A list, not repeat_interleave: a few hundred small ints, where a torch op's fixed cost dominates.
    return torch.tensor([e - c + j for e, c in zip(ends.tolist(), counts.tolist()) for j in range(c)],
                        dtype=torch.int64)


def accepted_lengths(sampled: list[int], drafts: list[tuple[int, ...]]) -> list[int]:
    """For each sequence (its k + 1 sampled tokens consecutive in `sampled`, in order), the number of
    leading draft tokens equal to the sampled ones. One batched comparison over the padded drafts."""
    if not drafts:
        return []
    k = max(len(d) for d in drafts)
    if k == 0:
        return [0] * len(drafts)
    n = len(drafts)
    lens = torch.tensor([len(d) for d in drafts])
    padded = torch.full((n, k), -1, dtype=torch.int64)
    got = torch.full((n, k), -2, dtype=torch.int64)
    starts = torch.cumsum(lens + 1, 0) - (lens + 1)
    mask = torch.arange(k)[None, :] < lens[:, None]
    padded[mask] = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    flat = torch.tensor(sampled, dtype=torch.int64)
    got[mask] = flat[(starts[:, None] + torch.arange(k)[None, :])[mask]]
    return torch.cumprod((padded == got).to(torch.int64), dim=1).sum(1).tolist()
