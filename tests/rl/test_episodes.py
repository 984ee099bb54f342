"""Multi-turn episodes, token in and token out: the tokens trained on are exactly the tokens the engine
was given and generated, observation tokens are masked, and episodes interleave in one batch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tether.chat import ChatError, JsonDict, Message, ToolCall, ToolSpec
from tether.chat.template import ChatTemplate
from tether.chat.tool_format import HERMES, MALFORMED_TOOL
from tether.engine.llm_engine import LLMEngine, RequestOutput
from tether.engine.sampling import SamplingParams
from tether.envs.context import ScoringContext
from tether.envs.episode import Environment
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry
from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Problem, Task
from tether.errors import InfraError, InfraReason
from tether.models import load
from tether.rl.builders import learner_options
from tether.rl.config import TrainConfig, parse_config
from tether.rl.episodes import EpisodeDriver, ObservationEncoder, assemble, template_reply
from tether.rl.learner import Learner
from tether.rl.rollout import PromptPlan, Rollout, Turn, plan_prompts, task_tools
from tether.rl.sections import AlgorithmSection
from tether.rl.sources import EngineRollouts
from tether.rl.trainer import Trainer, to_samples
from tether.tools import SUBMIT, Tool, Workspace

from .fake_envs import letters_env

TEMPLATE_END = "<|im_end|>"
# A tools-aware template in the style of Qwen2.5's: tools listed in the system turn, calls in <tool_call>
# blocks, consecutive results in one user turn of <tool_response> blocks.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nWrite each call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.\' }}'
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (m['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- for call in m.get('tool_calls', []) %}"
    "{{- '\\n<tool_call>\\n' + (call['function'] | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True, slots=True)
class _Words:
    def problem(self, seed: int) -> Problem:
        return Problem(prompt=f"Write notes about the number {seed}.", answer=str(seed))


async def _note(_workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    return f"noted {len(str(arguments.get('text', '')))} characters"


def _variety(inp: RewardInput) -> float:
    text = inp.completion
    return len(set(text)) / len(text) if text else 0.0


def notes_env(name: str, max_turns: int) -> Environment:
    """A multi-turn environment with a pure-Python tool (no sandbox): `note`, and `submit`."""
    spec = ToolSpec("note", "Keep a note.", {"type": "object", "properties": {"text": {"type": "string"}}})
    return Environment(
        name=name,
        source=_Words(),
        renderer=ChatRenderer("You keep notes with tools."),
        parser=ANSWER_TAG,
        rubric=Rubric((Reward("variety", _variety),)),
        tools=(Tool(spec, _note), SUBMIT),
        max_turns=max_turns,
    )


def registry() -> EnvRegistry:
    out = EnvRegistry()
    out.add(notes_env("test/notes2", 2))
    out.add(notes_env("test/notes5", 5))
    out.add(letters_env("test/vowels", "aeiou"))
    return out


def always_note(text: str, task: Task) -> Message:
    """A random model writes no tool calls: every reply calls `note` with its own text instead."""
    if not task.tools:
        return {"role": "assistant", "content": text}
    call = ToolCall("call_0", "note", json.dumps({"text": text}))
    return {"role": "assistant", "content": text, "tool_calls": [call.openai()]}


class EngineLog:
    """What the engine was asked (prompt per request id) and produced, and in which order."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, tuple[list[int], list[float], list[int]]] = {}
        self.events: list[tuple[str, str]] = []
        add, step = engine.add_request, engine.step

        def add_request(
            request_id: str, prompt: list[int], params: SamplingParams | None = None, priority: int = 0
        ) -> None:
            self.prompts[request_id] = list(prompt)
            self.events.append(("add", request_id))
            add(request_id, prompt, params, priority)

        def logged_step() -> list[RequestOutput]:
            outputs = step()
            for output in outputs:
                if output.finished:
                    (c,) = output.completions
                    self.outputs[output.request_id] = (list(c.token_ids), list(c.logprobs), list(c.versions))
                    self.events.append(("done", output.request_id))
            return outputs

        monkeypatch.setattr(engine, "add_request", add_request)
        monkeypatch.setattr(engine, "step", logged_step)


def check_token_fidelity(rollout: Rollout, log: EngineLog, tokenizer: Any) -> None:
    """Every turn is exactly an engine request; the episode's sequence is their concatenation."""
    assert rollout.turns and rollout.loss_mask is not None
    sequence = rollout.prompt_ids + rollout.completion_ids
    generated: list[int] = []
    for k, turn in enumerate(rollout.turns):
        assert turn.prompt_ids == log.prompts[turn.request_id]
        ids, logprobs, versions = log.outputs[turn.request_id]
        assert (turn.completion_ids, turn.logprobs, turn.versions) == (ids, logprobs, versions)
        assert sequence[: len(turn.prompt_ids) + len(ids)] == turn.prompt_ids + ids
        generated += ids
        if k + 1 < len(rollout.turns):  # the next prompt extends this turn by the observation only
            following = rollout.turns[k + 1].prompt_ids
            observation = str(tokenizer.decode(following[len(turn.prompt_ids) + len(ids) :]))
            closing = (
                "\n" if ids[-1] == tokenizer.convert_tokens_to_ids(TEMPLATE_END) else TEMPLATE_END + "\n"
            )
            assert observation.startswith(closing + "<|im_start|>user\n<tool_response>\nnoted ")
            assert observation.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    last = rollout.turns[-1]
    assert sequence == last.prompt_ids + last.completion_ids
    trained = [t for t, mine in zip(rollout.completion_ids, rollout.loss_mask, strict=True) if mine]
    assert trained == generated
    masked_logprobs = [lp for lp, mine in zip(rollout.logprobs, rollout.loss_mask, strict=True) if mine]
    assert masked_logprobs == [lp for t in rollout.turns for lp in t.logprobs]
    # Billed as the gateway would bill the requests: every turn's prompt, its cached part as the engine saw.
    assert rollout.billed_prompt_tokens == sum(len(log.prompts[t.request_id]) for t in rollout.turns)
    assert rollout.cached_prompt_tokens == sum(t.cached_tokens for t in rollout.turns)
    assert all(0 <= t.cached_tokens <= len(t.prompt_ids) for t in rollout.turns)
    if len(rollout.turns) > 1:  # a later turn's prompt starts with the earlier turns, in the prefix cache
        assert rollout.turns[-1].cached_tokens > 0


def test_many_episodes_train_on_exactly_the_generated_tokens(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_model("qwen3"), kv_cache_mib=8, seed=1)
    log = EngineLog(engine, monkeypatch)
    reg = registry()
    plans = [
        PromptPlan(env, seed, group, 1000 + group)
        for group, (env, seed) in enumerate(
            [
                ("test/notes5", 1),
                ("test/notes2", 2),
                ("test/vowels", 3),
                ("test/notes5", 4),
                ("test/notes2", 5),
            ]
        )
    ]
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3)
    driver = EpisodeDriver(engine, tokenizer, reg, params, always_note)
    tasks, rollouts = asyncio.run(driver.run(plans, ScoringContext()))
    assert [t.seed for t in tasks] == [1, 2, 3, 4, 5]
    assert [(r.group, r.env) for r in rollouts] == [(p.group, p.env) for p in plans for _ in range(3)]
    assert [len(r.turns) for r in rollouts] == [5] * 3 + [2] * 3 + [1] * 3 + [5] * 3 + [2] * 3
    for rollout in rollouts:
        check_token_fidelity(rollout, log, tokenizer)
        assert rollout.error is None and set(rollout.components) in ({"variety"}, {"share", "short"})
        assert set(rollout.generated_versions) == {0}
    # The learner gets the same ids, the loss mask over exactly the generated tokens, one advantage each.
    batch = to_samples(rollouts, AlgorithmSection(), group_size=3, max_new_tokens=12)
    for sample, rollout in zip(batch.samples, rollouts, strict=True):
        assert sample.token_ids == rollout.prompt_ids + rollout.completion_ids
        assert sample.loss_mask == rollout.loss_mask
        assert sample.behaviour_logprobs == rollout.logprobs
    # Continuous batching across turns: later turns were submitted while other episodes' requests ran.
    running: set[str] = set()
    overlapped = 0
    for event, request_id in log.events:
        if event == "add":
            overlapped += not request_id.endswith("-0") and bool(running)
            running.add(request_id)
        else:
            running.discard(request_id)
    assert overlapped > 0
    assert engine.has_unfinished() is False


def test_a_tools_aware_template_gets_the_tools_natively_token_in_token_out(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8, seed=2)
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    template = ChatTemplate(tokenizer)
    assert template.native_tools and template.tool_format() is HERMES
    log = EngineLog(engine, monkeypatch)
    reg = registry()
    plans = [PromptPlan("test/notes5", 1, 0, 7), PromptPlan("test/vowels", 2, 1, 8)]
    driver = EpisodeDriver(
        engine, tokenizer, reg, SamplingParams(max_tokens=8, temperature=1.0, n=2), always_note
    )
    tasks, rollouts = asyncio.run(driver.run(plans, ScoringContext()))
    notes = tasks[0]
    first = str(tokenizer.decode(rollouts[0].prompt_ids))
    assert first == template.render(notes.messages, task_tools(notes))
    assert first.startswith("<|im_start|>system\nYou keep notes with tools.\n\n# Tools\n<tools>\n")
    assert json.dumps(notes.tools[0]) in first  # the template's own listing, not the text convention's
    assert "You may call functions" not in first
    # A task without tools renders as the template alone.
    assert str(tokenizer.decode(rollouts[2].prompt_ids)) == template.render(tasks[1].messages)
    assert [len(r.turns) for r in rollouts] == [5, 5, 1, 1]
    for rollout in rollouts:
        check_token_fidelity(rollout, log, tokenizer)


def test_replies_are_read_in_the_templates_format_and_a_malformed_call_is_answered(
    tiny_model: Callable[[str], Path],
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    parse = template_reply(ChatTemplate(tokenizer))
    env = notes_env("test/notes5", 5)
    task = env.task(3)
    reply = parse('Noting.\n<tool_call>\n{"name": "note", "arguments": {"text": "hi"}}\n</tool_call>', task)
    assert reply["content"] == "Noting."
    assert [ToolCall.from_openai(raw) for raw in reply["tool_calls"]] == [
        ToolCall("call_0", "note", '{"text": "hi"}')
    ]
    plain = letters_env("test/vowels", "aeiou").task(1)
    assert parse("<tool_call>{}</tool_call>", plain) == {
        "role": "assistant",
        "content": "<tool_call>{}</tool_call>",
    }

    async def step_malformed() -> list[Message]:
        async with await env.start(task, ScoringContext()) as episode:
            results = await episode.step(parse('<tool_call>{"name": note}</tool_call>', task))
            assert not episode.done  # the model gets another turn to write the call properly
            return results

    malformed = parse('<tool_call>{"name": note}</tool_call>', task)
    assert [call["function"]["name"] for call in malformed["tool_calls"]] == [MALFORMED_TOOL]
    [result] = asyncio.run(step_malformed())
    assert result["role"] == "tool" and result["tool_call_id"] == "call_0"
    assert result["content"].startswith("error: your tool call could not be read (not valid JSON")


def test_the_default_reply_parser_steps_episodes_with_the_templates_format(
    tiny_model: Callable[[str], Path],
) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8, seed=3)
    driver = EpisodeDriver(engine, tokenizer, registry(), SamplingParams(max_tokens=6, n=2))
    _, rollouts = asyncio.run(driver.run([PromptPlan("test/notes2", 1, 0, 9)], ScoringContext()))
    # A random model writes no call: its reply, read by the template's format, is the final answer.
    for rollout in rollouts:
        assert rollout.error is None and len(rollout.turns) == 1
        assert rollout.transcript[-1] == {"role": "assistant", "content": rollout.text.strip()}


def test_a_template_with_an_unknown_tool_format_is_refused_before_any_episode_starts(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8)
    # Renders tools, but has the model write calls in a way no format in tether.chat.tool_format reads.
    tokenizer.chat_template = (
        "{% if tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}{% for m in messages %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    started: list[str] = []
    start = Environment.start

    async def spy(env: Environment, task: Task, ctx: ScoringContext) -> Any:
        started.append(task.env)
        return await start(env, task, ctx)

    monkeypatch.setattr(Environment, "start", spy)
    driver = EpisodeDriver(engine, tokenizer, registry(), SamplingParams(max_tokens=4), always_note)
    with pytest.raises(ChatError, match="renders tools in a format tether does not parse"):
        asyncio.run(driver.run([PromptPlan("test/notes2", 1, 0, 3)], ScoringContext()))
    assert started == [] and not engine.has_unfinished()


def test_observation_suffix_is_what_the_template_renders(tiny_model: Callable[[str], Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    encoder = ObservationEncoder(ChatTemplate(tokenizer))
    (end,) = tokenizer.encode(TEMPLATE_END)
    tool = [{"role": "user", "content": "result"}]
    after_end = tokenizer.decode(encoder.encode(tool, end))
    assert after_end == "\n<|im_start|>user\nresult<|im_end|>\n<|im_start|>assistant\n"
    # A turn cut short by max_tokens: the template's end of turn comes first, as an observation token.
    cut = tokenizer.decode(encoder.encode(tool, tokenizer.encode("x")[0]))
    assert cut == "<|im_end|>\n<|im_start|>user\nresult<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="at least one message"):
        encoder.encode([], end)


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_model: Callable[[str], Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    # Like templates that drop the reasoning of earlier assistant turns: the past changes once it is past.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.last %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="renders an earlier turn differently"):
        ObservationEncoder(ChatTemplate(tokenizer)).encode([{"role": "user", "content": "x"}], 0)


@pytest.mark.parametrize(
    ("turns", "message"),
    [
        ([], "at least one turn"),
        (
            [Turn("a", [1, 2], [3], [-0.1], [0], "stop"), Turn("b", [1, 9, 3, 4], [5], [-0.2], [0], "stop")],
            "does not extend",
        ),
        (
            [Turn("a", [1, 2], [3], [-0.1], [0], "stop"), Turn("b", [1, 2], [5], [-0.2], [0], "stop")],
            "does not extend",
        ),
    ],
)
def test_turns_that_do_not_extend_the_episode_are_refused(turns: list[Turn], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        assemble(turns)


def test_assemble_masks_observation_tokens() -> None:
    turns = [
        Turn("a", [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop"),
        Turn("b", [1, 2, 3, 4, 8, 9], [5], [-0.3], [1], "length"),
    ]
    trajectory = assemble(turns)
    assert trajectory.prompt_ids == [1, 2]
    assert trajectory.completion_ids == [3, 4, 8, 9, 5]
    assert trajectory.loss_mask == [True, True, False, False, True]
    assert trajectory.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert trajectory.versions == [0, 0, -1, -1, 1]


def tiny_config(model: Path, out_dir: Path, mode: str) -> TrainConfig:
    return parse_config(
        {
            "model": {"name": str(model), "kv_cache_mib": 8},
            "envs": {"weights": {"test/notes2": 1.0, "test/notes5": 1.0, "test/vowels": 1.0}},
            "rollout": {"prompts_per_step": 3, "samples_per_prompt": 2, "max_new_tokens": 8},
            "optim": {"lr": 1e-3, "micro_batch": 4},
            "run": {"name": "multi", "out_dir": str(out_dir), "steps": 2, "seed": 3, "mode": mode},
        }
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_training_steps_on_a_multi_turn_mixture(
    tiny_model: Callable[[str], Path], tmp_path: Path, mode: str
) -> None:
    config = tiny_config(tiny_model("llama"), tmp_path, mode)
    torch.manual_seed(config.run.seed)
    engine, tokenizer = LLMEngine.from_pretrained(config.model.name, kv_cache_mib=config.model.kv_cache_mib)
    model, _, _ = load(config.model.name)
    learner = Learner(model, **learner_options(config))
    reg = registry()
    ctx = ScoringContext()
    params = SamplingParams(max_tokens=8, temperature=1.0, n=2)
    source = EngineRollouts(engine, tokenizer, reg, ctx, params, parse_reply=always_note)
    trainer = Trainer(config, engine, tokenizer, learner, reg, ctx, rollouts=source)
    trainer.start_run_dir(resume=False)
    try:
        history = trainer.run()
    finally:
        trainer.close()
    assert [m["step"] for m in history] == [1, 2]
    plans, _ = plan_prompts(trainer.mixture, {}, 3, config.run.seed, 0)
    assert any(reg.get(p.env).multi_turn for p in plans)
    assert all(metrics["turns"] > 1 for metrics in history)
    on_policy = history if mode == "sync" else history[:1]
    for metrics in on_policy:  # the learner recomputes the engine's logprobs: ratios of 1, no correction
        assert metrics["staleness_max"] == 0 and metrics["learner/importance_sampling"] == 0.0
        assert metrics["learner/compared_tokens"] > 0  # the gap below covers trained tokens
        assert metrics["learner/max_logprob_diff"] <= 1e-5
        assert metrics["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    if mode == "async":  # step 2 trains on tokens of version 0 with version 1: truncated IS, and it says so
        stale = history[1]
        assert stale["staleness_max"] == 1 and stale["learner/importance_sampling"] == 1.0
        assert stale["learner/max_logprob_diff"] > 1e-5 and stale["learner/ratio_std"] > 0
    transcripts = [
        json.loads(line) for line in (tmp_path / "multi" / "transcripts.jsonl").read_text().splitlines()
    ]
    assert any(
        t.get("turns", 1) > 1 and t["transcript"][-1]["role"] in {"tool", "assistant"} for t in transcripts
    )


async def _crash(_workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    raise RuntimeError("tool crashed")


def test_an_environment_that_fails_is_retried_then_marked_failed_alone(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8, seed=1)
    log = EngineLog(engine, monkeypatch)
    reg = registry()
    spec = ToolSpec("note", "Crashes.", {"type": "object"})
    reg.add(replace(notes_env("test/broken", 3), tools=(Tool(spec, _crash),)))
    plans = [PromptPlan("test/broken", 1, 0, 5), PromptPlan("test/notes2", 2, 1, 6)]
    driver = EpisodeDriver(engine, tokenizer, reg, SamplingParams(max_tokens=6, n=2), always_note)
    _, rollouts = asyncio.run(driver.run(plans, ScoringContext()))
    assert [r.error for r in rollouts] == ["RuntimeError: tool crashed"] * 2 + [None] * 2
    assert [r.infra_failure for r in rollouts] == ["scorer_error"] * 2 + [None] * 2
    assert [r.retry_reasons for r in rollouts] == [["scorer_error"] * 2] * 2 + [[]] * 2
    # Each try ran again from the first turn with the same seed: the same first token ids.
    tries = [ids for request_id, ids in log.outputs.items() if request_id.startswith("episode-5-0-0-0")]
    assert len(tries) == 3 and all(ids == tries[0] for ids in tries)
    assert [len(r.turns) for r in rollouts] == [1, 1, 2, 2]
    assert rollouts[0].reward == 0.0 and rollouts[0].components == {}
    for rollout in rollouts:
        check_token_fidelity(rollout, log, tokenizer)
    assert not engine.has_unfinished()


def test_an_episode_the_sandbox_cannot_open_is_retried_then_marked_failed(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8, seed=1)
    original = Environment.start
    failures: list[Exception] = []

    async def start(self: Environment, task: Task, ctx: ScoringContext) -> Any:
        if failures:
            raise failures.pop()
        return await original(self, task, ctx)

    monkeypatch.setattr(Environment, "start", start)
    driver = EpisodeDriver(engine, tokenizer, registry(), SamplingParams(max_tokens=4, n=1), always_note)
    plans = [PromptPlan("test/notes2", 3, 0, 9)]
    failures.append(InfraError(InfraReason.SANDBOX_ERROR, "NoFreeSlot: no sandbox slot freed up"))
    _, (opened,) = asyncio.run(driver.run(plans, ScoringContext()))
    assert opened.infra_failure is None and opened.retry_reasons == ["sandbox_error"] and opened.turns
    failures.extend(InfraError(InfraReason.SANDBOX_ERROR, "no slot") for _ in range(3))
    _, (failed,) = asyncio.run(driver.run(plans, ScoringContext()))
    assert failed.infra_failure == "sandbox_error" and failed.retries == 2
    assert failed.completion_ids == [] and failed.turns == [] and failed.error == "InfraError: no slot"
