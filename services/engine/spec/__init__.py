"""Speculative decoding: drafters propose tokens, the target model verifies them in the ordinary step.

drafter.py (what to guess), controller.py (how much, per sequence and per load), verify.py (which rows are
sampled and how much of a draft is accepted -- and why that is exact). The scheduler fits drafts into the
step (budget, KV blocks), the runner computes them as extra query rows, the engine emits what was accepted
and rolls the KV of the rest back (kv.manager.truncate).
"""
