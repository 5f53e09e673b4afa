"""The collectives of one tensor-parallel group: a process group of its own (not torch.distributed's global
default), so several engines can live in one process (tests) and nothing else's collectives interleave.

gloo on the CPU, NCCL on CUDA. Every collective waits at most the group's timeout: a rank that died or hangs
makes it raise (gloo also raises at once when a peer's connection closes), and the engine goes dead.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank is gone; the group cannot be trusted any more."""


def open_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free local port (the ranks of a group share one host)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def resolve_backend(backend: str, device: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class TpComm:
    """rank/size, and the four collectives tensor parallelism needs (all in place or to rank 0)."""

    def __init__(self, store: dist.Store, rank: int, size: int, backend: str, timeout_s: float, device: str,
                 name: str = "compute", startup_s: float | None = None):
        """`timeout_s` bounds every collective once `started()`; until then (joining, loading the shards, which
        takes minutes for a large model and not the same time on every rank) `startup_s` does."""
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.op_timeout = datetime.timedelta(seconds=max(startup_s or 0, timeout_s))
        prefixed = dist.PrefixStore(f"mplex-tp-{name}", store)  # one store, several groups
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.op_timeout  # with TORCH_NCCL_ASYNC_ERROR_HANDLING, a stuck collective aborts
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, self.op_timeout)
        self.store = store  # kept alive: rank 0 serves it
        self.backend = backend
        self.failed = False

    def started(self) -> None:
        """From now on every collective waits at most `timeout_s` (each op carries its own timeout)."""
        self.op_timeout = self.timeout

    def _wait(self, work) -> None:
        try:
            work.wait(self.op_timeout)
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses; all mean a peer is gone
            self.failed = True
            raise CollectiveError(f"tensor-parallel collective failed (rank {self.rank}/{self.size}): {exc}") from exc

    def _run(self, fn, *args) -> None:
        if self.failed:
            raise CollectiveError("the tensor-parallel group failed earlier")
        try:
            work = fn(*args)
        except Exception as exc:
            self.failed = True
            raise CollectiveError(f"tensor-parallel collective failed (rank {self.rank}/{self.size}): {exc}") from exc
        self._wait(work)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place: t = the sum (or `op`) of every rank's t."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = self.op_timeout
        self._run(self.pg.allreduce, [t], opts)
        return t

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.timeout = self.op_timeout
        self._run(self.pg.broadcast, [t], opts)
        return t

    def gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `t` (same shape) concatenated along `dim` on rank 0; None on the others. NCCL has
        no gather: there it is an all-gather (the logits are small beside the weights)."""
        if self.backend == "nccl":
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self._run(self.pg.allgather, [parts], [t])
            return torch.cat(parts, dim) if self.rank == 0 else None
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = self.op_timeout
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else []
        self._run(self.pg.gather, [parts] if self.rank == 0 else [], [t], opts)
        return torch.cat(parts, dim) if self.rank == 0 else None

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))
