"""A worker process of the kit build: trains the adapters of the JSON job on stdin, one after another.

Progress and results go to stdout as `@mplex-kit {json}` lines (anything else a library prints there is
ignored by the parent); errors go to stderr, which the parent keeps in a log and shows if we fail.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch

    from services.modelkit.build import WORKER_PREFIX, build_adapter, spec_from_dict

    job = json.loads(sys.stdin.buffer.read())
    torch.set_num_threads(job["threads"])  # fixed, so the weights do not depend on the machine
    out = sys.stdout.buffer

    def emit(msg: dict) -> None:
        out.write(WORKER_PREFIX + json.dumps(msg).encode() + b"\n")
        out.flush()

    for d in job["adapters"]:
        spec = spec_from_dict(d)
        result = build_adapter(spec, seed=job["seed"], eval_size=job["eval_size"], model_name=job["model_name"],
                               out_dir=Path(job["out_dir"]), base_dir=Path(job["base_dir"]),
                               on_step=lambda step, loss, name=spec.name: emit({"adapter": name, "step": step, "loss": loss}))
        emit({"adapter": spec.name, "result": result})


if __name__ == "__main__":
    main()
