"""Sampling parameters and the sampler: one next token (and its logprob) from one row of logits.

The logprob reported for a token is under the temperature-scaled model distribution, before top-k,
top-p and min-p truncation and before a grammar's mask (`AllowedTokens`): the quantity a learner
recomputes from the same weights (with greedy decoding, temperature 1). Truncation and masks only decide
which tokens may be drawn; `top_alternatives` reports the most likely tokens under that same distribution.

A draw takes its uniform from the request's generator on the generator's own device and inverts the
distribution's CDF on the logits' device (`draw`), so a generator on another device than the logits
(`torch.multinomial` refuses that) still samples, and one seed gives one token stream on a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.engine.structured import StructuredOutput
from tether.errors import ConfigError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    seed: int | None = None  # sample i of a request draws from a generator seeded with seed + i
    n: int = 1  # samples per prompt; they share the prompt's KV blocks
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives reported with each generated token's logprob
    structured: StructuredOutput | None = None  # a grammar every completion must follow

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", 0 <= self.temperature <= 100, "a number from 0 (greedy) to 100"),
            ("top_p", 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "-1 (off) or an integer >= 1"),
            ("min_p", 0 <= self.min_p < 1, "a number in [0, 1)"),
            ("n", 1 <= self.n <= 256, "an integer from 1 to 256"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            (
                "top_logprobs",
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                f"an integer from 0 to {MAX_TOP_LOGPROBS}",
            ),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise ConfigError(f"sampling: {name} = {getattr(self, name)!r}: expected {accepted}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from, for each row of [rows, vocab] float32 logits
    (temperature, top-k, top-p, min-p; one-hot at the argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    allowed = logits / params.temperature
    if params.top_k != -1 and params.top_k < allowed.shape[-1]:
        threshold = torch.topk(allowed, params.top_k, dim=-1).values[..., -1:]
        allowed = allowed.masked_fill(allowed < threshold, -torch.inf)
    if params.top_p < 1:
        ordered, order = torch.sort(allowed, descending=True, dim=-1)
        ordered_probs = torch.softmax(ordered, dim=-1)
        outside = ordered_probs.cumsum(dim=-1) - ordered_probs >= params.top_p  # keeps the crossing token
        allowed = allowed.scatter(-1, order, ordered.masked_fill(outside, -torch.inf))
    if params.min_p > 0:
        probs = torch.softmax(allowed, dim=-1)
        allowed = allowed.masked_fill(
            probs < params.min_p * probs.max(dim=-1, keepdim=True).values, -torch.inf
        )
    return torch.softmax(allowed, dim=-1)


@dataclass(frozen=True, slots=True)
class AllowedTokens:
    """The tokens some draws may take: row i of `bias` ([len(draws), vocab] float32, 0 where a token is
    allowed, -inf elsewhere, some token allowed) constrains draw number `draws[i]` of a `sample_rows` call."""

    draws: list[int]
    bias: torch.Tensor


def sample_rows(
    logits: torch.Tensor,
    draws: list[tuple[int, SamplingParams, torch.Generator | None]],
    masks: AllowedTokens | None = None,
) -> list[tuple[int, float]]:
    """One token per draw (row of [rows, vocab] float32 logits, its params, its generator), in order,
    each constrained draw among its allowed tokens; `logits` is not modified.

    Greedy draws share one argmax and one log-normaliser over their rows instead of a kernel launch per
    row; unconstrained sampled draws (RL rollouts) with the same truncation share one distribution and
    one inverse-CDF draw (`sample_batch`), each still taking its uniform from its own generator; the
    rest (a grammar's masked draws) go through `sample` one by one."""
    mask_of = {} if masks is None else {position: i for i, position in enumerate(masks.draws)}
    results: list[tuple[int, float] | None] = [None] * len(draws)
    greedy = [i for i, (_, params, _) in enumerate(draws) if params.greedy]
    if greedy:
        indices = [draws[i][0] for i in greedy]
        rows = (  # an all-greedy step (the common case) needs no copy of its logits
            logits
            if indices == list(range(logits.shape[0]))
            else logits[torch.tensor(indices, device=logits.device)]
        )
        tokens = rows.argmax(dim=-1)
        constrained = [j for j, i in enumerate(greedy) if i in mask_of]
        if constrained and masks is not None:
            where = torch.tensor(constrained, device=logits.device)
            picked = masks.bias[torch.tensor([mask_of[greedy[j]] for j in constrained])]
            tokens[where] = picked.add_(rows[where]).argmax(dim=-1)  # `picked` is a copy
        logprobs = rows.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(rows, dim=-1)
        for i, token, logprob in zip(greedy, tokens.tolist(), logprobs.tolist(), strict=True):
            results[i] = (int(token), float(logprob))
    alike: dict[tuple[float, float, int, float], list[int]] = {}
    for i, (_, params, _) in enumerate(draws):
        if results[i] is None and i not in mask_of:
            alike.setdefault((params.temperature, params.top_p, params.top_k, params.min_p), []).append(i)
    for members in alike.values():
        rows = logits[torch.tensor([draws[i][0] for i in members], device=logits.device)]
        sampled = sample_batch(rows, draws[members[0]][1], [draws[i][2] for i in members])
        for i, result in zip(members, sampled, strict=True):
            results[i] = result
    for i, (row, params, generator) in enumerate(draws):
        if results[i] is None:
            row_bias = None if masks is None or i not in mask_of else masks.bias[mask_of[i]]
            results[i] = sample(logits[row], params, generator, row_bias)
    return [result for result in results if result is not None]


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    bias: torch.Tensor | None = None,
) -> tuple[int, float]:
    """Draw one token from a [vocab] row of float32 logits, among those a grammar's `bias` ([vocab], 0
    where allowed, -inf elsewhere) allows when given; returns (token id, its logprob)."""
    choice = logits if bias is None else logits + bias
    if params.greedy:
        token = int(torch.argmax(choice))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    token = draw(probabilities(choice[None], params)[0], generator)
    return token, float(logprobs[token])


def sample_batch(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None]
) -> list[tuple[int, float]]:
    """One token per row of [rows, vocab] float32 logits, all sampled (not greedy) with `params`, row i
    taking its uniform from `generators[i]`: the tokens and logprobs `sample` gives row by row (every
    step is computed per row; only the kernel launches are shared)."""
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    tokens = draw_rows(probabilities(logits, params), generators)
    picked = logprobs.gather(-1, tokens[:, None])[:, 0]
    return [(int(t), float(lp)) for t, lp in zip(tokens.tolist(), picked.tolist(), strict=True)]


def top_alternatives(
    logits: torch.Tensor, rows: list[tuple[int, SamplingParams]]
) -> list[list[tuple[int, float]]]:
    """For each (row of [rows, vocab] float32 logits, params), the `params.top_logprobs` most likely
    tokens and their logprobs, most likely first, under the distribution the sampled token's logprob is
    reported under (temperature-scaled, untruncated, unmasked). One top-k for all rows."""
    if not rows:
        return []
    device = logits.device
    scale = torch.tensor([1.0 if params.greedy else params.temperature for _, params in rows], device=device)
    scaled = logits[torch.tensor([row for row, _ in rows], device=device)] / scale[:, None]
    logprobs = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
    k = min(max(params.top_logprobs for _, params in rows), logits.shape[-1])
    values, tokens = torch.topk(logprobs, k, dim=-1)
    return [
        list(zip(ids[: params.top_logprobs], lps[: params.top_logprobs], strict=True))
        for ids, lps, (_, params) in zip(tokens.tolist(), values.tolist(), rows, strict=True)
    ]


def uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One float64 draw from [0, 1), made by `generator` on its own device (torch's global one on
    `device` when None) and returned as a [1] tensor on `device`."""
    where = device if generator is None else generator.device
    return torch.rand((1,), generator=generator, device=where, dtype=torch.float64).to(device)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index of a [vocab] distribution (weights >= 0, not all zero; need not sum to 1), drawn by
    inverting its CDF at a `uniform` from `generator`, whatever device the generator is on. The CDF is
    float64: a token's chance of being drawn is its weight to about 1e-16, and a zero-weight token,
    whose CDF step is empty, is never drawn."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[-1:]
    # u * total may round up to total when u is within an ulp of 1: below it, the draw stays on a
    # token of positive weight (the first whose CDF exceeds u).
    point = torch.minimum(
        uniform(generator, probs.device) * total, torch.nextafter(total, total.new_zeros(1))
    )
    return int(torch.searchsorted(cdf, point, right=True)[0])


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """`draw` for each row of [rows, vocab] weights at once, row i at a uniform from `generators[i]`:
    a [rows] tensor of indices, equal to `draw` row by row."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    uniforms = torch.cat([uniform(generator, probs.device) for generator in generators])[:, None]
    point = torch.minimum(uniforms * total, torch.nextafter(total, total.new_zeros(1)))
    return torch.searchsorted(cdf, point, right=True)[:, 0]
