"""The engine loop end to end on a tiny random model: batching, chunked prefill, preemption, prefix cache,
sampling, logprob parity, stops, priorities and hot weight updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.engine import EngineConfig, FinishReason
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import ModelRunner, SequenceChunk
from tether.engine.sampling import SamplingParams
from tether.errors import ConfigError
from tether.kernels import int8_gemm
from tether.kernels.attention import AttentionKernel, kernel_for
from tether.models import QuantizedLinear, load
from tether.testing import make_tiny_model

BLOCK = 4
PROMPTS = [[5, 9, 13, 2 + i, 7, 11, 3 * i + 1, 8, 6][: 3 + 2 * i] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Qwen3 because the tiny random Llama degenerates into repeating one token, which would hide mistakes.
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", seed=0)


def make_engine(
    path: Path, num_blocks: int = 64, max_tokens_per_step: int = 16, max_seqs: int = 8, **kwargs: object
) -> LLMEngine:
    model, tokenizer, _ = load(path)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens_per_step,
        max_model_len=64,
    )
    return LLMEngine(runner, config, detokenize=lambda ids: str(tokenizer.decode(ids)), **kwargs)  # type: ignore[arg-type]


def reference_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model, _, _ = load(path)
    return ModelRunner(model, num_blocks=128, block_size=BLOCK).generate_greedy(prompts, new_tokens)


GREEDY = SamplingParams(max_tokens=10, temperature=0)


def test_greedy_batch_matches_one_at_a_time_reference(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [o.completions[0].token_ids for o in outputs] == reference_greedy(tiny_path, PROMPTS, 10)
    assert all(o.completions[0].finish_reason is FinishReason.LENGTH for o in outputs)


def test_requests_joining_mid_run_get_the_same_tokens(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    engine.add_request("a", PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    engine.add_request("b", PROMPTS[3], GREEDY)
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.completions[0].token_ids
    expected = reference_greedy(tiny_path, [PROMPTS[0], PROMPTS[3]], 10)
    assert [finished["a"], finished["b"]] == expected


def test_preemption_under_a_small_cache_loses_no_request(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, num_blocks=16, max_seqs=4)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))
    assert engine.scheduler.num_preemptions > 0
    assert [o.completions[0].token_ids for o in outputs] == reference_greedy(tiny_path, PROMPTS, 24)


def test_shared_prefix_is_served_from_the_cache(tiny_path: Path) -> None:
    prefix = list(range(20, 36))
    engine = make_engine(tiny_path)
    first = engine.generate([[*prefix, 40]], GREEDY)[0]
    second = engine.generate([[*prefix, 41]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 16
    assert second.completions[0].token_ids == reference_greedy(tiny_path, [[*prefix, 41]], 10)[0]


def test_logprobs_equal_a_full_recomputation(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11)
    output = engine.generate([PROMPTS[2]], params)[0].completions[0]
    runner = engine.runner
    tokens = PROMPTS[2] + output.token_ids
    table = list(range(40, 40 + (len(tokens) + BLOCK - 1) // BLOCK))
    logits = torch.stack(
        [
            runner.step([SequenceChunk(tokens[: end + 1], 0, table, needs_logits=True)])[0]
            for end in range(len(PROMPTS[2]) - 1, len(tokens) - 1)
        ]
    )
    expected = torch.log_softmax(logits / 0.8, dim=-1).gather(1, torch.tensor(output.token_ids)[:, None])[
        :, 0
    ]
    assert torch.allclose(torch.tensor(output.logprobs), expected, atol=1e-5)


def test_seeded_samples_are_reproducible_and_n_samples_differ(tiny_path: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.5, top_k=20, top_p=0.95, seed=7, n=3)
    first = make_engine(tiny_path).generate([PROMPTS[1]], params)[0]
    second = make_engine(tiny_path).generate([PROMPTS[1]], params)[0]
    runs = [[c.token_ids for c in output.completions] for output in (first, second)]
    assert runs[0] == runs[1]
    assert len({tuple(tokens) for tokens in runs[0]}) > 1
    assert all(len(c.logprobs) == len(c.token_ids) and max(c.logprobs) <= 0 for c in first.completions)


def test_stop_token_and_stop_string_finish_a_completion(tiny_path: Path) -> None:
    reference = reference_greedy(tiny_path, [PROMPTS[0]], 10)[0]
    engine = make_engine(tiny_path)
    stopped = engine.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(reference[3],))
    )[0].completions[0]
    assert stopped.token_ids == reference[: reference.index(reference[3]) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    full_text = engine.generate([PROMPTS[0]], GREEDY)[0].completions[0].text
    stop = full_text[len(full_text) // 2 :][:2]
    cut = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0, stop=(stop,)))[0]
    assert cut.completions[0].finish_reason is FinishReason.STOP
    assert cut.completions[0].text == full_text[: full_text.find(stop)]


def test_higher_priority_finishes_first_when_seats_are_scarce(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, max_seqs=1)
    engine.add_request("low", PROMPTS[0], GREEDY, priority=0)
    engine.add_request("high", PROMPTS[1], GREEDY, priority=5)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_weight_update_invalidates_the_prefix_cache_and_tags_versions(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    before = engine.generate([PROMPTS[3]], GREEDY)[0]
    params = dict(engine.named_parameters())
    name = next(n for n in params if n.endswith("mlp.down_proj.weight"))
    engine.update_weights({name: params[name] * 3})
    after = engine.generate([PROMPTS[3]], GREEDY)[0]
    assert after.num_cached_tokens == 0
    assert engine.weight_stats.num_prefix_cache_invalidations == 1
    assert before.completions[0].versions == [0] * 10 and after.completions[0].versions == [1] * 10
    assert after.completions[0].logprobs != before.completions[0].logprobs


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", 0),
        ("min_p", 1.0),
        ("n", 0),
        ("stop", ("",)),
    ],
)
def test_bad_sampling_parameters_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"sampling: {field} = "):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_the_int8_kernel_gives_the_greedy_tokens_of_the_dequantized_float_matmul(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, block_size=BLOCK, quantization="int8")
    with_kernel = engine.generate(PROMPTS, GREEDY)
    assert any(m.packed_copies for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear))
    monkeypatch.setattr(int8_gemm, "supports", lambda x: False)  # every projection takes F.linear
    engine, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, block_size=BLOCK, quantization="int8")
    without = engine.generate(PROMPTS, GREEDY)
    assert [o.completions[0].token_ids for o in with_kernel] == [o.completions[0].token_ids for o in without]
    for kernel, dequantized in zip(with_kernel, without, strict=True):
        torch.testing.assert_close(kernel.completions[0].logprobs, dequantized.completions[0].logprobs)


def test_a_float16_kv_cache_beside_float32_weights_holds_twice_the_blocks_and_their_greedy_tokens(
    tiny_path: Path,
) -> None:
    engine, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, block_size=BLOCK)
    half, _ = LLMEngine.from_pretrained(
        tiny_path, kv_cache_mib=1, block_size=BLOCK, kv_cache_dtype=torch.float16
    )
    assert half.runner.kv_cache.keys[0].dtype == torch.float16
    assert next(half.runner.model.parameters()).dtype == torch.float32
    assert half.runner.kv_cache.num_blocks == 2 * engine.runner.kv_cache.num_blocks
    # A random tiny model has near-ties that K/V's float16 rounding may flip: each completion agrees with the
    # float32 cache's, token and log-probability, at least for its first tokens and up to where it turns.
    for ours, theirs in zip(engine.generate(PROMPTS, GREEDY), half.generate(PROMPTS, GREEDY), strict=True):
        a, b = ours.completions[0], theirs.completions[0]
        same = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
            len(a.token_ids),
        )
        assert same >= 3, (a.token_ids, b.token_ids)
        torch.testing.assert_close(a.logprobs[:same], b.logprobs[:same], atol=1e-2, rtol=0)
        assert a.logprobs[:same] != b.logprobs[:same]  # rounded K/V: not the float32 cache's bits


def test_a_bfloat16_kv_cache_beside_float32_weights_attends_through_torch(tiny_path: Path) -> None:
    """No C kernel reads bfloat16: the torch path (CUDA's too) upcasts the cache to the queries' float32."""
    engine, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, block_size=BLOCK)
    rounded, _ = LLMEngine.from_pretrained(
        tiny_path, kv_cache_mib=1, block_size=BLOCK, kv_cache_dtype=torch.bfloat16
    )
    cache = rounded.runner.kv_cache.keys[0]
    assert cache.dtype == torch.bfloat16
    assert kernel_for(torch.zeros(1, 1, cache.shape[-1]), cache, cache) is AttentionKernel.TORCH_SDPA
    first = [o.completions[0] for o in engine.generate(PROMPTS, GREEDY)]
    second = [o.completions[0] for o in rounded.generate(PROMPTS, GREEDY)]
    assert [c.token_ids[:2] for c in first] == [c.token_ids[:2] for c in second]
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a.logprobs[:2], b.logprobs[:2], atol=5e-2, rtol=0)


def test_a_kv_cache_dtype_that_is_not_floating_point_is_refused(tiny_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype = torch\.int8: expected a floating point type"):
        LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, kv_cache_dtype=torch.int8)


def test_int8_engine_accepts_float_weight_updates(tiny_path: Path) -> None:
    engine, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, block_size=BLOCK, quantization="int8")
    before = engine.generate([PROMPTS[3]], GREEDY)[0].completions[0]
    model, _, _ = load(tiny_path)
    name = next(n for n, _ in model.named_parameters() if n.endswith("mlp.down_proj.weight"))
    weight = dict(model.named_parameters())[name]
    assert engine.update_weights({name: weight * 3}) == 1
    after = engine.generate([PROMPTS[3]], GREEDY)[0].completions[0]
    assert after.versions == [1] * len(after.token_ids)
    assert after.logprobs != before.logprobs


@pytest.mark.parametrize(("device", "same_thread"), [("cpu", True), ("meta", False)])
async def test_step_async_steps_in_the_loops_thread_on_cpu_and_in_a_worker_elsewhere(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, same_thread: bool
) -> None:
    """On the CPU the step runs in the loop's thread (one OpenMP pool, `models.omp_pools`) and other
    tasks still run between steps; on an accelerator (its device stood in for by the runner's) it runs
    in a worker thread, so the loop goes on meanwhile."""
    import asyncio
    import threading

    engine = make_engine(tiny_path)
    stepped_in: list[int] = []
    step = engine.step

    def recorded() -> list[object]:
        stepped_in.append(threading.get_ident())
        return step()  # type: ignore[return-value]

    monkeypatch.setattr(engine, "step", recorded)
    monkeypatch.setattr(LLMEngine, "device", property(lambda _: torch.device(device)))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    ticks = 0

    async def other_task() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_task())
    outputs = []
    while engine.has_unfinished():
        outputs.extend(await engine.step_async())
    ticker.cancel()
    assert outputs[-1].finished and len(outputs[-1].completions[0].token_ids) == 4
    assert len(stepped_in) == 4 and ticks >= 4
    assert (set(stepped_in) == {threading.get_ident()}) is same_thread
