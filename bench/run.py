"""`make bench`: run every benchmark (or those named on the command line) and print their tables."""
from __future__ import annotations

import importlib
import sys
import time

BENCHMARKS = ["engine", "multi_lora", "fp8", "kv_fp8", "kv_swap", "gateway", "billing", "adapters", "isolation", "fairness",
              "structured", "batch", "serving", "overlap", "spec", "tp", "gemm"]


def main(argv: list[str]) -> int:
    names = argv or BENCHMARKS
    failed = []
    for name in names:
        t0 = time.time()
        print(f"\n######## bench: {name}", flush=True)
        try:
            importlib.import_module(f"bench.{name}_bench").main()
        except Exception as exc:  # one broken benchmark must not hide the others' figures
            import traceback

            traceback.print_exc()
            failed.append(f"{name}: {exc!r}")
        print(f"######## {name} took {time.time() - t0:.0f}s", flush=True)
    if failed:
        print("\nbenchmarks that failed to run:\n  " + "\n  ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
