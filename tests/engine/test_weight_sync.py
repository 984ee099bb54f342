"""Weight sync over a gloo group to two engine processes serving requests: no in-flight request is lost,
every token after an update comes from the new weights (checked against an in-process engine holding
them), each engine reports the new version, and a bad update is refused on both sides without a hang.

The two engines (spawned processes, one CPU thread each) run different update policies: `wait` (the
update queues behind the requests in flight) and `pause_resume` (applied at once, the requests carry on
under the new weights). Each engine step sleeps a little so that requests are surely in flight when the
update arrives, whatever the load on the machine. Every process also holds a default process group of its
own (as a learner or a tensor-parallel engine would): the sync group stands beside it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tether.engine import EngineConfig, FinishReason
from tether.engine.async_engine import AsyncEngine, AsyncEngineConfig
from tether.engine.llm_engine import LLMEngine, RequestOutput
from tether.engine.model_runner import ModelRunner, WeightUpdateError
from tether.engine.sampling import SamplingParams
from tether.engine.weight_buckets import TensorSlot, UpdatePlan, plan_update
from tether.engine.weight_receiver import WeightReceiver
from tether.engine.weight_sync import (
    SyncBackend,
    WeightSender,
    WeightSyncConfig,
    WeightSyncError,
)
from tether.engine.weight_update import UpdatePolicy, WeightUpdateConfig
from tether.errors import ConfigError
from tether.models import load
from tether.web import free_port

BLOCK = 4
PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 8, 6], [4, 4, 12, 1, 9, 2]]
IN_FLIGHT = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
AFTER = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
POLICIES = {1: UpdatePolicy.WAIT, 2: UpdatePolicy.PAUSE_RESUME}
STEP_SLEEP_S = 0.02
REPLY_TIMEOUT_S = 60.0


def sync_config(port: int = 0, timeout_s: float = 30.0) -> WeightSyncConfig:
    # A bucket of a few KiB: the tiny model's update spans many buckets, as a real model's does.
    return WeightSyncConfig(num_engines=2, port=port, bucket_mib=1 / 64, timeout_s=timeout_s)


def make_engine(path: Path, policy: UpdatePolicy, engine_type: type[LLMEngine] = LLMEngine) -> LLMEngine:
    model, _, _ = load(path)
    config = EngineConfig(
        num_blocks=128, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128
    )
    runner = ModelRunner(model, num_blocks=128, block_size=BLOCK)
    return engine_type(runner, config, weight_update=WeightUpdateConfig(policy))


def version_weights(path: Path, version: int) -> dict[str, torch.Tensor]:
    """Every parameter, perturbed by a seed of its version (version 0: the checkpoint's own)."""
    model, _, _ = load(path)
    generator = torch.Generator().manual_seed(version)
    return {
        name: p.detach() + (0.05 * version) * torch.randn(p.shape, generator=generator)
        for name, p in model.named_parameters()
    }


# --- the engine process ----------------------------------------------------------------------------------


class SlowEngine(LLMEngine):
    """An engine whose steps take at least STEP_SLEEP_S: requests stay in flight long enough to be hit."""

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_SLEEP_S)
        return super().step()


Completed = tuple[list[int], list[int], str]  # token ids, their versions, finish reason


async def _complete(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams, started: asyncio.Event
) -> Completed:
    tokens: list[int] = []
    versions: list[int] = []
    finish = ""
    retries = 0
    async for delta in engine.generate(prompt, params):
        if delta.retries != retries:  # abort_and_retry restarted it: what came before is void
            retries, tokens, versions = delta.retries, [], []
        for completion in delta.completions:
            tokens += completion.token_ids
            versions += completion.versions
            finish = completion.finish_reason.value if completion.finish_reason else finish
        if tokens:
            started.set()
    return tokens, versions, finish


async def _serve(engine: AsyncEngine, receiver: WeightReceiver, commands: Any, replies: Any) -> None:
    background: list[asyncio.Task[Completed]] = []
    while True:
        command, argument = await asyncio.to_thread(commands.get)
        if command == "start":
            events = [asyncio.Event() for _ in argument]
            background = [
                asyncio.create_task(_complete(engine, p, IN_FLIGHT, e))
                for p, e in zip(argument, events, strict=True)
            ]
            await asyncio.gather(*(event.wait() for event in events))
            replies.put("in flight")
        elif command == "collect":
            replies.put(await asyncio.gather(*background))
        elif command == "generate":
            replies.put(
                await asyncio.gather(*(_complete(engine, p, AFTER, asyncio.Event()) for p in argument))
            )
        elif command == "stats":
            stats = engine.stats
            assert stats.weights is not None
            replies.put((stats.weights.policy_version, stats.weights.num_pending_updates, stats.num_running))
        elif command == "refusals":
            replies.put(receiver.refusals)
        elif command == "stop":
            receiver.close()
            replies.put((receiver.refusals, repr(receiver.error), receiver.is_running))
            engine.shutdown()
            return


def own_default_group() -> None:
    """A default group of this process alone, as a learner's or a tensor-parallel engine's would be."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def engine_process(path: Path, port: int, rank: int, commands: Any, replies: Any) -> None:
    torch.set_num_threads(1)
    own_default_group()
    engine = AsyncEngine(make_engine(path, POLICIES[rank], SlowEngine), AsyncEngineConfig(idle_poll_s=0.05))
    engine.start()
    receiver = WeightReceiver(engine, sync_config(port), rank)
    receiver.start()
    total = torch.ones(1)
    dist.all_reduce(total)  # the default group works beside the sync group
    assert total.item() == 1
    asyncio.run(_serve(engine, receiver, commands, replies))
    dist.destroy_process_group()


@dataclass
class Engines:
    sender: WeightSender
    commands: dict[int, Any]
    replies: dict[int, Any]
    version: int = 0

    def ask(self, command: str, argument: Any = None) -> dict[int, Any]:
        for queue in self.commands.values():
            queue.put((command, argument))
        return {rank: queue.get(timeout=REPLY_TIMEOUT_S) for rank, queue in self.replies.items()}


@pytest.fixture(scope="module")
def tiny_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def engines(tiny_path: Path) -> Iterator[Engines]:
    context = multiprocessing.get_context("spawn")
    sender = WeightSender(sync_config())
    commands = {rank: context.Queue() for rank in POLICIES}
    replies = {rank: context.Queue() for rank in POLICIES}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    processes = [
        context.Process(
            target=engine_process,
            args=(tiny_path, sender.port, rank, commands[rank], replies[rank]),
            daemon=True,
        )
        for rank in POLICIES
    ]
    for process in processes:
        process.start()
    own_default_group()
    try:
        sender.connect()
        yield Engines(sender, commands, replies)
    finally:
        dist.destroy_process_group()
        for process in processes:
            if process.is_alive():
                process.join(5)
            if process.is_alive():
                process.kill()


def greedy_continuation(path: Path, version: int, prefix: list[int], count: int) -> list[int]:
    engine = make_engine(path, UpdatePolicy.WAIT)
    if version:
        engine.update_weights(version_weights(path, version), version)
    [output] = engine.generate([prefix], SamplingParams(max_tokens=count, temperature=0, ignore_eos=True))
    return output.completions[0].token_ids


def assert_from_their_versions(path: Path, prompt: list[int], completed: Completed) -> None:
    """Each run of tokens of one version is what that version's weights continue greedily from what
    came before it: the tokens after an update come from the new weights."""
    tokens, versions, finish = completed
    assert finish in (FinishReason.STOP.value, FinishReason.LENGTH.value) and len(tokens) == len(versions)
    start = 0
    while start < len(tokens):
        end = start
        while end < len(tokens) and versions[end] == versions[start]:
            end += 1
        expected = greedy_continuation(path, versions[start], prompt + tokens[:start], end - start)
        assert tokens[start:end] == expected, (versions[start], start)
        start = end


def test_an_update_reaches_both_engines_with_requests_in_flight_and_none_is_lost(
    engines: Engines, tiny_path: Path
) -> None:
    assert engines.ask("start", PROMPTS) == {1: "in flight", 2: "in flight"}
    version = engines.version + 1
    stats = engines.sender.send(version_weights(tiny_path, version), version)
    assert stats.version == version and stats.num_buckets > 1
    waiting, deadline = engines.ask("stats"), time.monotonic() + REPLY_TIMEOUT_S
    while waiting[1][:2] == (0, 0):  # handed over; the engine thread takes it after its current step
        assert time.monotonic() < deadline, "the engine never took the update"
        waiting = engines.ask("stats")
    assert waiting[1][1] == 1 and waiting[1][2] > 0, "under wait the update queues behind running requests"
    engines.sender.wait_applied(version)
    engines.version = version
    during = engines.ask("collect")
    for completions in during.values():
        assert len(completions) == len(PROMPTS), "no request lost"
        for prompt, completed in zip(PROMPTS, completions, strict=True):
            assert len(completed[0]) == IN_FLIGHT.max_tokens
            assert_from_their_versions(tiny_path, prompt, completed)
    assert all(set(versions) == {0} for _, versions, _ in during[1]), "wait: nothing mixed"
    assert all(set(versions) == {0, version} for _, versions, _ in during[2]), "pause_resume: both"
    after = engines.ask("generate", PROMPTS)
    for completions in after.values():
        for prompt, completed in zip(PROMPTS, completions, strict=True):
            assert set(completed[1]) == {version}
            assert_from_their_versions(tiny_path, prompt, completed)
    assert {rank: reply[0] for rank, reply in engines.ask("stats").items()} == {1: version, 2: version}


def test_a_second_version_follows(engines: Engines, tiny_path: Path) -> None:
    version = engines.version + 1
    engines.sender.send(version_weights(tiny_path, version), version)
    engines.sender.wait_applied(version)
    engines.version = version
    after = engines.ask("generate", PROMPTS[:1])
    for completions in after.values():
        assert set(completions[0][1]) == {version}
        assert_from_their_versions(tiny_path, PROMPTS[0], completions[0])
    assert {rank: reply[0] for rank, reply in engines.ask("stats").items()} == {1: version, 2: version}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("unknown", r"unknown parameter 'model.layers.0.mlp.bogus.weight'"),
        ("shape", r"parameter 'model.norm.weight' has shape \(64,\), got \(3,\)"),
        ("stale", r"version 1: expected an integer greater than"),
    ],
)
def test_a_mismatched_update_is_refused_by_both_engines_and_changes_nothing(
    engines: Engines, tiny_path: Path, change: str, message: str
) -> None:
    weights = version_weights(tiny_path, engines.version + 1)
    version = 1 if change == "stale" else engines.version + 1
    if change == "unknown":
        weights["model.layers.0.mlp.bogus.weight"] = torch.zeros(2, 2)
    if change == "shape":
        weights["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(WeightSyncError, match=rf"engine rank 1: .*{message}.*engine rank 2: .*{message}"):
        engines.sender.send(weights, version)
    for refusals in engines.ask("refusals").values():
        assert re.search(message, refusals[-1]), "the engine's side has the reason too"
    assert {rank: reply[0] for rank, reply in engines.ask("stats").items()} == {
        1: engines.version,
        2: engines.version,
    }


def test_closing_the_sender_stops_each_receiver_cleanly(engines: Engines) -> None:
    engines.sender.close()
    for _, error, running in engines.ask("stop").values():
        assert error == "None" and not running


# --- without engine processes ----------------------------------------------------------------------------


def test_a_missing_engine_is_a_timeout_naming_the_group_not_a_hang() -> None:
    sender = WeightSender(WeightSyncConfig(num_engines=1, timeout_s=1.0))
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"group of 2 ranks .* did not form within 1 s"):
        sender.connect()
    assert time.monotonic() - start < 15


def test_send_before_connect_is_refused() -> None:
    sender = WeightSender(WeightSyncConfig(num_engines=1, timeout_s=1.0))
    with pytest.raises(WeightSyncError, match=r"send\(\) before connect\(\)"):
        sender.send({"w": torch.zeros(1)}, 1)


def test_an_engine_gone_silent_is_a_timeout_naming_it_not_a_hang(tiny_path: Path) -> None:
    config = WeightSyncConfig(num_engines=1, timeout_s=2.0)
    sender = WeightSender(config)
    engine = AsyncEngine(make_engine(tiny_path, UpdatePolicy.WAIT))
    engine.start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # in this process: the group stands alone
        joining = pool.submit(WeightReceiver, engine, replace(config, port=sender.port), 1)
        sender.connect()
        joining.result(timeout=30)  # joined, but its thread never starts: it never answers
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"engine rank\(s\) \[1\] did not check version 1 within 2 s"):
        sender.send(version_weights(tiny_path, 1), 1)
    assert time.monotonic() - start < 15
    engine.shutdown()


def test_buckets_hold_at_most_their_bytes_and_a_large_tensor_travels_alone() -> None:
    shapes = [("a", (10,)), ("b", (20,)), ("big", (100,)), ("c", (5,)), ("empty", (0,))]
    plan = plan_update(shapes, 3, torch.float32, bucket_bytes=4 * 32)
    names = [[slot.name for slot in bucket] for bucket in plan.buckets]
    assert names == [["a", "b"], ["big"], ["c", "empty"]]
    assert plan.bucket_numels == [30, 100, 5] and plan.nbytes == 135 * 4
    assert plan.buckets[0][1] == TensorSlot("b", (20,), 10)
    assert UpdatePlan.from_message(plan.to_message()) == plan


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_engines", 0, r"num_engines = 0: expected an integer of at least 1"),
        ("port", 70000, r"port = 70000: expected an integer in 0..65535"),
        ("bucket_mib", 0, r"bucket_mib = 0: expected a finite number > 0"),
        ("timeout_s", float("inf"), r"timeout_s = inf"),
        ("backend", "mpi", r"backend = 'mpi': expected one of 'gloo', 'nccl'"),
    ],
)
def test_bad_sync_settings_are_refused_with_the_value(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WeightSyncConfig(**{field: value})


def test_backend_names_are_parsed_to_the_enum() -> None:
    assert WeightSyncConfig(backend="gloo").sync_backend is SyncBackend.GLOO


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (
            {"w": torch.zeros(2, dtype=torch.int64)},
            r"parameter 'w': expected a floating-point tensor, got torch.int64",
        ),
        ({"w": [0.0, 1.0]}, r"parameter 'w': expected a floating-point tensor, got list"),
        ({}, r"needs at least one named tensor; got none"),
    ],
)
def test_a_bad_update_is_refused_by_the_sender_before_anything_is_posted(
    tensors: dict[str, Any], message: str
) -> None:
    sender = WeightSender(WeightSyncConfig(num_engines=1, timeout_s=1.0))
    with pytest.raises(WeightUpdateError, match=message):
        sender.send(tensors, 1)


@pytest.mark.parametrize("rank", [0, 3, True])
def test_an_engine_rank_outside_the_group_is_refused(tiny_path: Path, rank: int) -> None:
    engine = AsyncEngine(make_engine(tiny_path, UpdatePolicy.WAIT))
    with pytest.raises(ConfigError, match=r"engine rank = .*: expected an integer in 1..2"):
        WeightReceiver(engine, sync_config(port=1), rank)


def test_an_engine_driven_by_its_caller_takes_one_message_per_receive(tiny_path: Path) -> None:
    config = WeightSyncConfig(num_engines=1, timeout_s=20.0)
    sender = WeightSender(config)
    engine = make_engine(tiny_path, UpdatePolicy.WAIT)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the engine's side, in this process
        joining = pool.submit(WeightReceiver, engine, replace(config, port=sender.port), 1)
        sender.connect()
        receiver = joining.result(timeout=30)
        with pytest.raises(ConfigError, match=r"a receiver thread needs an AsyncEngine"):
            receiver.start()
        with pytest.raises(WeightSyncError, match=r"rank 1: no message from the sender within 0.2 s"):
            receiver.receive(timeout_s=0.2)
        weights = version_weights(tiny_path, 1)
        taking = pool.submit(receiver.receive)
        sender.send(weights, 1)
        assert taking.result(timeout=30) == 1
        sender.wait_applied(1)
        assert engine.policy_version == 1
        held = dict(engine.named_parameters())
        assert all(torch.equal(held[name], tensor) for name, tensor in weights.items())
        taking = pool.submit(receiver.receive)
        with pytest.raises(WeightSyncError, match=r"version 1: expected an integer greater than 1"):
            sender.send(weights, 1)
        assert taking.result(timeout=30) is None and len(receiver.refusals) == 1
        taking = pool.submit(receiver.receive)
        sender.close()
        assert taking.result(timeout=30) is None and receiver.closed
