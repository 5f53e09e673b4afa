"""Build the demo kit: tokenizer, base model, LoRA adapters and eval sets, into one directory.

Layout of a built kit (`out_dir`):
    base/                 HF model dir: config.json, model.safetensors, tokenizer files (chat template)
    adapters/<name>/      PEFT adapter: adapter_config.json + adapter_model.safetensors (nothing else)
    evals/base.jsonl      held-out {"prompt", "expected"} rows for the base model
    evals/<name>.jsonl    held-out rows for each adapter's task
    manifest.json         build key, hyper-parameters, per-stage losses/timings and eval scores

Everything is seeded and the thread counts are fixed, so the same config builds the same weights. The
base model trains in this process; the adapters then train in `adapter_workers` spawned processes
(longest first), which report their steps back so this process draws one bar per adapter.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from services.modelkit import corpus
from services.modelkit.config import DRAFT_DIR, AdapterSpec, DraftSpec, KitConfig, TrainConfig
from services.modelkit.evaluate import EvalItem, load_tokenizer, score, write_eval
from services.modelkit.tokenizer import save_hf_tokenizer, special_ids, train_tokenizer
from services.modelkit.train import encode_examples, train

log = logging.getLogger(__name__)


def _items(examples: list[corpus.Example]) -> list[EvalItem]:
    return [EvalItem(e.prompt, e.answer) for e in examples]


def build_demo(out_dir: Path, cfg: KitConfig, *, build_key: str, progress: bool = True) -> dict[str, Any]:
    """Build the whole kit into `out_dir` (which must be empty or absent); returns the manifest."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t_all = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_dir, evals_dir = out_dir / "base", out_dir / "evals"
    evals_dir.mkdir(exist_ok=True)
    manifest: dict[str, Any] = {"build_key": build_key, "model_name": cfg.model_name, "config": asdict(cfg)}

    # -- tokenizer --------------------------------------------------------------------------------
    t0 = time.perf_counter()
    tok = train_tokenizer(
        corpus.tokenizer_corpus(cfg.seed, cfg.tokenizer.corpus_examples),
        vocab_size=cfg.tokenizer.vocab_size,
        min_frequency=cfg.tokenizer.min_frequency,
    )
    save_hf_tokenizer(tok, base_dir, model_max_length=cfg.model.max_position_embeddings)
    ids = special_ids(tok)
    manifest["tokenizer"] = {"vocab_size": tok.get_vocab_size(), "seconds": round(time.perf_counter() - t0, 2)}

    # -- base model -------------------------------------------------------------------------------
    base_eval = corpus.base_eval_set(cfg.seed)
    write_eval(evals_dir / "base.jsonl", _items(base_eval))
    tool_items = [EvalItem(e.prompt, e.answer, e.system, want) for e, want in corpus.tool_eval_set(cfg.seed, cfg.eval_size)]
    write_eval(evals_dir / "tools.jsonl", tool_items)
    n_train = cfg.base_train.steps * cfg.base_train.batch_size
    train_set = corpus.base_training(cfg.seed, n_train, exclude=corpus.base_held_out(cfg.seed, cfg.eval_size))
    m = cfg.model
    torch.manual_seed(cfg.seed)
    lm_cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        initializer_range=m.initializer_range,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["<|end|>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    lm = LlamaForCausalLM(lm_cfg)
    data = encode_examples(tok, train_set, ids["<|end|>"])
    res = train(lm, list(lm.parameters()), data, cfg.base_train, pad_id=ids["<pad>"], desc="base model",
                progress=progress)
    lm.generation_config.pad_token_id = ids["<pad>"]
    lm.generation_config.eos_token_id = ids["<|end|>"]
    lm.generation_config.bos_token_id = ids["<s>"]
    lm.save_pretrained(base_dir, safe_serialization=True)
    hf_tok = load_tokenizer(base_dir)
    base_score = score(lm, hf_tok, _items(base_eval))
    tools_score = score(lm, hf_tok, tool_items, max_new_tokens=TOOL_EVAL_TOKENS)
    manifest["base"] = {
        "params": sum(p.numel() for p in lm.parameters()),
        "final_loss": round(res.final_loss, 4),
        "seconds": round(res.seconds, 1),
        "eval_exact_match": round(base_score.exact_match, 4),
        "tools": {"exact_match": round(tools_score.exact_match, 4),
                  "decision_accuracy": round(tool_decisions(tools_score.answers, tool_items), 4)},
    }
    log.info("base model: loss %.3f, eval exact match %.2f, tool decisions %.2f", res.final_loss,
             base_score.exact_match, manifest["base"]["tools"]["decision_accuracy"])

    # -- adapters and the draft model, in worker processes -------------------------------------------
    built = _build_adapters(cfg, out_dir, base_dir, progress=progress)
    manifest["adapters"] = {spec.name: built[spec.name] for spec in cfg.adapters}
    if cfg.draft is not None:
        manifest["draft"] = built[DRAFT_DIR]
    manifest["seconds"] = round(time.perf_counter() - t_all, 1)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


TOOL_EVAL_TOKENS = 64  # a call with its arguments is longer than the other tasks' answers


def tool_decisions(answers: Sequence[str], items: Sequence[EvalItem]) -> float:
    """The share of the tool eval's answers that call the tool they should (the first call's name), or no tool
    when they should answer in text: the `tool_choice: "auto"` decision."""
    from services.common.tool_calls import split_output

    def called(answer: str) -> str | None:
        _, calls = split_output(answer)
        return calls[0].name if calls else None

    return sum(called(a) == i.tool for a, i in zip(answers, items)) / len(items)


def _build_adapters(cfg: KitConfig, out_dir: Path, base_dir: Path, *, progress: bool) -> dict[str, dict[str, Any]]:
    """Train every adapter (and the draft model, named DRAFT_DIR) in `adapter_workers` worker processes;
    returns each one's manifest entry.

    Workers are plain subprocesses (`python -m services.modelkit.adapter_worker`) fed a JSON job on stdin:
    multiprocessing's spawn would re-import the caller's __main__ in each worker, and a script without a
    main guard would then build the kit again and wait forever on the kit lock its parent holds."""
    jobs: list[tuple[str, TrainConfig, dict[str, Any]]] = [(a.name, a.train, {"adapter": asdict(a)}) for a in cfg.adapters]
    if cfg.draft is not None:
        jobs.append((DRAFT_DIR, cfg.draft.train, {"draft": asdict(cfg.draft)}))
    if not jobs:
        return {}
    workers: list[list[dict[str, Any]]] = [[] for _ in range(min(cfg.adapter_workers, len(jobs)))]
    load = [0] * len(workers)
    # Longest first (by examples trained; the draft model's steps cost about as much as an adapter's).
    for _, train_cfg, job in sorted(jobs, key=lambda j: -j[1].steps * j[1].batch_size):
        i = load.index(min(load))
        workers[i].append(job)
        load[i] += train_cfg.steps * train_cfg.batch_size
    bars = {name: tqdm(total=t.steps, desc=f"adapter {name}" if name != DRAFT_DIR else "draft model", unit="step",
                       position=i, leave=True, disable=not progress, dynamic_ncols=True)
            for i, (name, t, _) in enumerate(jobs)}
    events: queue.Queue = queue.Queue()
    procs = []
    try:
        for i, items in enumerate(workers):
            job = {"out_dir": str(out_dir), "base_dir": str(base_dir), "seed": cfg.seed, "eval_size": cfg.eval_size,
                   "model_name": cfg.model_name, "threads": cfg.adapter_threads, "items": items}
            procs.append(start_worker(job, out_dir / f".worker-{i}.log", events))
        results: dict[str, dict[str, Any]] = {}
        finished = 0
        while finished < len(procs):
            kind, *rest = events.get()
            if kind == "step":
                name, step, loss = rest
                bars[name].set_postfix(loss=f"{loss:.3f}", refresh=False)
                bars[name].update(step - bars[name].n)
            elif kind == "result":
                name, result = rest
                results[name] = result
                bars[name].update(bars[name].total - bars[name].n)
            else:  # "exit"
                finished += 1
        for proc, log_path in procs:
            if proc.wait() != 0:
                tail = log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"an adapter worker failed (exit {proc.returncode}):\n{tail}")
        missing = {name for name, _, _ in jobs} - set(results)
        if missing:
            raise RuntimeError(f"adapter workers finished without building {sorted(missing)}")
        for _, log_path in procs:
            log_path.unlink()
        return results
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
        for bar in bars.values():
            bar.close()


def start_worker(job: dict[str, Any], log_path: Path, events: queue.Queue) -> tuple[subprocess.Popen, Path]:
    """Start one worker; a thread turns its stdout lines into ("step"|"result"|"exit", ...) events."""
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.modelkit.adapter_worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, env=env)
    log.close()
    proc.stdin.write(json.dumps(job).encode())
    proc.stdin.close()

    def pump() -> None:
        for line in proc.stdout:
            if not line.startswith(WORKER_PREFIX):
                continue  # a library printing to stdout
            msg = json.loads(line[len(WORKER_PREFIX):])
            if "result" in msg:
                events.put(("result", msg["adapter"], msg["result"]))
            else:
                events.put(("step", msg["adapter"], msg["step"], msg["loss"]))
        events.put(("exit",))

    threading.Thread(target=pump, daemon=True, name="kit-worker-pump").start()
    return proc, log_path


WORKER_PREFIX = b"@mplex-kit "


def draft_from_dict(d: dict[str, Any]) -> DraftSpec:
    return DraftSpec(num_layers=d["num_layers"], train=TrainConfig(**d["train"]))


def spec_from_dict(d: dict[str, Any]) -> AdapterSpec:
    return AdapterSpec(
        **{**d, "train": TrainConfig(**d["train"]), "target_modules": tuple(d["target_modules"]),
           "rank_pattern": tuple(tuple(x) for x in d["rank_pattern"]),
           "alpha_pattern": tuple(tuple(x) for x in d["alpha_pattern"])})


def build_adapter(spec: AdapterSpec, *, seed: int, eval_size: int, model_name: str, out_dir: Path, base_dir: Path,
                  on_step) -> dict[str, Any]:
    """Train, save and score one adapter on the built base model (runs in a worker process)."""
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    ids = special_ids(tok)
    ev = corpus.adapter_eval_set(spec.task, eval_size, seed)
    write_eval(out_dir / "evals" / f"{spec.name}.jsonl", _items(ev))
    n = spec.train.steps * spec.train.batch_size
    examples = corpus.adapter_training(spec.task, seed, n, exclude={e.prompt for e in ev})
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    hf_tok = load_tokenizer(base_dir)
    base_only = score(base, hf_tok, _items(ev))
    torch.manual_seed(seed + 1)
    lora_cfg = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        target_modules=list(spec.target_modules),
        lora_dropout=0.0,
        bias="none",
        use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern),
        alpha_pattern=dict(spec.alpha_pattern),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, lora_cfg)
    inner = peft_model.get_base_model()  # the LlamaForCausalLM with LoRA layers injected in place
    params = [p for p in peft_model.parameters() if p.requires_grad]
    data = encode_examples(tok, examples, ids["<|end|>"])
    res = train(inner, params, data, spec.train, pad_id=ids["<pad>"], desc=f"adapter {spec.name}", progress=False,
                on_step=on_step)
    adapter_dir = out_dir / "adapters" / spec.name
    peft_model.peft_config["default"].base_model_name_or_path = model_name
    peft_model.save_pretrained(adapter_dir, safe_serialization=True)
    for extra in adapter_dir.iterdir():  # PEFT also writes a model card; the kit ships exactly the two files
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()
    tuned = score(peft_model, hf_tok, _items(ev))
    log.info("adapter %s: loss %.3f, exact match %.2f (base %.2f)", spec.name, res.final_loss,
             tuned.exact_match, base_only.exact_match)
    return {
        "task": spec.task,
        "rank": spec.rank,
        "target_modules": list(spec.target_modules),
        "final_loss": round(res.final_loss, 4),
        "seconds": round(res.seconds, 1),
        "eval_exact_match": round(tuned.exact_match, 4),
        "base_exact_match": round(base_only.exact_match, 4),
    }


if __name__ == "__main__":  # kit._build_pinned: a pickled (out_dir, cfg, build_key, progress) on stdin
    import pickle

    _out, _cfg, _key, _progress = pickle.loads(sys.stdin.buffer.read())
    build_demo(Path(_out), _cfg, build_key=_key, progress=_progress)
