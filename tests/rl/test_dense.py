"""The training forward recomputes exactly the logprobs the engine recorded, and carries gradients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

from tether.engine.llm_engine import LLMEngine
from tether.engine.sampling import SamplingParams
from tether.kernels.attention import AttentionKernel
from tether.models import load
from tether.models.dense import DenseBatch, head_logprobs, token_logprobs

PROMPTS = [[5, 17, 33, 2, 90], [44, 12], [7, 7, 7, 7, 7, 7, 7, 7, 8]]


@pytest.mark.parametrize(
    ("architecture", "temperature", "layout"),
    [("qwen3", 1.0, "padded"), ("llama", 0.7, "packed"), ("qwen3", 0.0, "shared")],
)
def test_dense_logprobs_equal_engine_recorded_logprobs(
    tiny_model: Callable[[str], Path], architecture: str, temperature: float, layout: str
) -> None:
    folder = tiny_model(architecture)
    engine, _ = LLMEngine.from_pretrained(folder, kv_cache_mib=4, seed=3)
    params = SamplingParams(n=2, temperature=temperature, max_tokens=24, seed=11, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    sequences, targets, recorded = [], [], []
    for output in outputs:
        for completion in output.completions:
            sequences.append(output.prompt_token_ids + completion.token_ids)
            targets.append((len(output.prompt_token_ids), len(sequences[-1])))
            recorded.append(torch.tensor(completion.logprobs))
    model, _, _ = load(folder)
    if layout == "shared":  # each prompt once, its two samples attending to it
        groups = [(o.prompt_token_ids, [c.token_ids for c in o.completions]) for o in outputs]
        batch = DenseBatch.shared_prefix(groups)
    else:
        batch = DenseBatch.padded(sequences) if layout == "padded" else DenseBatch.packed(sequences, 64)
    with torch.no_grad():
        ours = token_logprobs(model, batch, targets, temperature)
    for mine, theirs in zip(ours, recorded, strict=True):
        assert mine.shape == theirs.shape
        assert torch.allclose(mine, theirs, atol=1e-5, rtol=0), (mine - theirs).abs().max()


def test_packing_fills_rows_first_fit() -> None:
    batch = DenseBatch.packed([[1] * 5, [2] * 4, [3] * 3, [4] * 9], row_tokens=8)
    assert [(row, cols[0], len(cols)) for row, cols in batch.columns] == [
        (0, 0, 5),
        (1, 0, 4),
        (0, 5, 3),
        (2, 0, 9),
    ]
    assert batch.segments[0].tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 0]
    assert batch.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0]


def _keys_by_block(batch: DenseBatch) -> dict[int, list[int]]:
    """Flat token -> the flat tokens it attends to, as the attention blocks (SDPA, backward) compute."""
    seen: dict[int, list[int]] = {}
    for block in batch.attention_blocks():
        width = block.queries.shape[1]
        for b in range(block.queries.shape[0]):
            for i in range(width):
                if b * width + i not in block.slots.tolist():
                    continue
                keys = block.keys[b]
                allowed = block.mask[b, 0, i] if block.mask is not None else torch.arange(len(keys)) <= i
                seen[int(block.queries[b, i])] = sorted(int(k) for k in keys[allowed])
    return seen


def _keys_by_table(batch: DenseBatch) -> dict[int, list[int]]:
    """The same from the key tables the engine's kernel reads (the CPU forward), real tokens only."""
    tables, lengths = batch.key_tables()
    real = (batch.segments.reshape(-1) > 0).nonzero()[:, 0].tolist()
    return {t: sorted(tables[t, : int(lengths[t])].tolist()) for t in real}


def test_packed_sequences_do_not_attend_to_each_other() -> None:
    batch = DenseBatch.packed([[1, 2], [3, 4]], row_tokens=4)
    assert _keys_by_block(batch) == {0: [0], 1: [0, 1], 2: [2], 3: [2, 3]}
    assert _keys_by_table(batch) == _keys_by_block(batch)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_the_kernel_tables_and_the_attention_blocks_give_every_token_the_same_keys(layout: str) -> None:
    generator = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, 50, (n,), generator=generator).tolist()

    groups = [(tokens(p), [tokens(c) for c in cs]) for p, cs in [(3, [2, 5, 1]), (6, [4]), (1, [3, 3])]]
    sequences = [p + c for p, cs in groups for c in cs]
    if layout == "shared":
        batch = DenseBatch.shared_prefix(groups)
    else:
        batch = DenseBatch.padded(sequences) if layout == "padded" else DenseBatch.packed(sequences, 12)
    by_block = _keys_by_block(batch)
    assert by_block == _keys_by_table(batch)
    assert len(by_block) == int((batch.segments > 0).sum())


def test_attention_holds_each_documents_keys_not_the_rows_squared_length() -> None:
    """A GRPO micro-batch of 8 prompts of 200 tokens x 4 samples of 256: 2.96x fewer scores than one
    T x T mask per group row held (8 x 1224^2), and no mask at all for the prompts."""
    prompt, completion = [1] * 200, [2] * 256
    batch = DenseBatch.shared_prefix([(prompt, [completion] * 4)] * 8)
    assert batch.input_ids.shape == (1, 8 * (200 + 4 * 256))  # one packed row
    blocks = batch.attention_blocks()
    scores = sum(block.score_elements for block in blocks)
    assert scores == 8 * 200 * 200 + 8 * 4 * 256 * (200 + 256)
    assert scores * 2.9 < 8 * (200 + 4 * 256) ** 2
    assert sum(block.mask is None for block in blocks) == 1  # the prompts: one plain causal call


def test_gradients_flow_to_every_parameter(tiny_model: Callable[[str], Path]) -> None:
    model, _, _ = load(tiny_model("qwen3"))
    model.requires_grad_(True)
    (logprobs,) = token_logprobs(model, DenseBatch.padded([[3, 4, 5, 6]]), [(1, 4)])
    torch.autograd.backward(logprobs.sum())
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


@pytest.mark.parametrize(
    ("targets", "message"),
    [([(0, 2)], r"target range \(0, 2\)"), ([(1, 5)], r"target range \(1, 5\)"), ([], "0 target ranges")],
)
def test_bad_target_ranges_are_named(
    tiny_model: Callable[[str], Path], targets: list[tuple[int, int]], message: str
) -> None:
    model, _, _ = load(tiny_model("llama"))
    with pytest.raises(ValueError, match=message):
        token_logprobs(model, DenseBatch.padded([[1, 2, 3, 4]]), targets)


def test_empty_sequences_are_refused() -> None:
    with pytest.raises(ValueError, match="no empty sequence"):
        DenseBatch.padded([[1], []])


def test_shared_prefix_lets_samples_see_their_prompt_but_not_each_other_or_other_groups() -> None:
    batch = DenseBatch.shared_prefix([([1, 2], [[3], [4, 5]]), ([6], [[7, 8]])])
    assert batch.positions[0].tolist() == [0, 1, 2, 2, 3, 0, 1, 2]
    assert _keys_by_block(batch) == {
        0: [0],
        1: [0, 1],
        2: [0, 1, 2],
        3: [0, 1, 3],
        4: [0, 1, 3, 4],
        5: [5],
        6: [5, 6],
        7: [5, 6, 7],
    }
    assert _keys_by_table(batch) == _keys_by_block(batch)
    assert batch.columns == ((0, (0, 1, 2)), (0, (0, 1, 3, 4)), (0, (5, 6, 7)))


def test_shared_prefix_gives_the_padded_logprobs_and_gradients(tiny_model: Callable[[str], Path]) -> None:
    prompt, samples = [5, 6, 7, 8], [[9, 10, 11], [12], [13, 14]]
    targets = [(len(prompt), len(prompt) + len(c)) for c in samples]
    results = []
    for batch in (
        DenseBatch.padded([prompt + c for c in samples]),
        DenseBatch.shared_prefix([(prompt, samples)]),
    ):
        model, _, _ = load(tiny_model("llama"))
        model.requires_grad_(True)
        logprobs = token_logprobs(model, batch, targets)
        torch.autograd.backward(torch.cat(logprobs).sum())
        results.append((torch.cat(logprobs).detach(), {n: p.grad for n, p in model.named_parameters()}))
    (padded, padded_grads), (shared, shared_grads) = results
    assert torch.allclose(padded, shared, atol=1e-5)
    for name, grad in padded_grads.items():
        other = shared_grads[name]
        assert grad is not None and other is not None
        assert torch.allclose(grad, other, atol=1e-5), name


@pytest.mark.parametrize("groups", [[([], [[1]])], [([1], [])], [([1], [[2], []])]])
def test_shared_prefix_refuses_empty_pieces(groups: list[tuple[list[int], list[list[int]]]]) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        DenseBatch.shared_prefix(groups)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Multi-threaded BLAS splits a matmul by its row count; one thread keeps every kernel batch-invariant."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("architecture", "temperature"), [("llama", 1.0), ("qwen3", 0.7), ("qwen2", 0.0)])
def test_dense_logprobs_equal_a_batch_invariant_engine_bit_for_bit(
    tiny_model: Callable[[str], Path], architecture: str, temperature: float
) -> None:
    folder = tiny_model(architecture)
    # Prompts longer than a block and a token budget smaller than the prompts: chunked prefill, prefill
    # beside decode, and decode steps of a few sequences all feed the recorded logprobs.
    engine, _ = LLMEngine.from_pretrained(
        folder, kv_cache_mib=4, seed=3, block_size=4, max_num_batched_tokens=8, max_num_seqs=8
    )
    engine.set_batch_invariant(True)
    params = SamplingParams(n=3, temperature=temperature, max_tokens=20, seed=11, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    model, _, _ = load(folder)
    groups = [(o.prompt_token_ids, [c.token_ids for c in o.completions]) for o in outputs]
    sequences = [p + c for p, cs in groups for c in cs]
    targets = [(len(p), len(p) + len(c)) for p, cs in groups for c in cs]
    recorded = [torch.tensor(c.logprobs) for o in outputs for c in o.completions]
    for batch in (
        DenseBatch.padded(sequences),
        DenseBatch.packed(sequences, 48),
        DenseBatch.shared_prefix(groups),
    ):
        with torch.no_grad():
            ours = token_logprobs(model, batch, targets, temperature)
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(ours, recorded, strict=True))


def test_engine_attention_in_the_dense_forward_has_torchs_gradients(
    tiny_model: Callable[[str], Path],
) -> None:
    folder = tiny_model("qwen3")
    batch = DenseBatch.shared_prefix([([5, 6, 7, 8], [[9, 10, 11], [12]])])
    grads = []
    for kernel in (AttentionKernel.C_PORTABLE, AttentionKernel.TORCH_SDPA):
        model, _, _ = load(folder)
        model.requires_grad_(True)
        with mock.patch("tether.models.dense.kernel_for", return_value=kernel):
            logprobs = token_logprobs(model, batch, [(4, 7), (4, 5)])
        torch.autograd.backward(torch.cat(logprobs).sum())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        other = grads[1][name]
        assert grad is not None and other is not None
        assert torch.allclose(grad, other, atol=1e-5), name


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_torch_attention_over_the_blocks_gives_the_engine_kernels_values(
    tiny_model: Callable[[str], Path], layout: str
) -> None:
    """Off the CPU (or in bfloat16) the forward runs the blocks through torch's SDPA: same values as the
    engine's kernel over the key tables, padding and packing included."""
    model, _, _ = load(tiny_model("qwen2"))
    groups = [([5, 6, 7, 8, 9], [[10, 11, 12], [13]]), ([14, 15], [[16, 17, 18, 19], [20, 21]])]
    sequences = [p + c for p, cs in groups for c in cs]
    targets = [(len(p), len(p) + len(c)) for p, cs in groups for c in cs]
    if layout == "shared":
        batch = DenseBatch.shared_prefix(groups)
    else:
        batch = DenseBatch.padded(sequences) if layout == "padded" else DenseBatch.packed(sequences, 12)
    results = []
    for kernel in (AttentionKernel.C_PORTABLE, AttentionKernel.TORCH_SDPA):
        with torch.no_grad(), mock.patch("tether.models.dense.kernel_for", return_value=kernel):
            results.append(torch.cat(token_logprobs(model, batch, targets)))
    assert torch.allclose(results[0], results[1], atol=1e-5, rtol=0), (results[0] - results[1]).abs().max()


def test_an_attention_given_from_outside_is_refused_for_sliding_window_layers(
    tiny_model: Callable[[str], Path],
) -> None:
    """Context-parallel attention (`attend`) sees whole documents: a windowed model must not silently
    attend past its window through it."""
    from tether.models.config import UnsupportedModelError
    from tether.models.dense import hidden_states

    model, _, _ = load(tiny_model("mistral"))
    batch = DenseBatch.padded([[1, 2, 3, 4]])
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        hidden_states(model, batch, attend=lambda q, k, v, scale: q)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_head_logprobs_equal_autograds_values_and_gradients(
    tiny_model: Callable[[str], Path], temperature: float
) -> None:
    model, _, _ = load(tiny_model("llama"))
    model.train().requires_grad_(True)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, model.config.hidden_size, generator=generator)
    tokens = torch.randint(0, model.config.vocab_size, (7,), generator=generator)
    weights = torch.randn(7, generator=generator)  # a loss that weighs every token differently

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_(True)
        if fused:
            logprobs = head_logprobs(model, h, tokens, temperature)
            # One backward node over [N, vocab], and at temperature 1 no division by it in front.
            node = logprobs.grad_fn
            assert node is not None and type(node).__name__ == "_PickedLogSoftmaxBackward"
            inputs = [type(f).__name__ for f, _ in node.next_functions if f is not None]
            assert ("DivBackward0" in inputs) is (temperature != 1)
        else:  # autograd through torch's own ops, as the engine's sampler normalises
            logits = model.lm_head(h).float()
            logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
        (logprobs * weights).sum().backward()
        assert h.grad is not None and model.lm_head.weight.grad is not None
        return logprobs.detach(), h.grad, model.lm_head.weight.grad.clone()

    (fused, fused_hidden, fused_head), (plain, plain_hidden, plain_head) = run(True), run(False)
    assert torch.equal(fused, plain)  # the engine's logprobs, bit for bit
    assert torch.allclose(fused_hidden, plain_hidden, atol=1e-6)
    assert torch.allclose(fused_head, plain_head, atol=1e-6)
