"""Hot weight updates with requests in flight, on a tiny random Qwen3, under each policy: every request is
accounted for, every token carries the version whose weights produced its logprob (checked by recomputing
it from scratch with those weights), the prefix cache is invalidated once per version, and bad updates
change nothing. The async engine applies updates the same way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_maps import mapped_file, needs_proc_maps
from tether.engine import EngineConfig, FinishReason
from tether.engine.async_engine import AsyncEngine
from tether.engine.llm_engine import Completion, LLMEngine, RequestOutput
from tether.engine.model_runner import ModelRunner, SequenceChunk, WeightUpdateError
from tether.engine.sampling import SamplingParams
from tether.engine.weight_update import UpdatePolicy, WeightUpdateConfig
from tether.errors import ConfigError
from tether.models import load, pull

BLOCK = 4
NAME = "model.layers.0.mlp.down_proj.weight"
PROMPTS = [[5, 9, 13, 2 + i, 7, 11, 3 * i + 1, 8, 6][: 3 + 2 * i] for i in range(4)]
GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=7, temperature=0.8, n=2, seed=11, ignore_eos=True)
POLICIES = list(UpdatePolicy)


@pytest.fixture(scope="module")
def tiny_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def original(tiny_path: Path) -> torch.Tensor:
    model, _, _ = load(tiny_path)
    return dict(model.named_parameters())[NAME].detach().clone()


def weights(original: torch.Tensor, version: int) -> dict[str, torch.Tensor]:
    """Distinct weights per version, different enough that stale KV would change the logprobs."""
    return {NAME: original * (1 + 0.5 * version)}


def make_engine(path: Path, policy: UpdatePolicy | str, budget: int = 16, max_retries: int = 3) -> LLMEngine:
    model, _, _ = load(path)
    config = EngineConfig(
        num_blocks=64, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64
    )
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK)
    return LLMEngine(runner, config, weight_update=WeightUpdateConfig(policy, max_retries))


def recomputed_logprobs(
    runner: ModelRunner, original: torch.Tensor, prompt: list[int], completion: Completion, temperature: float
) -> list[float]:
    """Each token's logprob recomputed from an empty cache with the weights of its tagged version."""
    ids = prompt + completion.token_ids
    table = list(range(-(-len(ids) // BLOCK)))
    result = []
    for index, (token, version) in enumerate(zip(completion.token_ids, completion.versions, strict=True)):
        runner.update_weights(weights(original, version))
        logits = runner.step([SequenceChunk(ids[: len(prompt) + index], 0, table, all_logits=True)])
        row = logits[-1] / (temperature or 1.0)
        result.append(float(torch.log_softmax(row, dim=-1)[token]))
    return result


def assert_consistent(
    path: Path, original: torch.Tensor, outputs: dict[str, RequestOutput], params: dict[str, SamplingParams]
) -> None:
    model, _, _ = load(path)
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK)
    for request_id, output in outputs.items():
        for completion in output.completions:
            assert completion.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), request_id
            assert len(completion.versions) == len(completion.token_ids) == len(completion.logprobs)
            assert completion.versions == sorted(completion.versions), "versions never go back"
            expected = recomputed_logprobs(
                runner, original, output.prompt_token_ids, completion, params[request_id].temperature
            )
            assert completion.logprobs == pytest.approx(expected, abs=1e-4), (request_id, completion.versions)


def run_with_an_update_every_step(
    engine: LLMEngine, original: torch.Tensor
) -> tuple[dict[str, RequestOutput], dict[str, SamplingParams], int]:
    """Six requests (two join late, one samples n=2); new weights after every step until all finished."""
    params = {f"r{i}": GREEDY for i in range(len(PROMPTS))} | {"n2": SAMPLED, "late": GREEDY}
    prompts = {f"r{i}": prompt for i, prompt in enumerate(PROMPTS)} | {"n2": PROMPTS[2], "late": PROMPTS[3]}
    outputs: dict[str, RequestOutput] = {}
    for request_id in ("r0", "r1", "r2", "n2"):
        engine.add_request(request_id, prompts[request_id], params[request_id])
    steps = updates = 0
    while engine.has_unfinished():
        outputs |= {output.request_id: output for output in engine.step()}
        steps += 1
        if steps == 3:
            for request_id in ("r3", "late"):
                engine.add_request(request_id, prompts[request_id], params[request_id])
        version = engine.latest_version + 1
        assert engine.update_weights(weights(original, version), version=version) == 1
        updates += 1
        assert steps < 500, "the run must end"
    assert outputs.keys() == params.keys(), "every request is accounted for"
    return outputs, params, updates


@pytest.mark.parametrize("policy", POLICIES, ids=[p.value for p in POLICIES])
def test_an_update_every_step_loses_no_request_and_tags_every_token(
    tiny_path: Path, original: torch.Tensor, policy: UpdatePolicy
) -> None:
    # The budget holds the whole batch, so pause_resume can recompute its KV within the step after an update.
    engine = make_engine(tiny_path, policy, budget=256)
    outputs, params, updates = run_with_an_update_every_step(engine, original)
    assert_consistent(tiny_path, original, outputs, params)
    stats = engine.weight_stats
    assert stats.num_updates_applied == stats.num_prefix_cache_invalidations == updates
    assert stats.policy_version == updates and stats.num_pending_updates == stats.num_held_requests == 0
    retries = sum(o.retries for o in outputs.values())
    assert retries == stats.num_retried_requests
    mixed = {o.request_id for o in outputs.values() if any(len(c.policy_versions) > 1 for c in o.completions)}
    if policy is UpdatePolicy.WAIT:
        assert not mixed and retries == 0 and stats.num_recomputed_sequences == 0
    if policy is UpdatePolicy.PAUSE_RESUME:
        assert mixed == params.keys() and retries == 0 and stats.num_recomputed_sequences > 0
    if policy is UpdatePolicy.ABORT_AND_RETRY:  # mixed only once out of restarts: longer than an update
        assert mixed and mixed == {o.request_id for o in outputs.values() if o.retries == 3}


def test_pause_resume_keeps_the_partial_output_and_its_behaviour_logprobs(
    tiny_path: Path, original: torch.Tensor
) -> None:
    engine = make_engine(tiny_path, "pause_resume")
    engine.add_request("a", PROMPTS[3], GREEDY)
    for _ in range(4):
        [output] = engine.step()
    before = Completion(0, list(output.completions[0].token_ids), list(output.completions[0].logprobs))
    assert before.token_ids, "the prompt is prefilled and decoding has started"
    engine.update_weights(weights(original, 1))
    while engine.has_unfinished():
        engine.step()
    after = output.completions[0]
    assert after.token_ids[: len(before.token_ids)] == before.token_ids
    assert after.logprobs[: len(before.logprobs)] == before.logprobs
    assert after.policy_versions == (0, 1)
    assert engine.weight_stats.num_recomputed_sequences == 1


def test_abort_and_retry_reruns_from_the_prompt_with_the_same_seeds(
    tiny_path: Path, original: torch.Tensor
) -> None:
    engine = make_engine(tiny_path, "abort_and_retry", max_retries=1)
    engine.add_request("a", PROMPTS[1], SAMPLED)
    while not engine.step()[0].completions[0].token_ids:
        pass
    engine.update_weights(weights(original, 1))
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        results |= {o.request_id: o for o in engine.step()}
    fresh = make_engine(tiny_path, "wait")
    fresh.update_weights(weights(original, 1))
    [expected] = fresh.generate([PROMPTS[1]], SAMPLED)
    assert results["a"].retries == 1
    assert [c.token_ids for c in results["a"].completions] == [c.token_ids for c in expected.completions]
    assert [c.logprobs for c in results["a"].completions] == [c.logprobs for c in expected.completions]
    assert all(c.versions == [1] * len(c.token_ids) for c in results["a"].completions)


def test_abort_and_retry_stops_restarting_after_max_retries(tiny_path: Path, original: torch.Tensor) -> None:
    engine = make_engine(tiny_path, "abort_and_retry", max_retries=1)
    engine.add_request("a", PROMPTS[1], GREEDY)
    [output] = engine.step()
    for version in (1, 2):
        while len(output.completions[0].token_ids) < 2:
            engine.step()
        engine.update_weights(weights(original, version))
    while engine.has_unfinished():
        engine.step()
    assert output.retries == 1 and output.completions[0].policy_versions == (1, 2)
    assert_consistent(tiny_path, original, {"a": output}, {"a": GREEDY})


def test_wait_holds_new_requests_behind_the_update_and_applies_it_after_the_old_ones(
    tiny_path: Path, original: torch.Tensor
) -> None:
    engine = make_engine(tiny_path, "wait")
    engine.add_request("old", PROMPTS[0], GREEDY)
    engine.step()
    engine.update_weights(weights(original, 1))
    engine.add_request("new", PROMPTS[1], GREEDY)
    assert engine.policy_version == 0 and engine.latest_version == 1
    assert engine.weight_stats.num_held_requests == 1
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
            if output.request_id == "new":
                assert outputs["old"].finished, "held requests start only after the update"
    assert outputs["old"].completions[0].policy_versions == (0,)
    assert outputs["new"].completions[0].policy_versions == (1,)
    assert engine.weight_stats.num_prefix_cache_invalidations == 1


def test_aborting_the_last_old_request_applies_a_waiting_update(
    tiny_path: Path, original: torch.Tensor
) -> None:
    engine = make_engine(tiny_path, "wait")
    engine.add_request("old", PROMPTS[0], GREEDY)
    engine.step()
    engine.update_weights(weights(original, 1))
    engine.add_request("held", PROMPTS[1], GREEDY)
    engine.abort("old")
    assert engine.policy_version == 1 and engine.weight_stats.num_held_requests == 0
    while engine.has_unfinished():
        engine.step()
    assert engine.weight_stats.num_updates_applied == 1


def test_unknown_policy_is_refused_with_the_accepted_ones() -> None:
    with pytest.raises(ConfigError, match=r"'drain'.*'wait', 'pause_resume', 'abort_and_retry'"):
        WeightUpdateConfig("drain")


BAD_UPDATES: list[tuple[str, Callable[[torch.Tensor], object], dict[str, int], str]] = [
    (
        "unknown name",
        lambda w: [(NAME, w), ("model.layers.9.mlp.down_proj.weight", w)],
        {},
        "unknown parameter",
    ),
    ("wrong shape", lambda w: [(NAME, w), ("model.norm.weight", torch.ones(3))], {}, "has shape"),
    ("integer tensor", lambda w: {NAME: w.long()}, {}, "floating-point"),
    ("not a tensor", lambda w: {NAME: w.tolist()}, {}, "torch.Tensor"),
    ("twice the same name", lambda w: [(NAME, w), (NAME, w)], {}, "twice"),
    ("no tensors", lambda w: {}, {}, "at least one"),
    ("same version", lambda w: {NAME: w}, {"version": 0}, "greater than 0"),
    ("older version", lambda w: {NAME: w}, {"version": -3}, "greater than 0"),
]


@pytest.mark.parametrize("policy", POLICIES, ids=[p.value for p in POLICIES])
@pytest.mark.parametrize(
    ("update", "kwargs", "message"), [b[1:] for b in BAD_UPDATES], ids=[b[0] for b in BAD_UPDATES]
)
def test_bad_updates_are_rejected_whole(
    tiny_path: Path,
    original: torch.Tensor,
    policy: UpdatePolicy,
    update: Callable[[torch.Tensor], object],
    kwargs: dict[str, int],
    message: str,
) -> None:
    engine = make_engine(tiny_path, policy)
    engine.add_request("a", PROMPTS[2], GREEDY)
    engine.step()
    stats = engine.weight_stats
    with pytest.raises(WeightUpdateError, match=message):
        engine.update_weights(update(original * 7), **kwargs)  # type: ignore[arg-type]
    assert torch.equal(dict(engine.named_parameters())[NAME], original)
    assert engine.weight_stats == stats and engine.latest_version == 0
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("every_step", [True, False], ids=["every-step", "first-and-last"])
@pytest.mark.parametrize("policy", POLICIES, ids=[p.value for p in POLICIES])
async def test_async_engine_applies_updates_between_steps_under_the_policy(
    tiny_path: Path, original: torch.Tensor, policy: UpdatePolicy, every_step: bool
) -> None:
    """Also when a caller takes only the first delta, each restart's and the last (`every_step` False):
    the same tokens, logprobs and versions arrive, in at most 2 deltas a run."""
    engine = make_engine(tiny_path, policy)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = {f"r{i}": GREEDY for i in range(len(PROMPTS))} | {"n2": SAMPLED}
    prompts = {f"r{i}": prompt for i, prompt in enumerate(PROMPTS)} | {"n2": PROMPTS[2]}

    async def consume(request_id: str) -> RequestOutput:
        """Rebuild the request from its deltas, starting again whenever it was retried."""
        n = params[request_id].n
        output = RequestOutput(request_id, prompts[request_id], [Completion(i) for i in range(n)], 0)
        deltas = 0
        async for delta in async_engine.generate(
            prompts[request_id], params[request_id], request_id=request_id, every_step=every_step
        ):
            deltas += 1
            if delta.retries != output.retries:
                output.completions = [Completion(i) for i in range(n)]
                output.retries = delta.retries
            for change in delta.completions:
                completion = output.completions[change.index]
                completion.token_ids += change.token_ids
                completion.logprobs += change.logprobs
                completion.versions += change.versions
                completion.finish_reason = change.finish_reason
        if not every_step:
            assert deltas <= 2 * (output.retries + 1), f"{request_id}: {deltas} deltas"
        return output

    try:
        tasks = {request_id: asyncio.create_task(consume(request_id)) for request_id in params}
        applied = []
        for version in range(1, 4):
            await asyncio.sleep(0.02)
            applied.append(await async_engine.update_weights(weights(original, version)))
        outputs = {request_id: await task for request_id, task in tasks.items()}
        with pytest.raises(WeightUpdateError, match="greater than 3"):
            await async_engine.update_weights(weights(original, 2), version=2)
    finally:
        async_engine.shutdown()
    assert applied == [1, 2, 3]
    assert_consistent(tiny_path, original, outputs, params)
    assert async_engine.stats.weights is not None
    assert async_engine.stats.weights.num_prefix_cache_invalidations == 3
    assert sum(o.retries for o in outputs.values()) == async_engine.stats.weights.num_retried_requests


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return pull("smollm2-135m-instruct", Path(__file__).resolve().parents[2] / ".tether" / "cache")


@pytest.mark.slow
def test_pause_resume_on_smollm2_continues_with_recomputed_kv(smollm2_path: Path) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(
        smollm2_path, kv_cache_mib=64, max_model_len=256, weight_update=WeightUpdateConfig("pause_resume")
    )
    original = dict(engine.named_parameters())[NAME].detach().clone()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs: dict[str, RequestOutput] = {}
    for i, question in enumerate(["Capital of France?", "Two plus two?", "Name a colour."]):
        messages = [{"role": "user", "content": question}]
        prompt: Any = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        engine.add_request(f"q{i}", [int(t) for t in prompt], params)
    steps = 0
    while engine.has_unfinished():
        outputs |= {output.request_id: output for output in engine.step()}
        steps += 1
        if steps % 4 == 0:
            engine.update_weights(weights(original, steps // 4))
    assert all(len(c.policy_versions) > 1 for o in outputs.values() for c in o.completions)
    assert_consistent(smollm2_path, original, outputs, dict.fromkeys(outputs, params))


@needs_proc_maps
def test_a_first_update_moves_the_weight_off_the_checkpoints_file_and_later_ones_write_in_place(
    tiny_path: Path, original: torch.Tensor
) -> None:
    model, _, _ = load(tiny_path)
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK)
    param = dict(model.named_parameters())[NAME]
    assert mapped_file(param.data_ptr()).endswith(".safetensors")  # what load gives
    runner.update_weights(weights(original, 1))
    assert not mapped_file(param.data_ptr()).endswith(".safetensors")
    assert torch.equal(param, weights(original, 1)[NAME])
    moved = param.data_ptr()
    runner.update_weights(weights(original, 2))
    assert param.data_ptr() == moved and torch.equal(param, weights(original, 2)[NAME])
