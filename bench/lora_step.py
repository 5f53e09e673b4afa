"""Where a multi-LoRA step's time goes: one realistic decode step, with and without LoRA, on the same inputs.

    python -m bench.lora_step [zipf|uniform] [proportional|stress] [native|torch] [--profile]

Runs the multi-LoRA benchmark's workload on the engine until a step schedules at least 200 decode rows
with adapters, then times on that step's exact inputs (same KV, same slots): the base forward, the forward
with the step's LoRA hook, building the hook (the SGMV plan), and the 16 group applications alone; with
--profile, the torch profiler's op table of the applications. Not part of `make bench` (it sets no
target); it is the tool behind the analysis in docs/engine.md.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

REPS = 40
MIN_ROWS = 200


def main(argv: list[str]) -> None:
    from bench import multi_lora_bench as mlb
    from bench.workload import mixed_workload
    from services.engine.lora.step import StepLora
    from services.modelkit import ensure_demo

    popularity = next((a for a in argv if a in ("zipf", "uniform")), "zipf")
    mix = next((a for a in argv if a in mlb.RANK_MIXES), mlb.TARGET_MIX)
    mlb.CPU_KERNEL = next((a for a in argv if a in ("native", "torch")), mlb.CPU_KERNEL)
    torch.set_num_threads(2)
    kit = ensure_demo(progress=False)
    reqs = mixed_workload(kit, mlb.N_REQUESTS, seed=11)
    refs = mlb.build_adapters(kit, mlb.default_adapter_root(), mlb.N_ADAPTERS, mlb.RANK_MIXES[mix])
    adapters = mlb.assign(len(reqs), refs, popularity)
    engine = mlb._engine(kit)
    for i, (r, a) in enumerate(zip(reqs, adapters)):
        engine.add_request(f"s{i}", r.prompt_ids, mlb._params(r), adapter=a)
    runner = engine.runner
    execute = runner.execute
    done = False

    def measure(plan, manager):
        inp = runner.prepare(plan)
        model, kv = runner.model, runner.kv_caches
        calls = []

        class Recorder:
            def __init__(self, hook):
                self.hook = hook

            def apply(self, layer, group, x, out):
                calls.append((layer, group, x.clone(), out.clone()))
                self.hook.apply(layer, group, x, out)

        times: dict[str, list[float]] = {"base forward": [], "LoRA forward (incl. plan)": [], "plan": [], "16 applications": []}
        with torch.inference_mode():
            model.forward(inp.input_ids, inp.positions, inp.attn, kv, Recorder(StepLora(manager, inp.token_slots)))
            for _ in range(REPS):
                t0 = time.perf_counter()
                model.forward(inp.input_ids, inp.positions, inp.attn, kv, None)
                t1 = time.perf_counter()
                hook = StepLora(manager, inp.token_slots)
                t2 = time.perf_counter()
                model.forward(inp.input_ids, inp.positions, inp.attn, kv, hook)
                t3 = time.perf_counter()
                for layer, group, x, y in calls:
                    hook.apply(layer, group, x, y)
                t4 = time.perf_counter()
                times["base forward"].append(t1 - t0)
                times["plan"].append(t2 - t1)
                times["LoRA forward (incl. plan)"].append(t3 - t1)
                times["16 applications"].append(t4 - t3)
        slots = inp.token_slots.tolist()
        print(f"{popularity}/{mix}, {manager.cpu_kernel} kernel: step of {len(slots)} rows, {len(set(slots) - {-1})} adapters")
        for name, ts in times.items():
            print(f"  {name:>26}: {1000 * statistics.median(ts[5:]):7.2f} ms (median of {REPS - 5})")
        base, lora = (statistics.median(times[k][5:]) for k in ("base forward", "LoRA forward (incl. plan)"))
        print(f"  forward ratio base/LoRA: {base / lora:.3f}")
        if isinstance(hook.cpu_plan, dict):
            for group, plan_g in hook.cpu_plan.items():
                print(f"  {group:>8}: {len(plan_g.batches)} class grids ({plan_g.cells} cells), {len(plan_g.long)} long segments")
        elif hook.cpu_plan is not None:
            print(f"  {hook.cpu_plan.short.shape[0]} short segments (C kernel), {len(hook.cpu_plan.long)} long (MKL)")
        if "--profile" in argv:
            from torch.profiler import profile

            with profile() as prof, torch.inference_mode():
                for _ in range(10):
                    hook = StepLora(manager, inp.token_slots)
                    for layer, group, x, y in calls:
                        hook.apply(layer, group, x, y)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

    def capture(plan, manager=None):
        nonlocal done
        result = execute(plan, manager)
        rows = len(plan.scheduled)
        if not done and rows >= MIN_ROWS and result[0].input_ids.numel() == rows and result[0].has_lora:
            done = True
            measure(plan, manager)
        return result

    runner.execute = capture
    while engine.has_unfinished() and not done:
        engine.step()
        if engine.last_plan_empty:
            engine.wake.wait(0.01)
            engine.wake.clear()
    if engine.adapters is not None:
        engine.adapters.shutdown()
    if not done:
        print(f"no step reached {MIN_ROWS} decode rows with adapters")


if __name__ == "__main__":
    main(sys.argv[1:])
