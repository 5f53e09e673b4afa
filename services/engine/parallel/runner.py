"""The model runner of a tensor-parallel group: rank 0's (inside the engine) sends each step and block copy
to the other ranks and then runs its own shard; the other ranks' `WorkerRunner` receives and runs theirs.

Once rank 0 has sent a step, every rank must go through the same collectives: an error past that point
cannot be pinned on a request (the ranks would disagree on where they are), so it is a
`TensorParallelFailure`, which stops the engine (dead) rather than an exception the step loop isolates.
"""
from __future__ import annotations

import logging

import torch

from services.engine.kv.copies import BlockCopy
from services.engine.model_runner import CopyStats, ModelRunner, StepInputs
from services.engine.parallel.comm import TpComm
from services.engine.parallel.step_io import HEADER, INLINE, Command, Received, pack_copies, pack_step, stop_header, unpack
from services.engine.sampler import SamplerOutput
from services.engine.scheduler import StepPlan

log = logging.getLogger("mplex.engine.tp")


class TensorParallelFailure(BaseException):
    """A rank died, hung past the collective timeout, or failed inside a step: the group's state cannot be
    trusted. A BaseException, like SystemExit: no request owns it, and the step loop must not go on."""


class StepChannel:
    """Rank 0 -> every rank, one broadcast per command: the header with the body inline when it fits in INLINE
    words (a decode step of ~100 sequences does), on `control`, where the other ranks wait without a practical
    timeout (an idle engine sends nothing) and rank 0's send is bounded by the collective timeout; a longer
    body follows in a second broadcast on the io group."""

    def __init__(self, comm: TpComm, control: TpComm):
        self.comm = comm
        self.control = control

    def send(self, header: torch.Tensor, body: torch.Tensor) -> None:
        msg = torch.zeros(HEADER + INLINE, dtype=torch.int64)
        msg[:HEADER] = header
        inline = body.numel() <= INLINE
        if inline:
            msg[HEADER : HEADER + body.numel()] = body
        self.control.broadcast(msg)
        if not inline:
            self.comm.broadcast(body)

    def receive(self) -> Received:
        msg = self.control.broadcast(torch.empty(HEADER + INLINE, dtype=torch.int64))
        size = int(msg[1])
        body = msg[HEADER : HEADER + size] if size <= INLINE else self.comm.broadcast(torch.empty(size, dtype=torch.int64))
        return unpack(msg[:HEADER], body)


class TpModelRunner(ModelRunner):
    """Rank 0's runner. `group.check()` raises if a rank is known dead (the watchdog saw it exit)."""

    def __init__(self, group, *args, **kw):
        super().__init__(*args, **kw)
        self.group = group
        self.adapters = None  # the TpAdapterManager whose slot changes each command carries (set by the engine)

    def _events(self):
        return self.adapters.drain_events() if self.adapters is not None else []

    @torch.inference_mode()
    def execute(self, plan: StepPlan, adapters=None) -> tuple[StepInputs, SamplerOutput | None]:
        step = self.begin(plan, adapters)  # an error here is the plan's own: nothing has been sent yet
        self.group.check()
        try:
            self.group.channel.send(*pack_step(plan, self._events()))
            return step.inputs, self.run(step)
        except Exception as exc:
            raise self.group.fail(f"step failed on rank 0 after it was sent: {exc!r}") from exc

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> CopyStats:
        self.group.check()
        try:
            self.group.channel.send(*pack_copies(copies, self._events()))
            return super().copy_blocks(copies)
        except Exception as exc:
            raise self.group.fail(f"block copies failed on rank 0 after they were sent: {exc!r}") from exc


class WorkerRunner:
    """Ranks 1..N-1: receive commands until STOP; each step runs this rank's shard of the forward."""

    def __init__(self, runner: ModelRunner, adapters, channel: StepChannel):
        self.runner = runner
        self.adapters = adapters  # a TpAdapterManager replaying rank 0's slot changes (None: LoRA off)
        self.channel = channel

    def serve(self) -> None:
        while True:
            msg = self.channel.receive()
            if msg.command is Command.STOP:
                return
            if msg.events:
                self.adapters.replay(msg.events)
            if msg.command is Command.COPY:
                self.runner.copy_blocks(msg.copies)
            else:
                self.step(msg)

    @torch.inference_mode()
    def step(self, msg: Received) -> None:
        runner = self.runner
        inputs = runner.prepare(msg.plan, msg.token_ids)
        lora = None
        if inputs.has_lora:
            from services.engine.lora.step import StepLora

            lora = StepLora(self.adapters, inputs.token_slots, inputs.lora_runs)
        hidden = runner.model.forward(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_caches, lora,
                                      keep=inputs.sample_rows)  # the rows rank 0 keeps: the reduces must match
        if inputs.sampled:
            runner.model.logits(hidden)  # this rank's part of the gather


def send_stop(channel: StepChannel) -> None:
    channel.send(stop_header(), torch.empty(0, dtype=torch.int64))
