"""The quality gate's checks, as plain functions and on the trained demo kit's base model (served in FP8, as
engines serve it): without a task eval set, a harmless adapter passes the no-regression check and one that
damages what the base does well is refused — subtly (fluent but worse answers), by wrecking its output, or
by breaking its numerics (flat logits) — with every check and its measured value in `reasons`; the demo
kit's own adapters, which overwrite the base's behaviour by design, pass on their tasks' sets."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.adapters.checks import MARGIN, NO_REGRESSION, Thresholds, decide, regression
from services.adapters.config import GateDefaults
from services.adapters.evalset import DEFAULT_EVAL_SET, read_eval_file
from services.adapters.gate import GateError, GateRunner
from services.adapters.scoring import malformation, trailing_loop
from services.common.lora_format import content_id

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHECKS = ["no_regression", "well_formed", "logits", "fp8_agreement"]


# -- plain functions ---------------------------------------------------------------------------------------------
def test_the_regression_bound_counts_ties_as_evidence_of_no_change():
    same = regression([1.0] * 200, [1.0] * 200, confidence=0.95)
    assert (same.mean_drop, same.upper_bound, same.tied, same.worse, same.better) == (0.0, 0.0, 200, 0, 0)
    # Two flips each way (near-ties in the base's logits): no drop on average, a bound far under 0.05.
    flips = regression([0.0, 0.0, 1.0, 1.0] + [1.0] * 196, [1.0, 1.0, 0.0, 0.0] + [1.0] * 196, confidence=0.95)
    assert flips.mean_drop == 0.0 and 0 < flips.upper_bound < 0.02 and (flips.worse, flips.better) == (2, 2)
    # One answer in ten lost: a drop of 0.1, and the bound above it.
    lost = regression([0.0] * 20 + [1.0] * 180, [1.0] * 200, confidence=0.95)
    assert lost.mean_drop == pytest.approx(0.1) and lost.upper_bound > 0.1
    # The same drop measured on fewer items is less certain.
    assert regression([0.0] * 2 + [1.0] * 18, [1.0] * 20, confidence=0.95).upper_bound > lost.upper_bound


def test_malformed_outputs():
    assert malformation("", [], "Paris") == "empty"
    assert malformation("", [], "") is None  # asked for nothing
    assert malformation("caf\ufffd", [1, 2], "café") == "undecodable"
    assert malformation("the " * 16, [7] * 16, "the end") == "repetition"
    assert trailing_loop([1, 2, 3] + [4, 5] * 8) == 16 and trailing_loop([4, 5] * 4) == 0  # too short to call a loop
    assert malformation("10 16 16 16", [3, 9, 9, 9], "10 16") is None


def _metrics(check: str, **over) -> dict:
    m = {"check": check, "adapter": {"rouge_l": 0.9}, "base": {"rouge_l": 0.9}, "n_examples": 200,
         "regression": regression([0.9] * 200, [0.9] * 200, confidence=0.95).as_dict(),
         "malformed": {"count": 0, "rate": 0.0, "empty": 0, "undecodable": 0, "repetition": 0},
         "degenerate_logits": {"tokens": 0, "outputs": 0, "checked": 900},
         "fp8_token_agreement": 0.99, "served_weight_dtype": "fp8"}
    return {**m, **over}


def test_decide_reports_every_check_with_its_value_and_threshold():
    t = Thresholds.from_config(None, GateDefaults())
    passed, reasons = decide(_metrics(NO_REGRESSION), t)
    assert passed and [r["check"] for r in reasons] == CHECKS and all(r["passed"] for r in reasons)
    assert [r["code"] for r in reasons] == ["no_regression_ok", "well_formed_ok", "logits_ok", "fp8_agreement_ok"]
    assert reasons[0]["value"] == 0.0 and reasons[0]["threshold"] == 0.05 and "200 unchanged" in reasons[0]["message"]
    # With a task set, the margin check replaces no-regression: the same adapter no better than the base fails.
    passed, reasons = decide(_metrics(MARGIN), t)
    assert not passed and [r["code"] for r in reasons][0] == "margin_below_threshold"
    assert [r["passed"] for r in reasons] == [False, True, True, True]
    # Served in full precision, FP8 parity does not apply (and says so).
    _, reasons = decide(_metrics(NO_REGRESSION, served_weight_dtype="auto", fp8_token_agreement=1.0), t)
    assert reasons[-1]["passed"] and "not applicable" in reasons[-1]["message"]
    # A version stored before the no-regression thresholds existed gets the defaults.
    old = Thresholds.from_config({"metric": "rouge_l", "min_margin": 0.1, "min_fp8_agreement": 0.9}, GateDefaults())
    assert (old.min_margin, old.max_regression, old.max_malformed_rate) == (0.1, 0.05, 0.02)


def test_the_bundled_base_capability_set_is_the_modelkits():
    """services/adapters/data/default_eval.jsonl is generated (python -m services.modelkit.capability): 200 items
    of what the demo base was trained to do, the list tasks' prompts held out of its training data."""
    from services.modelkit import corpus
    from services.modelkit.capability import as_jsonl, base_capability_set

    examples = base_capability_set()
    assert DEFAULT_EVAL_SET.read_text(encoding="utf-8") == as_jsonl(examples)
    assert len(examples) == 200 and len({e.prompt for e in examples}) == 200
    held = {e.prompt for e in corpus.base_eval_set(0)}
    assert not held & {e.prompt for e in examples if e.task in ("repeat", "count")}


# -- on the demo kit ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gate(demo_kit) -> Iterator[GateRunner]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores spin against other processes: 5x slower here
    yield GateRunner(Path(demo_kit.base_dir), serve_weight_dtype="fp8")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base_items():
    return read_eval_file(DEFAULT_EVAL_SET)


def judge(gate: GateRunner, adapter_dir: Path, items, check: str = NO_REGRESSION):
    t = Thresholds.from_config(None, GateDefaults())
    return gate.run(adapter_dir, content_id(adapter_dir), items, t, check=check, max_new_tokens=48, latency_samples=0,
                    min_items=100 if check == NO_REGRESSION else 1)


def random_adapter(demo_kit, out: Path, scale: float) -> Path:
    from services.modelkit import make_random_adapter

    return make_random_adapter(demo_kit.base_dir, out, rank=16, seed=1234, init_scale=scale, target_modules=ALL_MODULES)


def flat_logits_adapter(demo_kit, out: Path) -> Path:
    """Finite weights (validation accepts them) so large that layer 1's MLP output overflows: the hidden state
    collapses and every logit is the same."""
    from services.modelkit import make_random_adapter

    path = make_random_adapter(demo_kit.base_dir, out, rank=4, seed=1, target_modules=("q_proj", "down_proj"), layers=[1])
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: torch.full_like(v, 1e18) if "down_proj" in k else v for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def codes(result) -> dict[str, bool]:
    return {r["code"]: r["passed"] for r in result.reasons}


def test_a_harmless_random_adapter_passes_without_an_eval_set(gate, base_items, demo_kit, tmp_path):
    """Small random LoRA weights (x0.02 of the modelkit's visible-change scale): near-zero effect."""
    result = judge(gate, random_adapter(demo_kit, tmp_path / "harmless", 0.02), base_items)
    assert result.passed, result.reasons
    assert codes(result) == {"no_regression_ok": True, "well_formed_ok": True, "logits_ok": True, "fp8_agreement_ok": True}
    m = result.metrics
    assert m["check"] == NO_REGRESSION and m["n_examples"] == 200 and m["base"]["rouge_l"] > 0.8  # the base does well
    assert m["regression"]["upper_bound"] < 0.02 and m["regression"]["tied"] >= 190
    assert m["malformed"]["count"] == 0 and m["degenerate_logits"]["tokens"] == 0 and m["fp8_token_agreement"] > 0.95


def test_an_adapter_that_makes_the_base_subtly_worse_is_refused(gate, base_items, demo_kit, tmp_path):
    """Random weights near the modelkit's visible-change scale: fluent output (malformed under the 2% allowed),
    but a fifth of the answers change and most of those get worse — only the no-regression check can see it."""
    # x0.85: on the stop-33 kit x1.0 already leaves 3% of the answers undecodable (the tools-taught base's
    # tokenizer splits more words into byte pieces), which the well-formedness check then sees too.
    result = judge(gate, random_adapter(demo_kit, tmp_path / "subtle", 0.85), base_items)
    assert not result.passed
    c = codes(result)
    assert c["regression_over_tolerance"] is False and c["well_formed_ok"] and c["logits_ok"]
    r = result.metrics["regression"]
    assert r["mean_drop"] > 0.05 and r["worse"] > 3 * r["better"]
    assert "damages what the base model does well" in result.failures[0]["message"]


def test_an_adapter_that_wrecks_the_output_is_refused(gate, base_items, demo_kit, tmp_path):
    result = judge(gate, random_adapter(demo_kit, tmp_path / "wreck", 3.0), base_items)
    c = codes(result)
    assert not result.passed and c["regression_over_tolerance"] is False and c["malformed_outputs"] is False
    # Far past both tolerances: more than half the quality gone, malformed answers at 5x the 2% allowed.
    assert result.metrics["regression"]["mean_drop"] > 0.5 and result.metrics["malformed"]["rate"] > 0.1


def test_an_adapter_that_breaks_the_numerics_is_refused(gate, base_items, demo_kit, tmp_path):
    result = judge(gate, flat_logits_adapter(demo_kit, tmp_path / "flat"), base_items)
    c = codes(result)
    assert not result.passed and c["degenerate_logits"] is False and c["malformed_outputs"] is False
    d = result.metrics["degenerate_logits"]
    assert d["tokens"] == d["checked"] > 0 and d["outputs"] == 200
    assert result.metrics["malformed"]["empty"] == 200


def test_the_demo_adapters_pass_on_their_tasks_and_overwrite_the_base_elsewhere(gate, base_items, demo_kit):
    """Each demo adapter was trained on its task alone and applies it to every prompt: on its task's set it beats
    the base by far (margin); on the base-capability set it would be refused — which is why an adapter meant
    for one task is uploaded with that task's eval set (or, for the kit's own, recognised by content)."""
    for name, demo in demo_kit.adapters.items():
        task = judge(gate, Path(demo.path), read_eval_file(Path(demo.eval_path)), check=MARGIN)
        assert task.passed, (name, [r for r in task.reasons if not r["passed"]])
        assert codes(task) == {"margin_ok": True, "well_formed_ok": True, "logits_ok": True, "fp8_agreement_ok": True}
    elsewhere = judge(gate, Path(demo_kit.adapters["reverse"].path), base_items)
    assert codes(elsewhere)["regression_over_tolerance"] is False and elsewhere.metrics["regression"]["mean_drop"] > 0.5


def test_too_few_base_items_cannot_judge(gate, base_items, demo_kit, tmp_path):
    with pytest.raises(GateError, match="needs 100"):
        judge(gate, random_adapter(demo_kit, tmp_path / "few", 0.02), base_items[:40])
