"""Grammar-constrained decoding end to end on a tiny random Qwen3 (a random model's output is valid only
if the masks make it so): every grammar kind, n samples, sampling filters, mixed batches, preemption,
chunked prefill, weight-update retries, speculation, refused grammars, logprobs and top_logprobs."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tests.engine.test_devices import full_logprobs
from tests.placement import Placement
from tether.engine.async_engine import AsyncEngine
from tether.engine.config import EngineConfig
from tether.engine.grammar import GrammarCompiler, TokenMasks
from tether.engine.llm_engine import Completion, LLMEngine
from tether.engine.model_runner import ModelRunner
from tether.engine.sampling import SamplingParams
from tether.engine.scheduler import RequestError
from tether.engine.sequence import FinishReason
from tether.engine.speculative import SpeculativeConfig
from tether.engine.structured import StructuredOutput
from tether.engine.weight_update import UpdatePolicy, WeightUpdateConfig
from tether.models import load
from tether.models.precision import DType
from tether.testing.schemas import random_schema

BLOCK = 4  # as tests/engine/test_devices.py, whose `full_logprobs` recomputes logprobs
PROMPTS = [[5, 9, 13, 2 + i, 7, 11, 3 * i + 1, 8, 6][: 3 + 2 * i] for i in range(4)]
LONG_PROMPT = PROMPTS[3] * 4  # 36 tokens: prefilled in chunks of at most 16 (`make_engine`)
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "size": {"type": "number", "minimum": -5, "maximum": 5, "multipleOf": 0.5},
    },
    "required": ["id", "name", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{2}"
LARK = 'start: item ("," item)*\nitem: "yes" | "no" | /[0-9]{1,3}/'
LARK_LANGUAGE = r"(yes|no|[0-9]{1,3})(,(yes|no|[0-9]{1,3}))*"


def check(kind: str, text: str) -> None:
    """Fails unless `text` is in the language of the grammar of `kind` used by these tests."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    else:
        assert re.fullmatch(REGEX if kind == "regex" else LARK_LANGUAGE, text), text


SPECS = {"json_schema": json.dumps(SCHEMA), "json_object": "", "regex": REGEX, "lark": LARK}


def structured(kind: str, **options: Any) -> SamplingParams:
    defaults: dict[str, Any] = {"max_tokens": 400, "temperature": 0}
    return SamplingParams(**{**defaults, **options}, structured=StructuredOutput(kind, SPECS[kind]))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3")


def make_engine(
    path: Path,
    placement: Placement | None = None,
    kv_cache_mib: int = 4,
    max_seqs: int = 8,
    **options: Any,
) -> LLMEngine:
    where = placement or Placement("cpu", "float32")
    engine, _ = LLMEngine.from_pretrained(
        path,
        kv_cache_mib=kv_cache_mib,
        device=where.device,
        dtype=DType.parse(where.dtype).torch,
        block_size=BLOCK,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=16,  # prompts longer than this are prefilled in chunks
        max_model_len=512,
        **options,
    )
    return engine


def finished_texts(completions: list[Completion], kind: str) -> list[str]:
    """The texts of the completions that ended by stopping, each checked against its grammar."""
    texts = [c.text for c in completions if c.finish_reason is FinishReason.STOP]
    for text in texts:
        check(kind, text)
    return texts


@pytest.mark.parametrize("kind", ["json_schema", "json_object", "regex", "lark"])
def test_every_kind_of_grammar_is_followed(tiny_path: Path, placement: Placement, kind: str) -> None:
    engine = make_engine(tiny_path, placement)
    outputs = engine.generate([*PROMPTS, LONG_PROMPT], structured(kind))
    completions = [o.completions[0] for o in outputs]
    texts = finished_texts(completions, kind)
    if kind != "json_object":  # any object may be longer than the budget; these grammars are bounded
        assert len(texts) == len(PROMPTS) + 1, [c.text for c in completions]
    assert texts


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_k": 5},
        {"temperature": 1.2, "top_p": 0.9},
        {"temperature": 1.0, "min_p": 0.05},
    ],
    ids=["plain", "top_k", "top_p", "min_p"],
)
def test_sampled_samples_each_follow_the_grammar(tiny_path: Path, options: dict[str, Any]) -> None:
    engine = make_engine(tiny_path)
    [output] = engine.generate([PROMPTS[1]], structured("json_schema", n=4, seed=3, **options))
    texts = finished_texts(output.completions, "json_schema")
    assert len(texts) == 4
    assert len(set(texts)) > 1, "n samples with their own seeds differ"


def test_random_schemas_give_valid_documents(tiny_path: Path) -> None:
    """The fast sibling of the 200-schema SmolLM2 acceptance test (tests/engine/test_structured_bench.py)."""
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(10)]
    engine = make_engine(tiny_path, max_seqs=10)
    for i, schema in enumerate(schemas):
        params = SamplingParams(
            max_tokens=500,
            temperature=1.0,
            seed=i,
            structured=StructuredOutput("json_schema", json.dumps(schema)),
        )
        engine.add_request(str(i), PROMPTS[i % 4], params)
    done: dict[str, Completion] = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.completions[0] for o in engine.step() if o.finished})
    for i, schema in enumerate(schemas):
        assert done[str(i)].finish_reason is FinishReason.STOP, done[str(i)].text
        jsonschema.validate(json.loads(done[str(i)].text), schema)


@pytest.mark.parametrize(
    "free", [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, seed=4)]
)
def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(
    tiny_path: Path, free: SamplingParams
) -> None:
    alone = make_engine(tiny_path).generate([PROMPTS[0], PROMPTS[2]], free)
    engine = make_engine(tiny_path)
    engine.add_request("json", PROMPTS[1], structured("json_schema", n=2, temperature=1.0, seed=1))
    engine.add_request("regex", PROMPTS[3], structured("regex"))
    mixed = engine.generate([PROMPTS[0], PROMPTS[2]], free)
    for a, b in zip(alone, mixed, strict=True):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs


def test_preempted_structured_sequences_resume_their_grammar(tiny_path: Path) -> None:
    roomy = make_engine(tiny_path).generate(PROMPTS, structured("json_schema"))
    model, tokenizer, config = load(tiny_path)
    engine = LLMEngine(
        ModelRunner(model, num_blocks=80, block_size=BLOCK),
        EngineConfig(
            num_blocks=80, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256
        ),
        eos_token_ids=config.eos_token_ids,
        detokenize=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
        grammars=GrammarCompiler.from_tokenizer(tokenizer, config.vocab_size, config.eos_token_ids),
    )
    tight = engine.generate(PROMPTS * 2, structured("json_schema", max_tokens=250))
    assert engine.scheduler.num_preemptions > 0
    assert len(finished_texts([o.completions[0] for o in tight], "json_schema")) == len(PROMPTS) * 2
    assert [o.completions[0].token_ids for o in tight[:4]] == [o.completions[0].token_ids for o in roomy]


def test_a_weight_update_that_retries_restarts_the_grammar(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, weight_update=WeightUpdateConfig(policy=UpdatePolicy.ABORT_AND_RETRY))
    engine.add_request("r", PROMPTS[2], structured("json_schema"))
    for _ in range(12):  # past the prompt, into the document
        engine.step()
    engine.update_weights([(name, p.detach().clone()) for name, p in engine.named_parameters()])
    outputs = []
    while engine.has_unfinished():
        outputs.extend(o for o in engine.step() if o.finished)
    [output] = outputs
    assert output.retries == 1
    assert finished_texts(output.completions, "json_schema")


def test_a_speculative_engine_decodes_structured_requests_without_drafts(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, speculative=SpeculativeConfig(num_speculative_tokens=3))
    outputs = engine.generate(PROMPTS, structured("regex"))
    assert len(finished_texts([o.completions[0] for o in outputs], "regex")) == len(PROMPTS)
    assert engine.spec_stats.num_drafted_tokens == 0
    engine.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert engine.spec_stats.num_drafted_tokens > 0, "unconstrained requests are still drafted for"


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", '{"type": ', "json_schema: not JSON"),
        ("json_schema", "[1, 2]", "json_schema: expected a JSON object, got list"),
        ("json_schema", '{"type": "nonsense"}', "json_schema: .*nonsense"),
        ("regex", "a(b", "regex: .*unclosed group"),
        ("lark", "start: missing", 'lark: .*unknown name: "missing"'),
        ("lark", "start: (", "lark: "),
    ],
)
def test_a_bad_grammar_is_refused_naming_the_problem(
    tiny_path: Path, kind: str, spec: str, message: str
) -> None:
    engine = make_engine(tiny_path)
    params = SamplingParams(structured=StructuredOutput(kind, spec))  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=f"(?s)structured output {message}"):
        engine.add_request("bad", PROMPTS[0], params)
    assert not engine.has_unfinished(), "a refused request leaves nothing behind"
    [output] = engine.generate([PROMPTS[0]], structured("regex"))
    check("regex", output.completions[0].text)


def test_an_engine_without_grammars_refuses_structured_requests(tiny_path: Path) -> None:
    model, _, config = load(tiny_path)
    engine = LLMEngine(
        ModelRunner(model, num_blocks=64, block_size=BLOCK),
        EngineConfig(
            num_blocks=64, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64
        ),
        eos_token_ids=config.eos_token_ids,
    )
    with pytest.raises(RequestError, match="structured output needs an engine built with a grammar compiler"):
        engine.add_request("r", PROMPTS[0], structured("regex"))


def test_a_grammar_is_compiled_once_per_spec(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    assert engine.grammars is not None
    first = engine.grammars.compile(StructuredOutput("regex", REGEX))
    assert engine.grammars.compile(StructuredOutput("regex", REGEX)) is first
    assert engine.grammars.compile(StructuredOutput("regex", "x+")) is not first


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_constrained_logprobs_and_top_logprobs_are_the_unmasked_models(
    tiny_path: Path, placement: Placement, temperature: float
) -> None:
    """The reported logprob is the learner-recomputable one (the mask only decides what may be drawn),
    and top_logprobs are the k most likely tokens under that same distribution, sorted."""
    engine = make_engine(tiny_path, placement)
    params = structured("json_schema", temperature=temperature, seed=2, top_logprobs=5, max_tokens=40)
    [output] = engine.generate([PROMPTS[3]], params)
    completion = output.completions[0]
    expected = full_logprobs(engine, PROMPTS[3], completion.token_ids, temperature)
    tolerance = 1e-4 if placement.exact else 0.05
    assert len(completion.top_logprobs) == len(completion.token_ids)
    for i, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert logprob == pytest.approx(float(expected[i, token]), abs=tolerance)
        top = completion.top_logprobs[i]
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        values, ids = torch.topk(expected[i], 5)
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=tolerance)
        if placement.exact:
            assert [t for t, _ in top] == ids.tolist()


def test_top_logprobs_are_reported_only_when_asked(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    asked, plain = engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=6, top_logprobs=20, seed=1)
    ) + engine.generate(PROMPTS[:1], SamplingParams(max_tokens=6, seed=1))
    assert [len(top) for top in asked.completions[0].top_logprobs] == [20] * 6
    assert plain.completions[0].top_logprobs == []
    assert asked.completions[0].token_ids == plain.completions[0].token_ids


def test_speculated_tokens_get_top_logprobs_too(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, speculative=SpeculativeConfig(num_speculative_tokens=3))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, top_logprobs=2)
    [output] = engine.generate([PROMPTS[3] * 3], params)
    completion = output.completions[0]
    assert engine.spec_stats.num_accepted_tokens > 0
    assert len(completion.top_logprobs) == len(completion.token_ids)
    for token, top in zip(completion.token_ids, completion.top_logprobs, strict=True):
        assert top[0][0] == token, "greedy takes the most likely token"


def test_token_masks_unpack_each_bit_to_its_token() -> None:
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    bits = torch.rand(3, vocab) < 0.5
    words = torch.zeros(3, 3, dtype=torch.int64)
    for row, token in bits.nonzero().tolist():
        words[row, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    bias = TokenMasks(vocab, threads=1).unpack(bitmask, torch.device("cpu"))
    assert bias.shape == (3, vocab)
    assert torch.equal(bias == 0, bits)
    assert torch.equal(torch.isinf(bias), ~bits)


async def test_the_async_engine_streams_top_logprobs_and_raises_a_bad_grammar(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        tokens: list[int] = []
        alternatives: list[tuple[tuple[int, float], ...]] = []
        async for delta in async_engine.generate(PROMPTS[0], structured("regex", top_logprobs=3)):
            for change in delta.completions:
                tokens += change.token_ids
                alternatives += change.top_logprobs
        assert len(alternatives) == len(tokens) and all(len(top) == 3 for top in alternatives)
        check("regex", engine.detokenize(tokens) if engine.detokenize else "")
        bad = SamplingParams(structured=StructuredOutput("regex", "a(b"))
        with pytest.raises(RequestError, match="structured output regex"):
            async for _ in async_engine.generate(PROMPTS[0], bad):
                pass
    finally:
        async_engine.shutdown()
