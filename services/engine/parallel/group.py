"""A tensor-parallel group as rank 0 (the engine core) sees it: starts ranks 1..N-1 as processes, joins
them in process groups, loads its own shard, watches the others' pids, and stops them.

Ranks 1..N-1 run `worker_main`: the same shard loading, a model runner with the KV cache of their own KV
heads (same block ids as rank 0), an adapter manager that replays rank 0's slot changes, and a loop over
rank 0's commands. A rank that exits is seen at once by the watchdog: the group is failed (the next step
raises TensorParallelFailure), and inside a core process the core exits as a crashed core does, so its
front-ends fail its requests (EngineFailed) and report dead, and the launcher exits non-zero.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading

import torch
import torch.distributed as dist

from services.engine.config import EngineConfig, ModelConfig
from services.engine.parallel.comm import TpComm, open_store, resolve_backend
from services.engine.parallel.loader import load_shard
from services.engine.parallel.runner import StepChannel, TensorParallelFailure, TpModelRunner, WorkerRunner, send_stop
from services.engine.parallel.shard import TpShard

log = logging.getLogger("mplex.engine.tp")

# Ranks 1..N-1 await the next command on a group of its own with this timeout: an idle engine sends nothing
# for as long as it is idle, and a dead rank 0 is noticed by the closed connection (and PDEATHSIG).
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0


def rank_device(device: str, rank: int) -> str:
    """One device per rank: cuda:k for rank k (offset by the configured index); the CPU for every rank."""
    d = torch.device(device)
    if d.type != "cuda":
        return device
    return f"cuda:{(d.index or 0) + rank}"


def _groups(store, rank: int, config: EngineConfig) -> tuple[TpComm, StepChannel]:
    p = config.parallel
    n, device = p.tensor_parallel_size, rank_device(config.device, rank)
    backend = resolve_backend(p.backend, config.device)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its current device
    start = p.startup_timeout_s
    comm = TpComm(store, rank, n, backend, p.collective_timeout_s, device, "compute", start)
    # Only the ranks waiting for rank 0's next command wait without a practical bound; rank 0's own send is
    # bounded like any collective (gloo sends once the receiver has posted its receive: a rank stuck before
    # it would otherwise hold rank 0 for as long).
    control = TpComm(store, rank, n, "gloo", p.collective_timeout_s if rank == 0 else CONTROL_TIMEOUT_S, "cpu",
                     "control", start)
    io = comm if backend == "gloo" else TpComm(store, rank, n, "gloo", p.collective_timeout_s, "cpu", "io", start)
    return comm, StepChannel(io, control)


def _started(comm: TpComm, channel: StepChannel) -> None:
    """Loading is over: collectives are bounded by collective_timeout_s from now on."""
    for c in (comm, channel.comm, channel.control):
        c.started()


def _rank_bytes(comm: TpComm, mine: int) -> list[int]:
    """Every rank's figure, on every rank (one small all-reduce)."""
    t = torch.zeros(comm.size, dtype=torch.float64, device=comm.device)
    t[comm.rank] = mine
    return [int(x) for x in comm.all_reduce(t).tolist()]


class TpGroup:
    """Rank 0's handle on its group. `model` is rank 0's shard; `make_runner` / `make_adapters` build the
    engine's runner and adapter manager for rank 0."""

    def __init__(self, config: EngineConfig):
        p = config.parallel
        n = p.tensor_parallel_size
        self.config = config
        self.size = n
        self.full_config = ModelConfig.from_dir(config.model_dir)
        store = open_store(n, p.startup_timeout_s)
        ctx = multiprocessing.get_context("spawn")
        threads = torch.get_num_threads()
        self.procs = [ctx.Process(target=worker_main, args=(config, r, store.port, threads), daemon=True,
                                  name=f"engine-tp-rank{r}") for r in range(1, n)]
        for proc in self.procs:
            proc.start()
        self.dead: str | None = None
        self.exit_on_failure = False  # a core process sets it: a dead rank then ends the core at once
        self._closing = False
        try:
            self.comm, self.channel = _groups(store, 0, config)
            self.shard = TpShard(self.full_config, 0, n)
            device = rank_device(config.device, 0)
            self.model = load_shard(config.model_dir, self.shard, self.comm, dtype=config.torch_dtype, device=device,
                                    weight_dtype=config.weight_dtype)
            self.rank_weight_bytes = _rank_bytes(self.comm, self.model.weight_bytes())
            _started(self.comm, self.channel)
        except BaseException:
            self._kill()
            raise
        self._store = store
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        log.info("tensor parallel: %d ranks (%s), pids %s, weights per rank %s MiB", n, self.comm.backend,
                 [os.getpid(), *(proc.pid for proc in self.procs)], [round(b / 2**20, 2) for b in self.rank_weight_bytes])

    # -- what the engine builds -----------------------------------------------------------------------
    def make_runner(self, *args, **kw) -> TpModelRunner:
        return TpModelRunner(self, *args, **kw)

    def make_adapters(self, model: ModelConfig, config, **kw):
        from services.engine.parallel.lora import TpAdapterManager

        return TpAdapterManager(self.full_config, config, shard=self.shard, **kw)

    # -- failure ---------------------------------------------------------------------------------------
    def check(self) -> None:
        if self.dead is not None:
            raise TensorParallelFailure(self.dead)

    def fail(self, why: str) -> TensorParallelFailure:
        """Mark the group failed (the first reason wins), stop the other ranks; returns the error to raise."""
        if self.dead is None:
            self.dead = why
            log.error("tensor-parallel group failed: %s", why)
        self._kill()
        return TensorParallelFailure(self.dead)

    def _watch(self) -> None:
        by_sentinel = {proc.sentinel: (r, proc) for r, proc in enumerate(self.procs, 1)}
        gone = multiprocessing.connection.wait(list(by_sentinel))
        if self._closing:
            return
        rank, proc = by_sentinel[gone[0]]
        proc.join(1)
        why = f"rank {rank} (pid {proc.pid}) exited with status {proc.exitcode}"
        if self.dead is None:
            self.dead = why
        log.critical("tensor-parallel %s: the engine cannot go on", why)
        if self.exit_on_failure:
            os._exit(1)  # as a crashed core: the front-ends see its pid end and fail its requests
        self._kill()

    # -- shutdown ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the other ranks (a STOP command when the group is healthy, else a kill)."""
        if self._closing:
            return
        self._closing = True
        if self.dead is None:
            try:
                send_stop(self.channel)
            except Exception:  # a rank went away meanwhile: killed below
                pass
        for proc in self.procs:
            proc.join(10)
        self._kill()

    def _kill(self) -> None:
        self._closing = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)


def worker_main(config: EngineConfig, rank: int, port: int, threads: int) -> None:
    """Rank `rank`'s process: join the group, load its shard, serve rank 0's commands until STOP."""
    from services.engine.process_life import die_with_parent

    die_with_parent()
    torch.set_num_threads(max(1, threads))
    try:
        _serve_rank(config, rank, port)
    except BaseException:
        log.exception("tensor-parallel rank %d stopped", rank)
        os._exit(1)
    os._exit(0)


def _serve_rank(config: EngineConfig, rank: int, port: int) -> None:
    import datetime

    from services.engine.kernels.choice import attention_kernel_for, fp8_writer_for
    from services.engine.model_runner import ModelRunner
    from services.engine.parallel.lora import TpAdapterManager

    p = config.parallel
    store = dist.TCPStore("127.0.0.1", port, p.tensor_parallel_size, False,
                          timeout=datetime.timedelta(seconds=p.startup_timeout_s))
    comm, channel = _groups(store, rank, config)
    full = ModelConfig.from_dir(config.model_dir)
    shard = TpShard(full, rank, p.tensor_parallel_size)
    device = rank_device(config.device, rank)
    model = load_shard(config.model_dir, shard, comm, dtype=config.torch_dtype, device=device,
                       weight_dtype=config.weight_dtype)
    _rank_bytes(comm, model.weight_bytes())
    _started(comm, channel)
    local, bs = model.config, config.cache.block_size
    # The same sizing as rank 0's engine (same config, same local shapes): the same block ids everywhere.
    num_blocks = config.cache.resolve_num_blocks(local, config.torch_dtype)
    kernel = attention_kernel_for(config, local, bs)
    runner = ModelRunner(model, num_blocks, bs, full.eos_token_ids, attention_kernel=kernel,
                         kv_dtype=config.cache.kv_dtype, fp8_writer=fp8_writer_for(config, kernel))
    runner.allocate_host_blocks(config.cache.resolve_num_host_blocks(runner.block_bytes, num_blocks))
    adapters = None
    if config.lora.enabled:
        adapters = TpAdapterManager(full, config.lora, shard=shard, dtype=config.torch_dtype, device=device,
                                    cache_dir=config.adapter_cache_dir, base_names=config.adapter_base_names)
    WorkerRunner(runner, adapters, channel).serve()
