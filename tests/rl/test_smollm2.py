"""On the real SmolLM2-135M-Instruct (slow): does the learner recompute the engine's logprobs within 1e-5?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tether.engine.llm_engine import LLMEngine
from tether.engine.sampling import SamplingParams
from tether.models import load
from tether.models.dense import DenseBatch, token_logprobs

CACHE = Path(__file__).resolve().parents[2] / ".tether" / "cache"
SMOLLM2 = "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured gap 2-3.5e-5 on SmolLM2 (1e-5 holds on the tiny models): the engine's own full prefill "
    "and its decode path already differ by 1e-5 here; closing it is issue 9",
)
def test_dense_logprobs_equal_engine_logprobs_on_smollm2() -> None:
    engine, tokenizer = LLMEngine.from_pretrained(SMOLLM2, cache_dir=CACHE, kv_cache_mib=64, seed=0)
    messages = [{"role": "user", "content": "What is 17 * 23? Answer with the number."}]
    ids: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompt = [int(i) for i in ids]
    (output,) = engine.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=32, seed=5))
    sequences = [prompt + c.token_ids for c in output.completions]
    targets = [(len(prompt), len(s)) for s in sequences]
    model, _, _ = load(SMOLLM2, CACHE)
    with torch.no_grad():
        ours = token_logprobs(model, DenseBatch.padded(sequences), targets)
    for mine, completion in zip(ours, output.completions, strict=True):
        assert torch.allclose(mine, torch.tensor(completion.logprobs), atol=1e-5, rtol=0)
