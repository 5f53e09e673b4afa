"""A worker process of the kit build: trains the adapters (and the draft model) of the JSON job on stdin,
one after another.

Progress and results go to stdout as `@mplex-kit {json}` lines (anything else a library prints there is
ignored by the parent); errors go to stderr, which the parent keeps in a log and shows if we fail.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch

    from services.modelkit.build import WORKER_PREFIX, build_adapter, draft_from_dict, spec_from_dict
    from services.modelkit.draft import DRAFT_DIR, build_draft

    job = json.loads(sys.stdin.buffer.read())
    torch.set_num_threads(job["threads"])  # fixed, so the weights do not depend on the machine
    out = sys.stdout.buffer

    def emit(msg: dict) -> None:
        out.write(WORKER_PREFIX + json.dumps(msg).encode() + b"\n")
        out.flush()

    out_dir, base_dir = Path(job["out_dir"]), Path(job["base_dir"])
    for item in job["items"]:
        name = item["adapter"]["name"] if "adapter" in item else DRAFT_DIR

        def on_step(step: int, loss: float, name: str = name) -> None:
            emit({"adapter": name, "step": step, "loss": loss})

        if "adapter" in item:
            result = build_adapter(spec_from_dict(item["adapter"]), seed=job["seed"], eval_size=job["eval_size"],
                                   model_name=job["model_name"], out_dir=out_dir, base_dir=base_dir, on_step=on_step)
        else:
            result = build_draft(draft_from_dict(item["draft"]), seed=job["seed"], eval_size=job["eval_size"],
                                 out_dir=out_dir, base_dir=base_dir, on_step=on_step)
        emit({"adapter": name, "result": result})


if __name__ == "__main__":
    main()
