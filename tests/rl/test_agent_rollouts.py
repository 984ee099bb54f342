"""RL over agent tasks through the agents' `TaskRunner`: token in and token out over turns, the success
check as the reward, resume after a cancelled rollout without applying a step twice, bad configs refused;
and the acceptance loop: 2 GRPO steps on `agent/shell`, then `tether agent run` on the checkpoint."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from tether.agents.context import NO_ACTION_NUDGE
from tether.agents.families import AgentFamily, family_spec
from tether.agents.runner import TaskRunner
from tether.agents.task import CheckSpec, ContextSpec, TaskSpec
from tether.chat import ChatError, ChatRequest
from tether.chat.template import ChatTemplate
from tether.cli.main import app
from tether.engine.llm_engine import Completion, LLMEngine, RequestOutput
from tether.engine.sampling import SamplingParams
from tether.engine.sequence import FinishReason
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.registry import EnvRegistry
from tether.errors import ConfigError, InfraError, InfraReason
from tether.rl.agent_rollouts import (
    AgentRollouts,
    EngineTurns,
    TokenClient,
    TurnLog,
    agent_environment,
    register_agent_families,
)
from tether.rl.builders import build_trainer
from tether.rl.config import load_config, parse_config
from tether.rl.episodes import ObservationEncoder
from tether.rl.rollout import PromptPlan, Rollout
from tether.rl.sections import AlgorithmSection
from tether.rl.trainer import to_samples
from tether.sandbox import SandboxSpec
from tether.sandbox.result import RunResult, RunStatus
from tether.sandbox.session import SandboxSession
from tether.store.journal import Journal
from tether.tools import BUILTIN_TOOLS

END = "<|im_end|>"


@pytest.fixture(scope="module")
def long_model(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for an agent task's prompt (its tools alone take ~2,000 tokens)."""
    folder = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return folder


def sandbox() -> SandboxProvider:
    return SandboxProvider(SandboxSpec(timeout_s=30))


class EngineLog:
    """The prompt each request gave the engine and what it generated."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, tuple[list[int], list[float]]] = {}
        add, step = engine.add_request, engine.step

        def add_request(request_id: str, prompt: list[int], params: Any = None, priority: int = 0) -> None:
            self.prompts[request_id] = list(prompt)
            add(request_id, prompt, params, priority)

        def logged_step() -> list[RequestOutput]:
            outputs = step()
            for output in (o for o in outputs if o.finished):
                (c,) = output.completions
                self.outputs[output.request_id] = (list(c.token_ids), list(c.logprobs))
            return outputs

        monkeypatch.setattr(engine, "add_request", add_request)
        monkeypatch.setattr(engine, "step", logged_step)


def test_agent_episodes_train_on_exactly_the_tokens_the_engine_saw_and_generated(
    long_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(long_model, kv_cache_mib=32, seed=1)
    log = EngineLog(engine, monkeypatch)
    registry = EnvRegistry()
    register_agent_families(registry, max_steps=3)
    plans = [PromptPlan("agent/shell", 2, 0, 1000), PromptPlan("agent/ledger", 0, 1, 2000)]
    params = SamplingParams(max_tokens=8, temperature=1.0, n=2)

    async def roll() -> tuple[list[Any], list[Rollout]]:
        async with sandbox() as provider:
            return await AgentRollouts(engine, tokenizer, params).run(
                plans, registry, ScoringContext(provider)
            )

    tasks, rollouts = asyncio.run(roll())
    assert [t.env for t in tasks] == ["agent/shell", "agent/ledger"]
    assert [(r.env, r.group) for r in rollouts] == [(p.env, p.group) for p in plans for _ in range(2)]
    template = ChatTemplate(tokenizer)
    for rollout, task in zip(rollouts, [tasks[0]] * 2 + [tasks[1]] * 2, strict=True):
        spec = TaskSpec.model_validate(task.data["agent_task"])
        # The runner's first prompt, rendered by the template with the role's tools, nothing else.
        first = rollout.turns[0].prompt_ids
        tools = BUILTIN_TOOLS.only(spec.roles[0].tools).specs()
        assert first == template.encode(task.messages, tools) and rollout.transcript[:2] == task.messages
        # A random model calls no tools: the runner nudges it, and the episode goes on to its budget.
        assert len(rollout.turns) == 3 and rollout.error is None
        sequence = rollout.prompt_ids + rollout.completion_ids
        for k, turn in enumerate(rollout.turns):
            assert turn.prompt_ids == log.prompts[turn.request_id]
            assert (turn.completion_ids, turn.logprobs) == log.outputs[turn.request_id]
            assert sequence[: len(turn.prompt_ids) + len(turn.completion_ids)] == (
                turn.prompt_ids + turn.completion_ids
            )
            if k + 1 < len(rollout.turns):
                following = rollout.turns[k + 1].prompt_ids
                suffix = str(tokenizer.decode(following[len(turn.prompt_ids) + len(turn.completion_ids) :]))
                assert NO_ACTION_NUDGE in suffix and suffix.endswith("<|im_start|>assistant\n")
        assert rollout.loss_mask is not None
        trained = [t for t, mine in zip(rollout.completion_ids, rollout.loss_mask, strict=True) if mine]
        assert trained == [t for turn in rollout.turns for t in turn.completion_ids]
        observed = [lp for lp, mine in zip(rollout.logprobs, rollout.loss_mask, strict=True) if not mine]
        assert observed and set(observed) == {0.0}
        # The check scored the workdir the episode left: untouched, so only the protected files pass.
        assert rollout.components["check"] == 0.0 and 0 < rollout.components["checks"] < 1
        assert not rollout.passed and rollout.reward == pytest.approx(0.2 * rollout.components["checks"])
    batch = to_samples(rollouts, parse_config(_config_dict(long_model, Path("."))).algorithm, 2, 8)
    for sample, rollout in zip(batch.samples, rollouts, strict=True):
        assert sample.token_ids == rollout.prompt_ids + rollout.completion_ids
        assert sample.loss_mask == rollout.loss_mask
    assert engine.has_unfinished() is False


@dataclass
class ScriptedEngine:
    """An engine that answers step n of every episode with reply n (token ids of the tiny tokenizer),
    so the runner really calls tools; `on_add` sees every request as the engine gets it."""

    tokenizer: Any
    replies: list[str]
    on_add: Callable[[str, int], None] = lambda _rid, _step: None
    hold_from_step: int | None = None  # requests of this step and later never finish (a stalled engine)
    config: Any = field(default_factory=lambda: SimpleNamespace(max_model_len=4096))
    requests: list[str] = field(default_factory=list)
    _pending: list[tuple[str, list[int]]] = field(default_factory=list)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        step_no = int(request_id.rsplit("-", 2)[1])
        self.requests.append(request_id)
        self._pending.append((request_id, list(prompt)))
        self.on_add(request_id, step_no)

    def abort(self, request_id: str) -> None:
        self._pending = [(rid, prompt) for rid, prompt in self._pending if rid != request_id]

    def step(self) -> list[RequestOutput]:
        outputs, held = [], []
        for request_id, prompt in self._pending:
            step_no = int(request_id.rsplit("-", 2)[1])
            if self.hold_from_step is not None and step_no >= self.hold_from_step:
                held.append((request_id, prompt))
                continue
            ids = [
                int(i) for i in self.tokenizer.encode(self.replies[step_no] + END, add_special_tokens=False)
            ]
            done = Completion(0, ids, [-0.5] * len(ids), [0] * len(ids), "", FinishReason.STOP)
            outputs.append(RequestOutput(request_id, prompt, [done], 0))
        self._pending = held
        return outputs

    async def step_async(self) -> list[RequestOutput]:
        """As `LLMEngine.step_async` on the CPU: a step in the loop's thread, then a yield."""
        outputs = self.step()
        await asyncio.sleep(0)
        return outputs


def call(name: str, arguments: dict[str, str]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


APPEND = [
    call("shell", {"command": "echo a >> log.txt"}),
    call("shell", {"command": "echo b >> log.txt"}),
    call("finish", {"summary": "done"}),
]


def log_family(context: ContextSpec | None = None) -> AgentFamily:
    check = CheckSpec(command='test "$(cat log.txt)" = "$(printf \'a\\nb\')"')

    def build(seed: int, max_steps: int) -> TaskSpec:
        spec = family_spec(f"append a then b to log.txt ({seed})", {"README": "x"}, check, max_steps)
        return spec if context is None else spec.model_copy(update={"context": context})

    return AgentFamily("agent/log", "append two lines", build)


def log_registry(context: ContextSpec | None = None) -> EnvRegistry:
    registry = EnvRegistry()
    registry.add(agent_environment(log_family(context), max_steps=5))
    return registry


def test_tool_calls_run_in_the_sandbox_and_the_check_is_the_reward(tiny_model: Callable[[str], Path]) -> None:
    _, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8)
    engine = ScriptedEngine(tokenizer, APPEND)
    params = SamplingParams(max_tokens=64, temperature=1.0, n=1)

    async def roll() -> list[Rollout]:
        async with sandbox() as provider:
            agents = AgentRollouts(engine, tokenizer, params)  # type: ignore[arg-type]
            _, rollouts = await agents.run(
                [PromptPlan("agent/log", 0, 0, 7)], log_registry(), ScoringContext(provider)
            )
            return rollouts

    (rollout,) = asyncio.run(roll())
    assert rollout.passed and rollout.reward == 1.0 and rollout.error is None
    assert [t.finish_reason for t in rollout.turns] == ["stop"] * 3
    assert [m["role"] for m in rollout.transcript[2:]] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    # The shell's (empty) result came back as the template's tool response, appended as tokens.
    second = rollout.turns[1].prompt_ids
    first = rollout.turns[0]
    suffix = str(tokenizer.decode(second[len(first.prompt_ids) + len(first.completion_ids) :]))
    assert "<tool_response>" in suffix and suffix.endswith("<|im_start|>assistant\n")


async def _roll_log_task(tokenizer: Any) -> Rollout:
    """One scripted `agent/log` episode (it appends to the log, then finishes), in a real sandbox."""
    async with sandbox() as provider:
        engine = ScriptedEngine(tokenizer, APPEND)
        agents = AgentRollouts(engine, tokenizer, SamplingParams(max_tokens=64, n=1))  # type: ignore[arg-type]
        _, (rollout,) = await agents.run(
            [PromptPlan("agent/log", 0, 0, 7)], log_registry(), ScoringContext(provider)
        )
        return rollout


@pytest.mark.parametrize("failing_runs", [1, 99])
def test_a_sandbox_error_in_an_agent_tasks_tool_call_is_retried_never_scored(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, failing_runs: int
) -> None:
    _, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8)
    original = SandboxSession.run
    left = [failing_runs]

    async def flaky(self: SandboxSession, code: str | bytes, *args: Any, **kwargs: Any) -> RunResult:
        if left[0] > 0:  # the worker died under the model's tool call
            left[0] -= 1
            return RunResult(status=RunStatus.SANDBOX_ERROR, error="worker w1 failed: EOF")
        return await original(self, code, *args, **kwargs)

    monkeypatch.setattr(SandboxSession, "run", flaky)

    rollout = asyncio.run(_roll_log_task(tokenizer))
    if failing_runs == 1:  # run again from its journal: the task succeeds as if nothing had happened
        assert rollout.passed and rollout.reward == 1.0 and rollout.infra_failure is None
        assert rollout.retry_reasons == ["sandbox_error"]
    else:  # the sandbox never recovers: left out, never a reward of 0 learned from
        assert rollout.infra_failure == "sandbox_error" and rollout.retries == 2
        assert to_samples([rollout], AlgorithmSection(), 1, 8).samples == []


def test_an_agent_episode_whose_runner_fails_resumes_from_its_journal_then_is_marked_failed(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8)
    original = TaskRunner.run
    failures: list[Exception] = []

    async def failing(self: TaskRunner, task_id: str, *args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop(0)
        return await original(self, task_id, *args, **kwargs)

    monkeypatch.setattr(TaskRunner, "run", failing)

    failures.append(InfraError(InfraReason.SANDBOX_ERROR, "the sandbox lost the session"))
    resumed = asyncio.run(_roll_log_task(tokenizer))
    assert resumed.passed and resumed.reward == 1.0 and resumed.infra_failure is None
    assert resumed.retry_reasons == ["sandbox_error"] and resumed.error is None
    failures.extend(RuntimeError("the runner broke") for _ in range(3))  # the try and both retries
    failed = asyncio.run(_roll_log_task(tokenizer))
    assert failed.infra_failure == "scorer_error" and failed.retries == 2
    assert failed.error == "RuntimeError: the runner broke" and failed.completion_ids == []
    assert to_samples([failed], AlgorithmSection(), 1, 8).samples == []  # never a sample


def test_a_cancelled_rollout_resumes_from_its_journal_without_applying_a_step_twice(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    _, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8)
    params = SamplingParams(max_tokens=64, temperature=1.0, n=2)
    plans = [PromptPlan("agent/log", 0, 0, 7)]
    registry = log_registry()

    async def first_run() -> None:
        runs: list[asyncio.Task[Any]] = []

        asked: list[int] = []

        def cancel_at_step_1(_request_id: str, step_no: int) -> None:
            asked.append(step_no)
            if asked.count(1) == 2:  # a crash once both episodes committed step 0, generating step 1
                runs[0].cancel()

        engine = ScriptedEngine(tokenizer, APPEND, on_add=cancel_at_step_1, hold_from_step=1)
        async with sandbox() as provider:
            agents = AgentRollouts(engine, tokenizer, params, state_dir=tmp_path)  # type: ignore[arg-type]
            runs.append(asyncio.create_task(agents.run(plans, registry, ScoringContext(provider))))
            with pytest.raises(asyncio.CancelledError):
                await runs[0]

    asyncio.run(first_run())
    engine = ScriptedEngine(tokenizer, APPEND)

    async def second_run() -> list[Rollout]:
        async with sandbox() as provider:
            agents = AgentRollouts(engine, tokenizer, params, state_dir=tmp_path)  # type: ignore[arg-type]
            return (await agents.run(plans, registry, ScoringContext(provider)))[1]

    rollouts = asyncio.run(second_run())
    # Step 0 was never asked for again, and the check saw each line once.
    assert sorted(int(rid.rsplit("-", 2)[1]) for rid in engine.requests) == [1, 1, 2, 2]
    assert all(r.passed and r.reward == 1.0 for r in rollouts)
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}")
    try:
        for sample in range(2):
            steps = journal.steps(f"rl-7-0-{sample}")
            assert [call.executions for step in steps for call in step.tool_calls] == [1, 1, 1]
    finally:
        journal.close()
    for rollout in rollouts:  # the token sequence goes on from the first run's turn
        assert len(rollout.turns) == 3 and rollout.loss_mask is not None


def test_a_context_that_folds_steps_is_refused(tiny_model: Callable[[str], Path]) -> None:
    _, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8)
    engine = ScriptedEngine(tokenizer, APPEND)
    agents = AgentRollouts(engine, tokenizer, SamplingParams(n=1))  # type: ignore[arg-type]
    for context, message in [
        (ContextSpec(recent_steps=2), "recent_steps = 2"),
        (ContextSpec(recent_steps=5, recall_k=3), "recall_k = 3"),
    ]:
        plans = [PromptPlan("agent/log", 0, 0, 7)]
        with pytest.raises(ConfigError, match=message):
            asyncio.run(agents.run(plans, log_registry(context), ScoringContext()))


def test_a_history_that_does_not_extend_the_last_turn_is_refused(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    _, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8)
    engine = ScriptedEngine(tokenizer, APPEND)
    template = ChatTemplate(tokenizer)
    client = TokenClient(
        EngineTurns(engine),  # type: ignore[arg-type]
        template,
        ObservationEncoder(template),
        SamplingParams(max_tokens=32),
        TurnLog(tmp_path / "turns.jsonl"),
        "t",
        0,
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    asyncio.run(client.complete(ChatRequest(messages, step_no=0)))
    rewritten = [{"role": "system", "content": "s"}, {"role": "user", "content": "other"}]
    with pytest.raises(ChatError, match="append-only"):
        asyncio.run(
            client.complete(ChatRequest([*rewritten, {"role": "user", "content": "next"}], step_no=1))
        )


def _config_dict(model: Path, out_dir: Path, **agents: Any) -> dict[str, Any]:
    return {
        "model": {"name": str(model), "kv_cache_mib": 32},
        "envs": {"weights": {"agent/shell": 1.0}},
        "rollout": {"prompts_per_step": 1, "samples_per_prompt": 2, "max_new_tokens": 8},
        # A random policy scores alike within a group (advantage 0): KL keeps the learner computing.
        "algorithm": {"kl_coef": 0.01},
        "optim": {"lr": 1e-3, "micro_batch": 2},
        "run": {"name": "agentrl", "out_dir": str(out_dir), "steps": 2, "seed": 3},
        "agents": {"max_steps": 2, **agents},
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rollout": {"backend": "vllm", "base_urls": ["http://h:1"]}}, "rollout.backend = 'local'"),
        ({"envs": {"weights": {"agent/shell": 1.0, "math/add": 1.0}}}, "mixture of their own"),
        ({"agents": {"max_steps": 0}}, "agents.max_steps"),
        ({"agents": {"journal": "disk"}}, "agents.journal"),
    ],
)
def test_bad_agent_training_configs_are_refused(
    long_model: Path, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    raw = {**_config_dict(long_model, tmp_path), **change}
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_config(raw)


def test_an_unknown_agent_family_is_refused_before_any_model_loads(tmp_path: Path) -> None:
    raw = _config_dict(tmp_path / "no-model", tmp_path)
    raw["envs"] = {"weights": {"agent/nope": 1.0}}
    with pytest.raises(Exception, match="unknown environment 'agent/nope'"):
        build_trainer(parse_config(raw))


def test_two_grpo_steps_on_agent_tasks_then_the_checkpoint_runs_the_same_task_as_an_agent(
    long_model: Path, tmp_path: Path
) -> None:
    config = parse_config(_config_dict(long_model, tmp_path, journal="run"))
    trainer = build_trainer(config, sandbox=sandbox())
    try:
        history = trainer.run()
    finally:
        trainer.close()
    assert [m["step"] for m in history] == [1, 2]
    for metrics in history:  # the learner recomputes the engine's logprobs over the agent's turns
        assert metrics["turns"] == 2 and metrics["learner/compared_tokens"] > 0
        assert metrics["learner/max_logprob_diff"] <= 1e-5
    run_dir = tmp_path / "agentrl"
    assert load_config(run_dir / "config.toml") == config
    assert (run_dir / "agent_journal" / "journal.db").is_file()
    # The episodes are agent tasks in a journal the agents' CLI reads, every step as a hosted agent's.
    listed = CliRunner().invoke(
        app, ["agent", "ls", "--json", "--store", f"sqlite:///{run_dir / 'agent_journal' / 'journal.db'}"]
    )
    episodes = json.loads(listed.output)
    assert len(episodes) == 4 and all(e["step_count"] == 2 and e["check"] for e in episodes)
    transcripts = [json.loads(line) for line in (run_dir / "transcripts.jsonl").read_text().splitlines()]
    assert transcripts and all(t["env"] == "agent/shell" and t["turns"] == 2 for t in transcripts)
    result = CliRunner().invoke(
        app,
        [
            "agent", "run", "--family", "agent/shell", "--seed", "0", "--max-steps", "2", "--device", "cpu",
            "--model", str(run_dir / "checkpoints" / "latest"), "--home", str(tmp_path / "home"),
        ],
    )  # fmt: skip
    # A random policy does not solve the task: the run ends on its budget, the check having failed.
    assert result.exit_code == 1, result.output
    assert "step   1 [agent]" in result.output
    task_id = result.output.split("task ", 1)[1].split()[0]
    shown = CliRunner().invoke(app, ["agent", "show", task_id, "--json", "--home", str(tmp_path / "home")])
    record = json.loads(shown.output)
    assert record["status"] == "failed" and record["check"].startswith("failed (exit status 1")
    assert record["spec"]["check"]["command"].startswith("python3 -I -c")


def test_a_turn_generated_again_after_a_crash_continues_from_the_turn_before_it(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The reply of step 1 was logged but its step never journaled: the resumed runner asks again."""
    _, tokenizer = LLMEngine.from_pretrained(tiny_model("llama"), kv_cache_mib=8)
    template = ChatTemplate(tokenizer)

    def client() -> TokenClient:
        engine = ScriptedEngine(tokenizer, ["first", "second"])
        turns = EngineTurns(engine)  # type: ignore[arg-type]
        log = TurnLog(tmp_path / "turns.jsonl")
        return TokenClient(turns, template, ObservationEncoder(template), SamplingParams(), log, "t", 0)

    first = client()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    asyncio.run(first.complete(ChatRequest(messages, step_no=0)))
    step_1 = ChatRequest([*first.log.seen, {"role": "user", "content": "go on"}], step_no=1)
    asyncio.run(first.complete(step_1))
    resumed = client()  # a new process reads the log
    assert resumed.log.steps == [0, 1]
    asyncio.run(resumed.complete(step_1))
    assert resumed.log.steps == [0, 1]
    assert resumed.log.turns[1].prompt_ids == first.log.turns[1].prompt_ids
    assert TurnLog(tmp_path / "turns.jsonl").turns == resumed.log.turns


class Crash(BaseException):
    """Stands for a killed process: no handler of the rollout catches it."""


def test_a_training_run_killed_mid_rollout_resumes_its_episodes_from_the_run_journal(
    long_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = _config_dict(long_model, tmp_path, journal="run")
    raw["run"] = {**raw["run"], "steps": 1}
    config = parse_config(raw)
    real = TokenClient.complete
    asked: list[tuple[str, int]] = []

    async def dies_at_the_third_call(self: TokenClient, request: ChatRequest) -> Any:
        asked.append((self.request_prefix, request.step_no))
        if len(asked) == 3:
            raise Crash
        return await real(self, request)

    monkeypatch.setattr(TokenClient, "complete", dies_at_the_third_call)
    trainer = build_trainer(config, sandbox=sandbox())
    with pytest.raises(Crash):
        try:
            trainer.run()
        finally:
            trainer.close()
    before = list(asked)
    asked.clear()
    trainer = build_trainer(config, sandbox=sandbox())  # no checkpoint yet: the run starts over
    try:
        (metrics,) = trainer.run()
    finally:
        trainer.close()
    # Every model call committed before the crash stays journaled and is never made again.
    journal = Journal(f"sqlite:///{tmp_path / 'agentrl' / 'agent_journal' / 'journal.db'}")
    try:
        committed = {(t.task_id, s.step_no) for t in journal.list_tasks() for s in journal.steps(t.task_id)}
    finally:
        journal.close()
    assert len(committed) == 4 and metrics["turns"] == 2
    # Both episodes committed step 0; the crash came at step 1. The crashed call is asked again; the
    # other episode's step 1 is asked again only if the crash cancelled it before it was journaled.
    assert [step for _, step in before[:3]] == [0, 0, 1]
    assert before[2] in asked and set(asked) <= {(task_id, 1) for task_id, _ in before[:2]}
    assert len(asked) == len(set(asked))  # no call is made twice
