"""`LLMEngine`: one step is schedule, run the model, sample, then report back to the scheduler.

Requests carry token ids in and out (the engine never re-tokenizes); text is produced only for stop
strings and for callers that ask, through the `detokenize` function given at construction. Every sampled
token records its logprob and the policy version (weights) that produced it; what a weight update does to
requests in flight is the configured `UpdatePolicy` (`weight_update.py`). Not thread-safe: one loop calls
`add_request`, `abort`, `step` and `update_weights`. With a `SpeculativeConfig`, each decoding sequence's
step verifies draft tokens in the same forward pass and may emit several tokens. A request with
`SamplingParams.structured` follows its grammar (`grammar.py`): each sample has its own matcher, whose
mask is computed while the forward pass runs and applied to that sample's row before drawing; it stops
when the grammar is complete. The reported logprob stays the unmasked model's (`sampling.py`).
Structured sequences are never drafted for (a speculative engine decodes them one token a step).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tether.engine.block_manager import BlockManager
from tether.engine.config import EngineConfig
from tether.engine.context_limits import kv_cache_blocks, resolve_max_model_len
from tether.engine.grammar import GrammarCompiler, TokenMasks, compile_grammar
from tether.engine.kv_tiers import KVTiers, KVTierStats, tier_stats
from tether.engine.model_runner import ModelRunner, SequenceChunk
from tether.engine.request import Completion, EngineRequest, RequestOutput, sample_seeds
from tether.engine.sampling import SamplingParams, sample_rows, top_alternatives
from tether.engine.scheduler import RequestError, Scheduler
from tether.engine.sequence import FinishReason, Sequence
from tether.engine.speculative import (
    Draft,
    DraftRequest,
    Proposer,
    SpeculativeConfig,
    SpeculativeStats,
    make_proposer,
    verify,
)
from tether.engine.weight_update import (
    NamedTensors,
    UpdatePolicy,
    UpdateQueue,
    WeightUpdateConfig,
    WeightUpdateStats,
    check_named_tensors,
    check_version,
    parameter_shapes,
)
from tether.errors import ConfigError
from tether.kernels.blockwise import LongChunkAttention
from tether.models import load
from tether.models.config import ModelConfig, RopeScaling
from tether.models.governor import ThreadGovernor
from tether.models.host_heap import keep_freed_memory
from tether.models.loader import resolve

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Completion", "LLMEngine", "RequestOutput"]


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        seed: int = 0,
        speculative: SpeculativeConfig | None = None,
        weight_update: WeightUpdateConfig | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        if config.num_blocks > runner.kv_cache.num_blocks or config.block_size != runner.block_size:
            raise ValueError(
                f"engine config ({config.num_blocks} blocks of {config.block_size}) does not fit the "
                f"runner's KV cache ({runner.kv_cache.num_blocks} blocks of {runner.block_size})"
            )
        self.runner = runner
        # On the CPU each decode step would otherwise fault its logits and activations in afresh
        # (`models.host_heap`): 15,328 faults a step for SmolLM2 at 32 streams, 138 ms a step against 101-110.
        self.keeps_freed_memory = runner.device.type == "cpu" and keep_freed_memory()
        runner.set_lanes(config.lanes)
        if config.adapt_threads and runner.device.type == "cpu":
            runner.governor = ThreadGovernor()
        self.config = config
        self.block_manager = BlockManager.from_config(config)
        self.tiers = KVTiers.for_engine(
            config, runner.kv_cache, self.block_manager, runner.config, runner.model.named_parameters
        )
        """Host and disk KV tiers under the device cache, when the config asks for any."""
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            None if self.tiers is None else self.tiers.choose_preemption,
            kv_window=runner.config.kv_window,
        )
        runner.long_chunks = LongChunkAttention(config.attention_block_tokens, config.blockwise_min_context)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.policy_version = 0
        """Version of the weights in the model now; `update_weights` advances it."""
        self.weight_update = weight_update or WeightUpdateConfig()
        self._updates = UpdateQueue()
        self._held: dict[str, Sequence] = {}  # added behind a pending update, not yet in the scheduler
        self._num_updates = 0
        self._num_invalidations = 0
        self._num_retries = 0
        self._num_recomputed = 0
        self._requests: dict[str, EngineRequest] = {}
        self._seq_ids = itertools.count()
        self._seed = torch.Generator().manual_seed(seed)  # draws only the requests' seeds, on the CPU
        self.speculative = speculative
        self.spec_stats = SpeculativeStats()
        self._proposer: Proposer | None = None
        if speculative is not None:
            draft = speculative.draft_runner
            if draft is not None and draft.config.vocab_size != runner.config.vocab_size:
                raise ConfigError(
                    f"speculative: draft_runner has a vocabulary of {draft.config.vocab_size} tokens: "
                    f"expected the target's {runner.config.vocab_size}"
                )
            self._proposer = make_proposer(speculative)
        self.grammars = grammars
        """Compiles requests' `structured` grammars; without it a structured request is refused."""
        self._masks = None if grammars is None else TokenMasks(grammars.vocab_size)

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        cache_dir: Path | None = None,
        kv_cache_mib: int = 256,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        quantization: str | None = None,
        speculative: SpeculativeConfig | None = None,
        weight_update: WeightUpdateConfig | None = None,
        max_model_len: int | None = None,
        rope_scaling: RopeScaling | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        **engine_options: Any,
    ) -> tuple[LLMEngine, PreTrainedTokenizerBase]:
        """Load a model (a registered name or an HF folder) and size the KV cache to `kv_cache_mib`.

        `rope_scaling` replaces the model's own (`tether.models.load`); `max_model_len` is checked against
        the model's context limit and the cache (`context_limits`), None taking the default there.
        `kv_cache_dtype` stores K/V in another floating type than the weights' `dtype` (default: the same),
        as llama.cpp's float16 cache beside float32 weights: half the bytes decode attention reads on the
        CPU (float32 queries over a float16 cache take the C kernel) and twice the tokens per MiB."""
        if kv_cache_dtype is not None and not kv_cache_dtype.is_floating_point:
            raise ConfigError(f"kv_cache_dtype = {kv_cache_dtype}: expected a floating point type")
        kv_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        folder = resolve(path_or_name, cache_dir)
        model_config = ModelConfig.from_folder(folder)
        if rope_scaling is not None:
            model_config = model_config.with_rope_scaling(rope_scaling)
        block_size = int(engine_options.pop("block_size", 16))
        num_blocks = kv_cache_blocks(model_config, kv_cache_mib, block_size, kv_dtype)
        # before the weights load: a length the model or the cache cannot hold fails at once
        longest = resolve_max_model_len(model_config, max_model_len, kv_cache_mib, block_size, kv_dtype)
        model, tokenizer, model_config = load(
            folder, device=device, dtype=dtype, quantization=quantization, rope_scaling=rope_scaling
        )
        config = EngineConfig(
            num_blocks=num_blocks, block_size=block_size, max_model_len=longest, **engine_options
        )
        runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, kv_dtype=kv_dtype)
        grammars = GrammarCompiler.for_tokenizer(
            tokenizer, model_config.vocab_size, model_config.eos_token_ids
        )
        engine = cls(
            runner,
            config,
            eos_token_ids=model_config.eos_token_ids,
            detokenize=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
            seed=seed,
            speculative=speculative,
            weight_update=weight_update,
            grammars=grammars,
        )
        return engine, tokenizer

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        if params.stop and self.detokenize is None:
            raise RequestError("stop strings need an engine built with a detokenize function")
        grammar = None if params.structured is None else compile_grammar(self.grammars, params.structured)
        seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, priority=priority)
        self.scheduler.check(seq)
        if self._updates.hold(request_id):
            self._held[request_id] = seq
        else:
            self.scheduler.add(seq)
        output = RequestOutput(request_id, list(prompt_token_ids), [], 0)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seeds = sample_seeds(params, self._seed)
        request = EngineRequest(output, params, priority, seeds, stops, self.detokenize, grammar)
        request.restart(seq.seq_id, self.runner.device)
        self._requests[request_id] = request

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._held.pop(request_id, None)
        for seq in self.scheduler.abort(request_id):
            self._release_draft(seq)
        for completion in request.output.completions:
            if completion.finish_reason is None:
                completion.finish_reason = FinishReason.ABORT
        self._updates.forget(request_id)
        self._apply_ready_updates()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that gained tokens or finished in it."""
        self._apply_ready_updates()
        drafts = self._propose()
        if self.tiers is not None:
            self.tiers.promote(self.scheduler.waiting)
        plan = self.scheduler.schedule({seq_id: draft.token_ids for seq_id, draft in drafts.items()})
        if self.tiers is not None:
            self.tiers.apply(plan)  # before any block is written: freed and evicted blocks' KV goes out
        if plan.is_empty:
            return []
        if plan.copies:
            self.runner.kv_cache.copy_blocks(plan.copies)
        for chunk in plan.chunks:
            seq = self.scheduler.get(chunk.seq_id)
            if seq is not None:
                request = self._requests[seq.request_id]
                request.output.num_cached_tokens = max(
                    request.output.num_cached_tokens, seq.num_cached_tokens
                )
        sampled: dict[int, int | list[int] | None] = {}
        finished: dict[int, FinishReason] = {}
        touched: dict[str, EngineRequest] = {}
        offset = 0
        draws: list[tuple[int, SamplingParams, torch.Generator | None]] = []
        targets: list[tuple[EngineRequest, int]] = []
        verifies: list[tuple[EngineRequest, Sequence, int, tuple[int, ...]]] = []
        for chunk in (c for c in plan.chunks if c.samples):
            row = offset
            offset += len(chunk.draft_token_ids) + 1
            seq = self.scheduler.get(chunk.seq_id)
            assert seq is not None
            request = self._requests[seq.request_id]
            touched[seq.request_id] = request
            if chunk.draft_token_ids:
                verifies.append((request, seq, row, chunk.draft_token_ids))
                continue
            for target in self._fork_samples(request, seq):
                index = request.seq_index[target]
                draws.append((row, request.params, request.generators[index]))
                targets.append((request, target))
        pending = (  # computed while the forward pass runs
            None if self._masks is None else self._masks.start([r.matcher(seq_id) for r, seq_id in targets])
        )
        started = time.perf_counter()
        logits = self.runner.step(
            [
                SequenceChunk(
                    c.token_ids,
                    c.start,
                    c.block_table,
                    needs_logits=c.samples,
                    all_logits=bool(c.draft_token_ids),
                )
                for c in plan.chunks
            ]
        )
        if self.tiers is not None:
            self.tiers.observe_step(plan, logits, time.perf_counter() - started)
        assert offset == len(logits), "every logits row belongs to a sampling chunk"
        for request, seq, row, scheduled in verifies:
            rows = logits[row : row + len(scheduled) + 1]
            self._verify(request, seq, drafts[seq.seq_id], scheduled, rows, sampled, finished)
        masks = None if pending is None or self._masks is None else self._masks.result(pending, logits.device)
        asks = [(i, (row, params)) for i, (row, params, _) in enumerate(draws) if params.top_logprobs]
        alternatives: dict[int, list[tuple[int, float]]] = dict(
            zip([i for i, _ in asks], top_alternatives(logits, [ask for _, ask in asks]), strict=True)
        )
        for i, ((request, target), (token, logprob)) in enumerate(
            zip(targets, sample_rows(logits, draws, masks), strict=True)
        ):
            sampled[target] = token
            reason = request.record(
                request.seq_index[target], token, logprob, alternatives.get(i), self.policy_version
            )
            if reason is not None:
                finished[target] = reason
        for seq in self.scheduler.update_from_output(plan, sampled, finished):
            self._release_draft(seq)
            request = self._requests[seq.request_id]
            completion = request.output.completions[request.seq_index[seq.seq_id]]
            completion.finish_reason = completion.finish_reason or seq.finish_reason
            touched[seq.request_id] = request
        if self.tiers is not None:
            self.tiers.persist_new_blocks()
        for request_id, request in touched.items():
            if request.output.finished:
                del self._requests[request_id]
                self._updates.forget(request_id)
        self._apply_ready_updates()
        return [request.output for request in touched.values()]

    def _propose(self) -> dict[int, Draft]:
        """Drafts for every decoding sequence, at most k and no more than its request can still emit."""
        if self.speculative is None or self._proposer is None:
            return {}
        requests = []
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens != 1 or seq.is_prefill:
                continue
            request = self._requests[seq.request_id]
            if request.grammar is not None:  # drafts would have to be checked against the grammar
                continue
            index = request.seq_index[seq.seq_id]
            room = min(
                request.params.max_tokens - len(request.output.completions[index].token_ids),
                self.config.max_model_len - seq.num_tokens,
            )
            num_tokens = min(self.speculative.num_speculative_tokens, room - 1)
            if num_tokens >= 1:
                requests.append(
                    DraftRequest(
                        seq.seq_id, seq.token_ids, num_tokens, request.params, request.generators[index]
                    )
                )
        return self._proposer.propose(requests) if requests else {}

    def _verify(
        self,
        request: EngineRequest,
        seq: Sequence,
        draft: Draft,
        scheduled: tuple[int, ...],
        rows: torch.Tensor,
        sampled: dict[int, int | list[int] | None],
        finished: dict[int, FinishReason],
    ) -> None:
        """Accept the scheduled drafts (maybe fewer than proposed) and record tokens up to the first stop."""
        assert list(scheduled) == draft.token_ids[: len(scheduled)]
        probs = None if draft.probs is None else draft.probs[: len(scheduled)]
        index = request.seq_index[seq.seq_id]
        verdict = verify(rows, Draft(list(scheduled), probs), request.params, request.generators[index])
        self.spec_stats.num_drafted_tokens += len(scheduled)
        self.spec_stats.num_accepted_tokens += verdict.num_accepted
        self.spec_stats.num_verify_steps += 1
        emitted: list[int] = []
        alternatives = top_alternatives(
            rows, [(i, request.params) for i in range(len(verdict.token_ids)) if request.params.top_logprobs]
        )
        for i, (token, logprob) in enumerate(zip(verdict.token_ids, verdict.logprobs, strict=True)):
            emitted.append(token)
            reason = request.record(
                index, token, logprob, alternatives[i] if alternatives else None, self.policy_version
            )
            if reason is not None:
                finished[seq.seq_id] = reason
                break
        sampled[seq.seq_id] = emitted

    def _release_draft(self, seq: Sequence) -> None:
        """Forget what a finished or aborted sequence held outside the scheduler: drafts, swapped KV."""
        if self._proposer is not None:
            self._proposer.release(seq.seq_id)
        if self.tiers is not None:
            self.tiers.release_swap(seq.seq_id)

    def _fork_samples(self, request: EngineRequest, seq: Sequence) -> list[int]:
        """The sequences that sample from this row: the first sample of n forks the other n - 1."""
        if request.forked or request.params.n == 1:
            return [seq.seq_id]
        request.forked = True
        targets = [seq.seq_id]
        for index in range(1, request.params.n):
            child = self.scheduler.fork(seq.seq_id, next(self._seq_ids))
            request.seq_index[child.seq_id] = index
            targets.append(child.seq_id)
        return targets

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None, priority: int = 0
    ) -> list[RequestOutput]:
        """Run prompts to completion through continuous batching; outputs in prompt order."""
        base = next(self._seq_ids)
        ids = [f"generate-{base}-{i}" for i in range(len(prompts))]
        outputs = {}
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.add_request(request_id, prompt, params, priority)
            outputs[request_id] = self._requests[request_id].output
        while any(request_id in self._requests for request_id in ids):
            self.step()
        return [outputs[request_id] for request_id in ids]

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        """Accept new weights as policy `version` (default: the latest applied or pending one plus one);
        returns how many tensors the update holds.

        Between steps only. The whole update is checked first (names, shapes, float dtypes, a version above
        every earlier one) and refused with `WeightUpdateError` before anything changes. Under `wait` with
        requests in flight it is queued (on a private copy of the tensors) and applied by a later `step`;
        otherwise it is applied now, and in-flight requests follow the configured policy.
        """
        latest = self.latest_version
        version = latest + 1 if version is None else version
        check_version(version, latest)
        tensors = check_named_tensors(parameter_shapes(self.runner.model), named_tensors)
        if self.weight_update.update_policy is UpdatePolicy.WAIT and self._requests:
            self._updates.push(version, tensors, self._requests)
        else:
            self._apply(version, tensors)
        return len(tensors)

    @property
    def latest_version(self) -> int:
        """The newest version accepted: pending under `wait`, else the one in the model."""
        pending = self._updates.latest_version
        return self.policy_version if pending is None else pending

    @property
    def device(self) -> torch.device:
        """Where the model computes."""
        return self.runner.device

    async def step_async(self) -> list[RequestOutput]:
        """`step` for an asyncio caller whose other tasks (tool calls) go on between steps. On the CPU it
        steps in the calling thread, then yields to the loop: a step in a worker thread would give the
        process a second OpenMP pool, and libgomp then stops idle workers spinning in every thread
        (`models.omp_pools`): 8 streams decoded 24% slower in `asyncio.to_thread` than in the loop's
        thread on 2 cores, and the learner beside it slowed alike. On an accelerator it steps in a worker
        thread, so the loop runs while the device computes."""
        if self.device.type != "cpu":
            return await asyncio.to_thread(self.step)
        outputs = self.step()
        await asyncio.sleep(0)
        return outputs

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output: token ids the engine can produce."""
        return int(self.runner.model.config.vocab_size)

    def set_batch_invariant(self, enabled: bool) -> None:
        """A row's logits the same whatever shares its batch (RL rollouts want that), at some speed."""
        self.runner.model.set_batch_invariant(enabled)

    def follow_cores(self, governor: ThreadGovernor | None) -> None:
        """Let `governor` set the stepping thread's torch threads before each step on CPU (a trainer
        generating and learning on one thread shares its own); None: the count stays as it is."""
        if self.runner.device.type == "cpu":
            self.runner.governor = governor

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights the engine decodes with, as a weight update names them."""
        return self.runner.model.named_parameters()

    def tier_stats(self) -> KVTierStats:
        """Where prefix KV was found, what moved between tiers and what was computed again."""
        return tier_stats(self.tiers, self.scheduler, self.block_manager.stats().prefix_cache_hits)

    @property
    def weight_stats(self) -> WeightUpdateStats:
        return WeightUpdateStats(
            policy_version=self.policy_version,
            num_updates_applied=self._num_updates,
            num_prefix_cache_invalidations=self._num_invalidations,
            num_pending_updates=len(self._updates),
            num_held_requests=len(self._held),
            num_retried_requests=self._num_retries,
            num_recomputed_sequences=self._num_recomputed,
        )

    def _apply_ready_updates(self) -> None:
        """Apply each queued update whose earlier requests have all finished, then admit what it held."""
        while (update := self._updates.pop_ready()) is not None:
            assert not self.scheduler.has_unfinished(), "requests admitted before the update have finished"
            self._apply(update.version, update.tensors)
            for request_id in update.held:
                self.scheduler.add(self._held.pop(request_id))

    def _apply(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.runner.update_weights(tensors)
        self.block_manager.invalidate_prefix_cache()
        if self.tiers is not None:
            self.tiers.invalidate(self.runner.model.named_parameters)
        self._num_invalidations += 1
        self._num_updates += 1
        self.policy_version = version
        if self.weight_update.update_policy is UpdatePolicy.ABORT_AND_RETRY:
            for request_id, request in self._requests.items():
                started = any(completion.token_ids for completion in request.output.completions)
                if started and request.output.retries < self.weight_update.max_retries:
                    self._retry(request_id, request)
        # What is still running (everything under pause_resume, partial prefills under abort_and_retry)
        # computes its KV again with the new weights before it samples.
        self._num_recomputed += len(self.scheduler.recompute_all())

    def _retry(self, request_id: str, request: EngineRequest) -> None:
        for seq in self.scheduler.abort(request_id):
            self._release_draft(seq)
        seq = Sequence(
            next(self._seq_ids), request_id, request.output.prompt_token_ids, priority=request.priority
        )
        self.scheduler.add(seq)
        request.restart(seq.seq_id, self.runner.device)
        request.output.retries += 1
        self._num_retries += 1
