"""The engine on the real SmolLM2: continuous batching with chunked prefill and a shared system prompt
gives the same greedy tokens as the model runner's plain batched decode (itself equal to transformers)."""

from __future__ import annotations

from pathlib import Path

from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import ModelRunner
from tether.engine.sampling import SamplingParams

SYSTEM = "You are a concise assistant. Answer in one short sentence, without preamble or lists."
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]


def test_engine_greedy_equals_plain_batched_decode(smollm2_folder: Path) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(
        smollm2_folder, kv_cache_mib=64, max_num_batched_tokens=48, max_num_seqs=8
    )
    prompts: list[list[int]] = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for question in QUESTIONS
    ]
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=24, temperature=0))
    rest = engine.generate(prompts[1:], SamplingParams(max_tokens=24, temperature=0))
    outputs = first + rest
    reference = ModelRunner(engine.runner.model, num_blocks=64, block_size=16).generate_greedy(
        prompts, max_new_tokens=24, eos_token_ids=engine.eos_token_ids
    )
    assert [o.completions[0].token_ids for o in outputs] == reference
    assert all(o.num_cached_tokens >= 16 for o in rest), [o.num_cached_tokens for o in rest]
    assert "Paris" in outputs[0].completions[0].text
