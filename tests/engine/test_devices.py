"""The engine end to end on every placement (tests/placement.py: CPU float32 and bfloat16 everywhere,
CUDA where present) on a tiny random Qwen3: greedy and seeded decoding repeat, logprobs are the model's,
a weight update serves the new weights, and the CPU-only pieces stay off where they do not apply."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.placement import Placement
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import SequenceChunk
from tether.engine.sampling import SamplingParams
from tether.engine.speculative import SpeculativeConfig
from tether.kernels.attention import AttentionKernel, kernel_for
from tether.models import load
from tether.models.precision import DType

BLOCK = 4
PROMPTS = [[5, 9, 13, 2 + i, 7, 11, 3 * i + 1, 8, 6][: 3 + 2 * i] for i in range(4)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, n=2, seed=5, ignore_eos=True)


def logprob_tolerance(placement: Placement) -> float:
    """How far two computations of one logprob (other batch shapes) may differ: nothing on the CPU in
    float32 (`Placement.exact`), rounding for CUDA's float32, and bfloat16's 8-bit mantissa
    (measured up to 0.002 on the CPU)."""
    if placement.exact:
        return 1e-5
    return 1e-3 if placement.dtype == "float32" else 0.02


@pytest.fixture(scope="module")
def tiny_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3")


def make_engine(
    path: Path, placement: Placement, seed: int = 0, speculative: SpeculativeConfig | None = None
) -> LLMEngine:
    engine, _ = LLMEngine.from_pretrained(
        path,
        kv_cache_mib=1,
        device=placement.device,
        dtype=DType.parse(placement.dtype).torch,
        seed=seed,
        speculative=speculative,
        block_size=BLOCK,
        max_num_seqs=8,
        max_num_batched_tokens=16,  # prompts are prefilled in chunks, some over cached tokens
        max_model_len=64,
    )
    return engine


def full_logprobs(
    engine: LLMEngine, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    """[len(tokens), vocab] log-distributions of each token's position, from one forward over the whole
    sequence (another batch shape than the engine's chunked prefill and decoding)."""
    sequence = prompt + tokens
    chunk = SequenceChunk(sequence, 0, list(range(-(-len(sequence) // BLOCK))), all_logits=True)
    logits = engine.runner.step([chunk])[len(prompt) - 1 : -1].cpu()
    return torch.log_softmax(logits / temperature if temperature else logits, dim=-1)


def recomputed(engine: LLMEngine, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    logprobs = full_logprobs(engine, prompt, tokens, temperature)
    return [float(logprobs[i, token]) for i, token in enumerate(tokens)]


def test_weights_and_kv_cache_take_the_placements_dtype(tiny_path: Path, placement: Placement) -> None:
    engine = make_engine(tiny_path, placement)
    dtype = DType.parse(placement.dtype).torch
    assert {p.dtype for p in engine.runner.model.parameters()} == {dtype}
    assert engine.runner.kv_cache.keys[0].dtype is dtype
    assert engine.runner.device.type == placement.device
    expected_native = placement.device == "cpu" and placement.dtype == "float32"
    key, value = engine.runner.kv_cache.keys[0], engine.runner.kv_cache.values[0]
    query = torch.zeros((1, 4, key.shape[-1]), dtype=dtype, device=key.device)
    assert (kernel_for(query, key, value) is not AttentionKernel.TORCH_SDPA) == expected_native


def test_greedy_decoding_repeats_and_takes_the_models_argmax(tiny_path: Path, placement: Placement) -> None:
    first = [o.completions[0] for o in make_engine(tiny_path, placement).generate(PROMPTS, GREEDY)]
    engine = make_engine(tiny_path, placement)
    again = [o.completions[0] for o in engine.generate(PROMPTS, GREEDY)]
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    tolerance = logprob_tolerance(placement)
    for prompt, completion in zip(PROMPTS, again, strict=True):
        logprobs = full_logprobs(engine, prompt, completion.token_ids, 0)
        chosen = logprobs.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        assert completion.logprobs == pytest.approx(chosen.tolist(), abs=tolerance)
        # Greedy took a most likely token: none is more likely by more than the dtype's rounding.
        assert bool((chosen >= logprobs.max(dim=-1).values - tolerance).all())


def test_seeded_sampling_repeats_and_reports_the_models_logprobs(
    tiny_path: Path, placement: Placement
) -> None:
    engine = make_engine(tiny_path, placement)
    engine.add_request("probe", PROMPTS[1], SAMPLED)
    generators = engine._requests["probe"].generators
    assert [g.device.type for g in generators if g is not None] == [placement.device] * SAMPLED.n
    engine.abort("probe")
    first = make_engine(tiny_path, placement).generate(PROMPTS, SAMPLED)
    again = engine.generate(PROMPTS, SAMPLED)
    runs = [[[c.token_ids for c in o.completions] for o in outputs] for outputs in (first, again)]
    assert runs[0] == runs[1]
    assert any(len({tuple(t) for t in samples}) > 1 for samples in runs[0])  # the n samples differ
    tolerance = logprob_tolerance(placement)
    for prompt, output in zip(PROMPTS, again, strict=True):
        for completion in output.completions:
            expected = recomputed(engine, prompt, completion.token_ids, SAMPLED.temperature)
            assert completion.logprobs == pytest.approx(expected, abs=tolerance)


def test_speculative_sampling_draws_with_the_requests_generators(
    tiny_path: Path, placement: Placement
) -> None:
    """Drafts are verified on the CPU (a few rows) with generators on the placement's device."""
    repetitive = [[7, 8, 9, 10] * 4, [3, 4, 5] * 5]
    speculative = SpeculativeConfig(num_speculative_tokens=3)
    engines = [make_engine(tiny_path, placement, speculative=speculative) for _ in range(2)]
    runs = [engine.generate(repetitive, SAMPLED) for engine in engines]
    assert engines[0].spec_stats.num_drafted_tokens > 0
    tokens = [[[c.token_ids for c in o.completions] for o in outputs] for outputs in runs]
    assert tokens[0] == tokens[1]
    assert all(len(c.token_ids) == SAMPLED.max_tokens for o in runs[0] for c in o.completions)


def test_a_weight_update_serves_exactly_the_new_weights(tiny_path: Path, placement: Placement) -> None:
    other, _, _ = load(tiny_path)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.5)  # float32 tensors on the CPU, as a learner sends them
    engine = make_engine(tiny_path, placement)
    before = engine.generate(PROMPTS, GREEDY)
    engine.update_weights(dict(other.named_parameters()))
    after = engine.generate(PROMPTS, GREEDY)
    fresh = make_engine(tiny_path, placement)
    fresh.runner.update_weights(dict(other.named_parameters()))
    expected = fresh.generate(PROMPTS, GREEDY)
    assert [o.completions[0].versions for o in after] == [[1] * GREEDY.max_tokens] * len(PROMPTS)
    assert [o.completions[0].logprobs for o in after] == [o.completions[0].logprobs for o in expected]
    assert [o.completions[0].logprobs for o in after] != [o.completions[0].logprobs for o in before]


@pytest.mark.cuda
def test_cuda_attention_runs_on_flash_or_memory_efficient_kernels(tiny_path: Path) -> None:
    """With SDPA's math fallback ruled out, prefill (fresh and over cached tokens) and decode still run:
    no call is shaped so that only the math kernel takes it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for dtype in ("float32", "bfloat16"):
        engine = make_engine(tiny_path, Placement("cuda", dtype))
        with sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        ):
            outputs = engine.generate(PROMPTS, GREEDY)
        assert all(len(o.completions[0].token_ids) == GREEDY.max_tokens for o in outputs)
