"""The engine's step loop: schedule, run, post-process (detokenize, stop, finish, account)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import threading
import time
from dataclasses import dataclass

import torch

from services.common.lora_format import AdapterFormatError
from services.common.structured import Guide
from services.engine.admission import LoadTracker
from services.engine.config import EngineConfig
from services.engine.detokenizer import DecodeStream, StopMatcher, TokenizerInfo
from services.engine.grammar import GrammarCache
from services.engine.kernels.choice import attention_kernel_for, fp8_writer_for
from services.engine.kv.block_pool import BlockPool
from services.engine.kv.host_pool import HostBlockPool
from services.engine.kv.manager import KVCacheManager
from services.engine.metrics import EngineMetrics
from services.engine.model.loader import load_model
from services.engine.model_runner import ModelRunner
from services.engine.preemption import PreemptionCostModel, PreemptKind
from services.engine.sampler import SamplerOutput
from services.engine.scheduler import Scheduler, StepPlan
from services.engine.sequence import AdapterRef, InvalidRequest, Priority, SamplingParams, Sequence, Status
from services.engine.spec.controller import SpecController
from services.engine.spec.drafter import make_drafters
from services.engine.spec.verify import accepted_lengths
from services.common.wire import RequestFailed, check_prompt_ids

log = logging.getLogger("mplex.engine")


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta), plus its running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    compute_seconds: float
    logprobs: list[TokenLogprob] | None = None
    error: InvalidRequest | None = None  # the request was refused after queueing (e.g. its adapter failed to load)
    clamped_from: int | None = None  # overload clamped its max_tokens (batch class): what it had asked for
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified for this request so far
    num_accepted_tokens: int = 0  # of those, accepted (emitted; billing counts num_output_tokens only)


@dataclass(slots=True)
class _Stream:
    decoder: DecodeStream
    stops: StopMatcher


@dataclass(slots=True)
class StepStats:
    steps: int = 0
    busy_seconds: float = 0.0
    tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, *, detokenize: bool = True):
        self.config = config
        # False in a core process: its front-ends detokenize and match stop strings (core_client.py); the core
        # stops a request on token ids only (EOS, stop_token_ids, length) or when a front-end says so.
        self.detokenize = detokenize
        self._hits_reported = 0
        torch.manual_seed(config.seed)
        # Tensor parallelism (parallel/): this process is rank 0 -- the scheduler, KV bookkeeping, adapter
        # decisions and the sampler stay here -- and the group's other ranks are started now.
        self.tp = None
        if config.parallel.tensor_parallel_size > 1 and model is None:
            from services.engine.parallel.group import TpGroup

            self.tp = TpGroup(config)
            model = self.tp.model
        self.model = model or load_model(config.model_dir, dtype=config.torch_dtype, device=config.device,
                                         weight_dtype=config.weight_dtype, pack=config.cpu_packed_gemm)
        mcfg = self.model.config
        self.tokenizer = TokenizerInfo(config.model_dir)
        self.eos_token_ids = mcfg.eos_token_ids
        self.max_model_len = min(config.scheduler.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        block_size = config.cache.block_size
        num_blocks = config.cache.resolve_num_blocks(mcfg, config.torch_dtype)
        attention_kernel = attention_kernel_for(config, mcfg, block_size)
        make_runner = ModelRunner if self.tp is None else self.tp.make_runner  # rank 0's sends each step first
        self.runner = make_runner(self.model, num_blocks, block_size, self.eos_token_ids,
                                  attention_kernel=attention_kernel, kv_dtype=config.cache.kv_dtype,
                                  fp8_writer=fp8_writer_for(config, attention_kernel))
        num_host_blocks = config.cache.resolve_num_host_blocks(self.runner.block_bytes, num_blocks)
        self.runner.allocate_host_blocks(num_host_blocks)
        self.kv = KVCacheManager(BlockPool(num_blocks), block_size, config.cache.enable_prefix_caching,
                                 HostBlockPool(num_host_blocks) if num_host_blocks else None)
        # Running estimates of what swapping and recomputing cost; the copy bandwidth starts from a
        # measurement, the prefill cost from the first steps.
        self.preemption = PreemptionCostModel(self.runner.block_bytes, config.cache.preemption_mode)
        if num_host_blocks:
            self.preemption.observe_copy(*self.runner.measure_copy_bandwidth())
        self.wake = threading.Event()  # set by anything that may make a blocked step loop runnable
        self.adapters = None
        if config.lora.enabled:
            from services.engine.lora.manager import AdapterManager

            self.adapters = (AdapterManager if self.tp is None else self.tp.make_adapters)(
                mcfg, config.lora, dtype=config.torch_dtype, device=config.device,
                cache_dir=config.adapter_cache_dir, wake=self.wake, base_names=config.adapter_base_names,
            )
        if self.tp is not None:
            self.runner.adapters = self.adapters  # its slot changes travel with each command
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.adapters,
                                   preemption=self.preemption, share_prompts=config.cache.enable_prompt_sharing)
        self._forks_reported = 0
        self.load = LoadTracker(config.scheduler)  # what SLO-aware admission reads (admission.py)
        self._finished_seen = 0
        self.last_plan_empty = False
        self._slot_loads_seen = 0
        self.metrics = EngineMetrics(config.model_name)
        self.metrics.kv_total.set(num_blocks)
        self.metrics.host_blocks_total.set(num_host_blocks)
        kv_dtype = "fp8_e4m3" if config.cache.is_fp8 else config.dtype
        self.metrics.set_kv_cache_info(kv_dtype, self.runner.kv_bytes_per_token)
        self.stats = StepStats()
        self._grammars: GrammarCache | None = None  # made for the first constrained request
        self._seqs: dict[str, Sequence] = {}
        self._step_itls, self._step_tokens = [], 0  # a step's inter-token latencies and tokens (_postprocess)
        self._streams: dict[str, _Stream] = {}
        self._rng = random.Random(config.seed)
        self._failpoints = config.failpoints
        self.draining = False  # set by the drain op (core_ops.drain): new requests are refused, running ones finish
        self.overlap = None  # async scheduling (overlap.py): the next step's CPU work during this one's forward
        if config.async_scheduling:
            from services.engine.overlap import OverlapStepper

            self.overlap = OverlapStepper(self)
        self.spec = None
        if config.speculative.enabled:
            drafters = make_drafters(config.speculative, vocab_size=self.model.config.vocab_size,
                                     dtype=config.torch_dtype, device=config.device,
                                     attention_kernel=self.runner.attention_kernel, pack=config.cpu_packed_gemm)
            self.spec = SpecController(config.speculative, drafters=drafters)
        self._log_ready(attention_kernel, num_blocks, num_host_blocks, kv_dtype)

    def _log_ready(self, attention_kernel, num_blocks: int, num_host_blocks: int, kv_dtype: str) -> None:
        config, block_size = self.config, self.config.cache.block_size
        weights, params = self.model.weight_bytes(), self.model.num_params()
        log.info(
            "engine ready: model=%s weights=%.1f MiB (%s; %.2fx the %.1f MiB of bf16) kv=%d blocks x %d tokens "
            "(%.1f MiB, kv_dtype=%s, %.1f bytes/token) host tier=%d blocks (%.1f MiB) max_model_len=%d attention=%s lora=%s "
            "packed gemm=%s",
            config.model_name, weights / 2**20, "fp8" if config.weight_dtype == "fp8" else config.dtype,
            weights / (2 * params), 2 * params / 2**20, num_blocks, block_size, self.runner.kv_cache_bytes / 2**20,
            kv_dtype, self.runner.kv_bytes_per_token, num_host_blocks, num_host_blocks * self.runner.block_bytes / 2**20,
            self.max_model_len,
            "sdpa" if attention_kernel is None else f"{_kernel_name(attention_kernel)} decode + sdpa prefill",
            "off" if self.adapters is None else
            f"{config.lora.max_loras} slots ({self.adapters.cpu_kernel or 'triton'} kernel)",
            self.model.packing(),
        )

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: Priority = Priority.INTERACTIVE,
        cache_salt: str = "",
        adapter: AdapterRef | None = None,
        tenant: str = "",
        weight: float = 1.0,
    ) -> Sequence:
        if request_id in self._seqs:
            raise InvalidRequest(f"request id {request_id!r} is already running", "request_id", status=409)
        self.validate(prompt_token_ids, params)
        if adapter is not None:
            if self.adapters is None:
                raise InvalidRequest("this engine serves no adapters", "model", "model_not_found", status=404)
            try:
                self.adapters.request(adapter)
            except AdapterFormatError as exc:
                raise adapter_error(exc) from None
        seed = params.seed64 if params.seed is not None else self._rng.getrandbits(63)
        clamped = None
        clamp = self.config.scheduler.batch_max_tokens_under_overload
        if priority == Priority.BATCH and clamp is not None and params.max_tokens > clamp and self.load.overloaded():
            # Sustained overload: batch work gets a shorter budget (reported to the client), so interactive
            # work gets its seats and blocks back sooner.
            clamped = params.max_tokens
            params = dataclasses.replace(params, max_tokens=clamp, min_tokens=min(params.min_tokens, clamp))
            self.metrics.max_tokens_clamped.inc()
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, priority, cache_salt, adapter,
                       tenant=tenant, weight=weight)
        seq.clamped_from = clamped
        if params.guide is not None:  # a schema the grammar engine refuses is this request's 400
            seq.matcher = self.grammars.matcher(params.guide)
        self._seqs[request_id] = seq
        if self.detokenize:
            self._streams[request_id] = _Stream(
                DecodeStream(self.tokenizer, params.skip_special_tokens), StopMatcher(params.stop)
            )
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        return seq

    @property
    def grammars(self) -> GrammarCache:
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
        return self._grammars

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, vocab_size=self.model.config.vocab_size,
                         max_model_len=self.max_model_len, block_size=self.kv.block_size,
                         num_blocks=self.kv.pool.num_blocks)

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request now and free its KV blocks. Returns False if it was not running. `reason` "stop": a
        front-end matched one of its stop strings."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        if reason == "stop":
            self._finish(seq, "stop")
        else:
            self._seqs.pop(request_id)
            self._streams.pop(request_id, None)
            self.scheduler.finish(seq, "abort")
            self.metrics.count_finished("abort")
            if self.spec is not None:
                self.spec.forget(request_id)
        self._update_gauges()  # the step loop may go idle now and would leave the gauges stale
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.overlap is not None:  # async scheduling: this step planned while the last one runs
            return self.overlap.step()
        t_start = time.perf_counter()
        failed = self._fail_adapter_loads()
        self._prefetch_adapters()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.scheduler.num_waiting,
                              self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        plan = self.scheduler.schedule()
        self._account_plan(plan)
        if plan.block_copies:  # also when nothing runs: a sequence that preempted itself is swapped out
            self._copy_blocks(plan)
        self.last_plan_empty = plan.is_empty
        if plan.is_empty:
            self._update_gauges()
            return failed
        t0 = time.perf_counter()
        try:
            sampled = self._execute(plan)
        except Exception as exc:
            outputs = self._isolate(plan, exc)
        else:
            elapsed = time.perf_counter() - t0
            prefill = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens - len(s.draft) > 1)
            self.preemption.observe_step(prefill, plan.num_batched_tokens, elapsed)
            outputs = self._postprocess(plan, sampled, elapsed)
        finished = self.scheduler.num_finished - self._finished_seen
        self._finished_seen = self.scheduler.num_finished
        self.load.observe(self.scheduler, time.perf_counter() - t0, finished)
        if self.spec is not None:  # the whole step, drafting and output handling included: what a draft costs
            self.spec.observe_step(plan.num_batched_tokens, time.perf_counter() - t_start,
                                   sum(len(o.new_token_ids) for o in outputs),
                                   all(s.num_new_tokens - len(s.draft) == 1 for s in plan.scheduled))
        self._update_gauges()
        return failed + outputs

    def _account_plan(self, plan: StepPlan) -> None:
        """The scheduler's counters since the last plan, into the metrics."""
        hits = self.scheduler.prefix_hit_tokens - self._hits_reported
        if hits:
            self.metrics.prefix_hit_tokens.inc(hits)
            self._hits_reported += hits
        self.metrics.count_preemptions(PreemptKind.SWAP.value, len(plan.swapped_out))
        self.metrics.count_preemptions(PreemptKind.RECOMPUTE.value, len(plan.preempted) - len(plan.swapped_out))
        if plan.fair_preempted:
            self.metrics.fair_preemptions.inc(plan.fair_preempted)
        forks = self.scheduler.num_forks - self._forks_reported
        if forks:
            self.metrics.forks.inc(forks)
            self._forks_reported += forks

    def _copy_blocks(self, plan: StepPlan) -> None:
        """The step's swaps and copy-on-write copies, before its forward. They belong to no one request:
        if they fail, the error goes to `recover` (which fails the running requests), and the sequences
        swapped out by this step are recomputed instead of being copied back from host blocks that may
        hold nothing."""
        try:
            stats = self.runner.copy_blocks(plan.block_copies)
        except Exception:
            for seq in plan.swapped_out:
                if seq.status is Status.WAITING:
                    self.kv.free(seq.request_id)
            raise
        m = self.metrics
        m.swap_out_blocks.inc(stats.swap_out_blocks)
        m.swap_in_blocks.inc(stats.swap_in_blocks)
        m.swap_out_bytes.inc(stats.swap_out_blocks * self.runner.block_bytes)
        m.swap_in_bytes.inc(stats.swap_in_blocks * self.runner.block_bytes)
        m.swap_seconds.inc(stats.swap_seconds)
        m.cow_copies.inc(stats.cow_blocks)
        self.preemption.observe_copy(stats.swap_bytes, stats.swap_seconds)

    def _execute(self, plan: StepPlan) -> SamplerOutput | None:
        if self._failpoints:
            self._hit_failpoints(plan)
        return self.runner.execute(plan, self.adapters)[1]

    def _hit_failpoints(self, plan: StepPlan) -> None:
        for s in plan.scheduled:
            for name, token in self._failpoints:
                if token in s.seq.prompt_token_ids:
                    log.warning("failpoint %s hit by request %s", name, s.seq.request_id)
                    if name == "crash":
                        os._exit(70)  # as a segfault in a native kernel would: no cleanup, no reply
                    raise RuntimeError(f"failpoint {name}")

    def _isolate(self, plan: StepPlan, exc: Exception) -> list[RequestOutput]:
        """The forward failed: find whose input it was by running the step's sequences one at a time.
        Each re-run writes the same KV slots the failed step would have (nothing was committed), so the
        others lose nothing and produce their token; only a sequence that fails alone is failed."""
        if len(plan.scheduled) == 1:
            return [self._fail(plan.scheduled[0].seq, exc, "step")]
        log.warning("a step of %d sequences failed (%r); re-running them one by one", len(plan.scheduled), exc)
        outputs: list[RequestOutput] = []
        for s in plan.scheduled:
            one = StepPlan([s])
            t0 = time.perf_counter()
            try:
                sampled = self._execute(one)
            except Exception as alone:
                outputs.append(self._fail(s.seq, alone, "step"))
                continue
            outputs += self._postprocess(one, sampled, time.perf_counter() - t0)
        return outputs

    def _fail(self, seq: Sequence, exc: BaseException, where: str) -> RequestOutput:
        """End one request because of an error inside the engine: its KV blocks and adapter slot are
        released, its client gets a 500 (and is not retried elsewhere), everyone else goes on."""
        log.error("request %s failed in the engine (%s): %r", seq.request_id, where, exc, exc_info=exc)
        self.metrics.request_failures.labels(model=self.config.model_name, where=where).inc()
        if seq.request_id in self._seqs:
            self._finish(seq, "error")
        return RequestOutput(seq.request_id, [], "", True, "error", seq.num_prompt_tokens, seq.num_cached_tokens or 0,
                             max(seq.num_output_tokens, 0), seq.compute_seconds,
                             error=RequestFailed(f"the engine failed while serving this request ({type(exc).__name__})"))

    def recover(self, exc: Exception) -> list[RequestOutput]:
        """An error outside any one request's handling (scheduling, bookkeeping): fail the running
        requests -- the step's, as far as can be known -- check that what is left is consistent, and go
        on. Waiting requests keep their place. Raises if the state is not consistent: the caller must then
        stop this engine (its supervisor restarts it)."""
        log.error("engine step failed outside any one request: %r; failing the running requests", exc, exc_info=exc)
        if self.overlap is not None:
            self.overlap.abandon()
        outputs = [self._fail(seq, exc, "unattributed") for seq in list(self.scheduler.running)]
        self.check_integrity()
        self._update_gauges()
        return outputs

    def _prefetch_adapters(self) -> None:
        """Tell the adapter manager which adapters the next admissions need (the first distinct ones in
        queue order, as many as the host tier has room for beside the pinned ones): it loads those and
        evicts others first. A request asks for its adapter when it arrives, but with more distinct
        adapters queued than the host tier holds that load may have to wait; without asking again the
        request would wait forever, and asking for all of them at once would thrash the host tier."""
        if self.adapters is None or not self.scheduler.num_waiting:
            return
        window = min(self.adapters.host_room(), 2 * self.config.lora.max_loras)
        wanted: dict[str, AdapterRef] = {}
        for scanned, seq in enumerate(itertools.chain.from_iterable(self.scheduler.waiting.values()), 1):
            if seq.adapter is not None:
                wanted.setdefault(seq.adapter.content_id, seq.adapter)
            if len(wanted) >= window or scanned >= 8 * window:
                break
        self.adapters.want(list(wanted.values()))  # a failed load: _fail_adapter_loads refuses its requests

    def _fail_adapter_loads(self) -> list[RequestOutput]:
        """Requests waiting on an adapter that failed to load are refused with its specific error."""
        if self.adapters is None:
            return []
        failures = self.adapters.poll()
        if not failures:
            return []
        bad = {cid: exc for cid, exc in failures}
        out = []
        for seq in [s for q in self.scheduler.waiting.values() for s in q]:
            if seq.adapter is not None and seq.adapter.content_id in bad:
                self._finish(seq, "error")
                out.append(RequestOutput(seq.request_id, [], "", True, "error", seq.num_prompt_tokens, 0, 0, 0.0,
                                         error=adapter_error(bad[seq.adapter.content_id])))
        return out

    def _postprocess(self, plan: StepPlan, sampled: SamplerOutput | None, elapsed: float,
                     moved: set[Sequence] | frozenset = frozenset()) -> list[RequestOutput]:
        """`moved` (async scheduling): sequences preempted, finished or aborted after the step was planned --
        a finished one is skipped, a preempted one keeps the progress its preemption gave it."""
        now = time.monotonic()
        total = plan.num_batched_tokens
        self.stats.steps += 1
        self.stats.busy_seconds += elapsed
        self.stats.tokens += total
        self.scheduler.observe_step(total, elapsed)
        self.metrics.busy_seconds.inc(elapsed)
        self.metrics.step_time.observe(elapsed)
        outputs: list[RequestOutput] = []
        self._step_itls, self._step_tokens = [], 0  # _append_token's, into the metrics once at the end
        row = 0
        accepted = iter(accepted_lengths(sampled.token_ids, [s.draft for s in plan.scheduled if s.samples])
                        if sampled is not None and any(s.draft for s in plan.scheduled) else ())
        for s in plan.scheduled:
            seq = s.seq
            r = row
            row += s.samples * (1 + len(s.draft))
            n_accepted = next(accepted, 0) if s.samples else 0
            if seq.status is Status.FINISHED:
                continue  # aborted or finished while an async step ran
            try:  # one request's output handling (detokenize, stops, bookkeeping) fails only that request
                seq.compute_seconds += elapsed * s.num_new_tokens / total
                if s.draft:  # never under async scheduling (EngineConfig refuses the pair)
                    outputs.append(self._append_verified(s, sampled, r, n_accepted, now))
                    continue
                if seq not in moved:
                    seq.num_computed_tokens = s.start + s.num_new_tokens
                    self.kv.commit(seq)
                if not s.samples:
                    continue
                assert sampled is not None
                token = sampled.token_ids[r]
                outputs.append(self._append_token(seq, token, _logprobs(seq, sampled, r), now))
            except Exception as exc:
                outputs.append(self._fail(seq, exc, "postprocess"))
        self.metrics.step_tokens(self._step_itls, self._step_tokens)
        return outputs

    def _append_verified(self, s, sampled: SamplerOutput, r: int, n_accepted: int, now: float) -> RequestOutput:
        """A speculative row (spec/verify.py): emit its accepted draft tokens and the token sampled after them
        -- each through the usual stop / length / min_tokens handling, stopping at the first that finishes
        the request -- then keep the KV of the accepted tokens only (the rejected ones' blocks are released)."""
        seq = s.seq
        self.spec.observe(seq, len(s.draft), n_accepted)  # before a finish reports the request's totals
        outs = []
        for j in range(n_accepted + 1):
            outs.append(self._append_token(seq, sampled.token_ids[r + j], _logprobs(seq, sampled, r + j), now))
            if outs[-1].finished:
                break
        if not seq.is_finished:
            seq.num_computed_tokens = s.start + 1 + n_accepted  # its last token, then the accepted drafts
            self.kv.commit(seq)
            self.kv.truncate(seq)
        out = outs[-1]
        out.new_token_ids = [t for o in outs for t in o.new_token_ids]
        out.new_text = "".join(o.new_text for o in outs)
        if out.logprobs is not None:
            out.logprobs = [lp for o in outs for lp in o.logprobs]
        return out

    def _append_token(self, seq: Sequence, token: int, lp, now: float) -> RequestOutput:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.ttft.observe(now - seq.arrival_time)
            self.metrics.tenant_ttft(seq.tenant).observe(now - seq.arrival_time)
        else:
            self._step_itls.append(now - seq.last_token_time)
        seq.last_token_time = now
        self._step_tokens += 1
        p = seq.params
        stream = self._streams.get(seq.request_id)
        n_out = seq.num_output_tokens
        past_min = n_out >= p.min_tokens
        reason = None
        text = ""
        stop_string = False
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.accept(token):  # the mask allowed it: an engine fault, this request's only
                raise RuntimeError(f"the grammar refused sampled token {token}")
            # A matcher terminates only by accepting a stop token (the grammar's are the eos ids): asking on
            # every token cost ~2 us a constrained row a step.
            grammar_done = token in self.eos_token_ids and seq.matcher.is_terminated
        if past_min and token in p.stop_token_ids:
            reason = "stop"
        elif (past_min and not p.ignore_eos and token in self.eos_token_ids) or grammar_done:
            reason = "stop"
        else:
            if stream is not None:
                text, stop_string = stream.stops.push(stream.decoder.push(token), check=past_min)
            if stop_string:
                reason = "stop"
            elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            if stream is not None and not stop_string:  # release held-back text: nothing can complete a stop string
                tail, stop_string = stream.stops.push(stream.decoder.flush(), check=past_min)
                text += tail if stop_string else tail + stream.stops.flush()
            self._finish(seq, reason)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=n_out,
            compute_seconds=seq.compute_seconds,
            logprobs=lp,
            clamped_from=seq.clamped_from,
            num_draft_tokens=seq.spec_drafted,
            num_accepted_tokens=seq.spec_accepted,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._seqs.pop(seq.request_id, None)
        self._streams.pop(seq.request_id, None)
        self.metrics.count_finished(reason)
        self.metrics.e2e.observe(time.monotonic() - seq.arrival_time)
        if seq.adapter is not None:
            self.metrics.count_adapter(seq.adapter.name or seq.adapter.content_id[:12], seq.num_tokens)
        if self.spec is not None:
            self.spec.forget(seq.request_id)
            if reason in ("stop", "length"):
                self.spec.finished(seq)
            if seq.spec_drafted:
                self.metrics.count_spec(seq.adapter and (seq.adapter.name or seq.adapter.content_id[:12]),
                                        seq.spec_drafted, seq.spec_accepted)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(self.scheduler.num_running)
        m.waiting.set(self.scheduler.num_waiting)
        m.set_tenant_waiting({k: s.waiting for k, s in self.scheduler.tenants.states.items()})
        m.kv_used.set(self.kv.pool.num_used)
        if self.kv.host is not None:
            m.host_blocks_used.set(self.kv.host.num_used)
        if (bw := self.preemption.copy_bytes_per_second) is not None:
            m.copy_bandwidth.set(bw)
        if (per_token := self.preemption.prefill_seconds_per_token) is not None:
            m.prefill_token_seconds.set(per_token)
        if self.adapters is not None:
            a = self.adapters
            m.lora_slots_used.set(a.num_slots_used)
            m.lora_slots_total.set(self.config.lora.max_loras)
            m.lora_host_cached.set(a.num_host_resident)
            m.lora_slot_loads.inc(a.slot_loads - self._slot_loads_seen)
            self._slot_loads_seen = a.slot_loads
            for ev in a.load_events:
                (m.lora_loads if ev.ok else m.lora_load_failures).inc()
                if ev.ok:
                    m.lora_load_seconds.observe(ev.seconds)
            a.load_events.clear()

    # -- checks --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.adapters is not None:
            self.adapters.check_integrity(self.scheduler.running)
        live = {s.request_id for s in self.scheduler.running} | {
            s.request_id for q in self.scheduler.waiting.values() for s in q
        }
        assert live == set(self._seqs), (live, set(self._seqs))
        if self.spec is not None:
            self.spec.check_integrity(live)
        self.scheduler.tenants.check_integrity(self.scheduler.running,
                                               (s for q in self.scheduler.waiting.values() for s in q))
        for seq in self.scheduler.running:
            table = self.kv.block_table(seq.request_id)
            assert len(table) * self.kv.block_size >= seq.num_computed_tokens
            assert not self.kv.is_swapped(seq.request_id)
        for seq in itertools.chain.from_iterable(self.scheduler.waiting.values()):
            # A waiting sequence pins no device memory: a swapped-out one holds host blocks only.
            assert not self.kv.block_table(seq.request_id), f"waiting {seq.request_id} holds device blocks"
            assert seq.num_computed_tokens == 0
        waiting = {s.request_id for q in self.scheduler.waiting.values() for s in q}
        assert self.kv.swapped_request_ids <= waiting, "host blocks held for a request that is not waiting"
        if not self._seqs:
            assert self.kv.pool.num_used == 0, f"{self.kv.pool.num_used} KV blocks leaked"
            assert self.kv.host is None or self.kv.host.num_used == 0, f"{self.kv.host.num_used} host blocks leaked"

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion in one continuous batch (offline use: tests and benchmarks)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{i}-{self._rng.getrandbits(32):08x}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.error is not None:
                    raise out.error
                results[out.request_id].extend(out.new_token_ids)
            if self.last_plan_empty and self.has_unfinished():
                self.wake.wait(0.05)  # waiting on an adapter load
                self.wake.clear()
        return [results[rid] for rid in ids]


def _logprobs(seq: Sequence, sampled: SamplerOutput, r: int) -> list[TokenLogprob] | None:
    """Row r's sampled token with its logprob and the request's top alternatives, when it asked for them."""
    if seq.params.logprobs is None or sampled.logprobs is None:
        return None
    k = seq.params.logprobs
    top = list(zip(sampled.top_ids[r][:k], sampled.top_logprobs[r][:k])) if k else []
    return [TokenLogprob(sampled.token_ids[r], sampled.logprobs[r], top)]


def _kernel_name(kernel) -> str:
    from services.engine.kernels.attention_native import NativeAttention

    return "native" if isinstance(kernel, NativeAttention) else "triton"


def adapter_error(exc: AdapterFormatError) -> InvalidRequest:
    return InvalidRequest(f"adapter refused: {exc.message}", "model", exc.code, status=400)



def validate_request(prompt_token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                     block_size: int, num_blocks: int) -> None:
    """The checks every request passes before it is queued: the engine's own, and a front-end's (which knows
    these figures from the core's `EngineInfo`) so that a bad request never crosses to the core."""
    if params.guide is not None:
        Guide.parse(params.guide, "response_format")
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty", "prompt")
    check_prompt_ids(prompt_token_ids, vocab_size)
    params.check_for_model(vocab_size)
    if n >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {n} tokens.",
            "messages", code="context_length_exceeded",
        )
    if n + params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion).",
            "max_tokens", code="context_length_exceeded",
        )
    blocks = -(-(n + params.max_tokens) // block_size)
    if blocks > num_blocks:
        raise InvalidRequest(
            f"the request needs {blocks} KV blocks but this engine has {num_blocks}",
            "max_tokens", code="context_length_exceeded",
        )
