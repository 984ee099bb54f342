"""The sampler's draw: it follows the distribution, a seed fixes it, and it works whatever device the
generator is on relative to the logits (the crash of CPU generators meeting CUDA logits)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
import torch

import tether
from tether.engine import sampling
from tether.engine.sampling import SamplingParams, draw, probabilities, sample, sample_rows, uniform

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]
# (logits, generator): the pairs that differ are the ones torch.multinomial refuses.
PAIRS = [
    ("cpu", "cpu"),
    pytest.param("cuda", "cpu", marks=[pytest.mark.cuda, CUDA]),
    pytest.param("cpu", "cuda", marks=[pytest.mark.cuda, CUDA]),
    pytest.param("cuda", "cuda", marks=[pytest.mark.cuda, CUDA]),
]
LOGITS = torch.tensor([1.5, 0.2, -0.5, 1.0, 0.0, -1.0, 0.7, -0.2])
SAMPLED = SamplingParams(temperature=0.9, top_k=5)


def seeded(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def total_variation(counts: Counter[int], probs: torch.Tensor) -> float:
    draws = sum(counts.values())
    return 0.5 * sum(abs(counts.get(i, 0) / draws - float(p)) for i, p in enumerate(probs))


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_distribution_and_never_pick_a_zero_weight_token(device: str) -> None:
    probs = probabilities(LOGITS[None].to(device), SAMPLED)[0]
    assert int((probs == 0).sum()) == 3  # non-vacuous: top-k left tokens that must never come out
    generator = seeded(device, 0)
    counts = Counter(draw(probs, generator) for _ in range(4000))
    assert all(float(probs[token]) > 0 for token in counts)
    assert total_variation(counts, probs.cpu()) < 0.03


def test_weights_need_not_be_normalised() -> None:
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0])
    generator = seeded("cpu", 2)
    counts = Counter(draw(weights, generator) for _ in range(3000))
    assert set(counts) == {1, 3}
    assert counts[1] / sum(counts.values()) == pytest.approx(0.75, abs=0.03)


def test_a_draw_at_the_top_of_the_unit_interval_stays_on_a_token_of_positive_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    largest_below_one = torch.nextafter(
        torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    )
    monkeypatch.setattr(sampling, "uniform", lambda generator, device: largest_below_one)
    assert draw(torch.tensor([0.3, 0.7, 0.0, 0.0]), None) == 1


@pytest.mark.parametrize(("logits_device", "generator_device"), PAIRS)
def test_sampling_works_with_the_generator_on_any_device(logits_device: str, generator_device: str) -> None:
    logits = LOGITS.to(logits_device)
    first = [sample(logits, SAMPLED, seeded(generator_device, seed))[0] for seed in range(20)]
    again = [sample(logits, SAMPLED, seeded(generator_device, seed))[0] for seed in range(20)]
    assert first == again
    assert len(set(first)) > 1
    # The token depends on the generator's uniform only, not on where the logits are.
    on_cpu = [sample(LOGITS, SAMPLED, seeded(generator_device, seed))[0] for seed in range(20)]
    assert first == on_cpu
    rows = torch.stack([logits, logits.flip(0)])
    draws = [(0, SAMPLED, seeded(generator_device, 3)), (1, SamplingParams(temperature=0), None)]
    [(token, logprob), (greedy, _)] = sample_rows(rows, draws)
    assert token == sample(logits, SAMPLED, seeded(generator_device, 3))[0]
    assert logprob == pytest.approx(float(torch.log_softmax(LOGITS / 0.9, dim=-1)[token]), abs=1e-5)
    assert greedy == int(LOGITS.flip(0).argmax())


@pytest.mark.parametrize(("logits_device", "generator_device"), PAIRS)
def test_the_uniform_is_made_on_the_generators_device_and_lands_on_the_logits(
    logits_device: str, generator_device: str
) -> None:
    value = uniform(seeded(generator_device, 5), torch.device(logits_device))
    assert value.device.type == logits_device
    expected = torch.rand(
        (1,), generator=seeded(generator_device, 5), device=generator_device, dtype=torch.float64
    )
    assert float(value) == float(expected)


def test_no_engine_sampler_draws_with_torch_multinomial() -> None:
    """torch.multinomial needs the generator on the probabilities' device: on a CPU-only machine nothing
    else would notice a sampler that brings it back (the CUDA cases above skip here)."""
    calls = []
    for path in sorted(Path(tether.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "multinomial":
                calls.append(f"{path.name}:{node.lineno}")
    assert calls == [], f"draw with tether.engine.sampling.draw instead: {calls}"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=20, min_p=0.01),
    ],
)
def test_a_batched_draw_gives_each_row_the_token_and_logprob_of_its_own_draw(params: SamplingParams) -> None:
    logits = torch.randn(24, 1000, generator=seeded("cpu", 3)) * 3
    batched = sample_rows(logits, [(row, params, seeded("cpu", 100 + row)) for row in range(24)])
    one_by_one = [sample(logits[row], params, seeded("cpu", 100 + row)) for row in range(24)]
    assert batched == one_by_one  # bit for bit: the same tokens and the same float logprobs


def test_mixed_draws_keep_their_order_and_each_its_own_settings() -> None:
    logits = torch.randn(6, 300, generator=seeded("cpu", 4)) * 2
    greedy, hot, cool = SamplingParams(temperature=0), SamplingParams(temperature=1.5), SAMPLED
    plan = [(5, hot), (0, greedy), (3, cool), (1, hot), (2, greedy), (4, cool)]
    bias = torch.full((1, 300), -torch.inf)
    bias[0, 7] = 0.0  # the masked draw (number 3) can only take token 7
    masks = sampling.AllowedTokens([3], bias)
    draws = [
        (row, params, None if params.greedy else seeded("cpu", i)) for i, (row, params) in enumerate(plan)
    ]
    got = sample_rows(logits, draws, masks)
    expected = [
        sample(logits[row], params, None if params.greedy else seeded("cpu", i), bias[0] if i == 3 else None)
        for i, (row, params) in enumerate(plan)
    ]
    assert [token for token, _ in got] == [token for token, _ in expected] and got[3][0] == 7
    sampled = [i for i, (_, params) in enumerate(plan) if not params.greedy]
    assert [got[i] for i in sampled] == [expected[i] for i in sampled]  # bit for bit
    # greedy rows: one shared log-normaliser, equal to a row's own log-softmax to rounding
    assert [got[i][1] for i in (1, 4)] == pytest.approx([expected[i][1] for i in (1, 4)], abs=1e-5)
