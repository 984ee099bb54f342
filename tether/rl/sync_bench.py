"""`tether rl bench-sync`: seconds to move a model's weights to engine processes by each path tether has.

The same engine processes (Ray actors, each an `AsyncEngine` over an `LLMEngine` with the model loaded,
one torch thread) take every version by each path in turn, in the same run: Ray's object store (one
`ray.put`, every engine gets it: what `RayRollouts.load` does), a safetensors folder per version
(`SafetensorsDirTransport` writes it, every engine reads it), and the collective broadcast
(`WeightSender` over a gloo or NCCL group). A path's time runs from the sender holding the tensors to
every engine serving the new version (its `AsyncEngine` has applied it); after each, every engine's
version and a probe tensor are checked. The paths alternate over the repeats, so that load on a shared
machine falls on all of them; each figure is a median. The sharded learner is
then trained `learner_steps` steps single and as 2 FSDP2 ranks on the same batches (the ranks share this
machine's cores: their step time is reported, not compared). Nothing is printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.engine.weight_sync import WeightSender, WeightSyncConfig
from tether.errors import ConfigError
from tether.machine import machine_record
from tether.models.precision import resolve_device

Progress = Callable[[str], None]

PATHS = ("object_store", "safetensors", "collective")
PROBE = "model.norm.weight"
"""A small tensor each version changes, so that an engine's copy shows which version it holds."""


@dataclass(frozen=True, slots=True)
class SyncBenchConfig:
    model: str = "smollm2-135m-instruct"
    """Registered model name or HF folder."""
    cache_dir: Path | None = None
    engines: int = 2
    repeats: int = 3
    """Measured versions per path (the figure is their median), after `warmup` versions per path."""
    warmup: int = 1
    bucket_mib: float = 64.0
    backend: str = "gloo"
    """`nccl` needs CUDA engines and one GPU per rank (the sender's included): NCCL refuses two ranks on
    one device."""
    device: str = "cpu"
    """The engines' device (`cuda`: a GPU per engine actor where there are enough, else shared over
    gloo); the sender's tensors start on the CPU, as a learner's do on every path but the collective."""
    kv_cache_mib: int = 16
    """Each engine's KV cache: the engines only take weights here."""
    object_store_mib: int = 2048
    """Object store of the Ray cluster the bench starts (none when one is already running)."""
    timeout_s: float = 600.0
    learner_steps: int = 3
    """Steps of the learner trained single and as 2 FSDP2 ranks on the same batches (0: skip), for the
    sharded learner's weight gap and per-rank memory (`parity.compare_with_single`)."""

    def __post_init__(self) -> None:
        for name in ("engines", "repeats", "kv_cache_mib", "object_store_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"bench-sync {name} = {value!r}: expected an integer >= 1")
        for name in ("warmup", "learner_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"bench-sync {name} = {value!r}: expected an integer >= 0")
        self.sync_config()  # the collective's settings are checked where they are defined
        cuda = resolve_device(self.device, "bench-sync device").type == "cuda"
        if self.backend == "nccl" and not cuda:
            raise ConfigError("bench-sync backend = 'nccl' needs the engines on CUDA: add --device cuda")

    def sync_config(self, port: int = 0) -> WeightSyncConfig:
        return WeightSyncConfig(
            num_engines=self.engines,
            port=port,
            bucket_mib=self.bucket_mib,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )


def smoke_config(folder: Path) -> SyncBenchConfig:
    """A seconds-long run: a tiny random model written into `folder`, one measured version per path, one
    learner step."""
    from tether.testing import make_tiny_model

    return SyncBenchConfig(
        model=str(make_tiny_model(folder, "llama")), repeats=1, warmup=0, bucket_mib=1 / 64, learner_steps=1
    )


class BenchEngine:
    """A Ray actor: one engine serving nothing but weight updates, by whichever path brings them."""

    def __init__(self, model: str, cache_dir: Path | None, kv_cache_mib: int, device: str) -> None:
        from tether.engine.async_engine import AsyncEngine
        from tether.engine.llm_engine import LLMEngine
        from tether.engine.weight_receiver import WeightReceiver

        torch.set_num_threads(1)
        engine, _ = LLMEngine.from_pretrained(model, cache_dir, kv_cache_mib=kv_cache_mib, device=device)
        self.engine = AsyncEngine(engine)
        self.engine.start()
        self.receiver: WeightReceiver | None = None

    def join(self, config: Any, rank: int) -> None:
        """Join the sync group (waits for the sender's `connect`) and start taking broadcasts."""
        from tether.engine.weight_receiver import WeightReceiver

        self.receiver = WeightReceiver(self.engine, config, rank)
        self.receiver.start()

    def load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self._apply(weights.items(), version)

    def load_folder(self, folder: str, version: int) -> None:
        from safetensors.torch import load_file

        self._apply(load_file(str(Path(folder) / "model.safetensors")).items(), version)

    def state(self) -> tuple[int, float]:
        """The version served and the probe tensor's sum."""
        engine = self.engine.engine  # its version is set before the update's future resolves; stats lag
        probe = dict(engine.named_parameters())[PROBE]
        return engine.policy_version, float(probe.double().sum())

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.engine.shutdown()

    def _apply(self, items: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.submit_weights(items, version).result()


def version_weights(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """`base` with the probe moved by `version`: every version differs where the check looks."""
    return base | {PROBE: base[PROBE] + version * 1e-3}


def run_sync_bench(config: SyncBenchConfig, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Time every path on the same engines, alternating; the JSON-ready result."""
    from tether.models import load
    from tether.rl.ray_actors import require_ray
    from tether.rl.server_weights import SafetensorsDirTransport

    ray = require_ray()
    engine_gpus = _gpus(config)
    progress(f"loading {config.model}")
    model, _, _ = load(config.model, config.cache_dir)
    base = {name: p.detach() for name, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=config.engines,
            num_gpus=math.ceil(engine_gpus * config.engines),
            object_store_memory=config.object_store_mib * 2**20,
            include_dashboard=False,
            log_to_driver=False,
        )
    work = Path(tempfile.mkdtemp(prefix="tether-bench-sync-"))
    actors: list[Any] = []
    try:
        progress(f"starting {config.engines} engine processes")
        remote = ray.remote(BenchEngine).options(num_cpus=1, num_gpus=engine_gpus)
        # Ray shows each actor its own GPUs only: "cuda" there is the one it was given.
        device = "cuda" if engine_gpus else "cpu"
        actors = [
            remote.remote(config.model, config.cache_dir, config.kv_cache_mib, device)
            for _ in range(config.engines)
        ]
        sender = WeightSender(config.sync_config())
        sync = config.sync_config(sender.port)
        joined = [actor.join.remote(sync, rank) for rank, actor in enumerate(actors, start=1)]
        sender.connect()
        ray.get(joined)
        folders = SafetensorsDirTransport(work)

        def object_store(weights: dict[str, torch.Tensor], version: int) -> None:
            ref = ray.put(weights)
            ray.get([actor.load.remote(ref, version) for actor in actors])

        def safetensors(weights: dict[str, torch.Tensor], version: int) -> None:
            folder = asyncio.run(folders.send(list(weights.items()), version))
            ray.get([actor.load_folder.remote(folder, version) for actor in actors])

        def collective(weights: dict[str, torch.Tensor], version: int) -> None:
            sender.send(weights, version)
            sender.wait_applied(version)

        paths: dict[str, Callable[[dict[str, torch.Tensor], int], None]] = {
            "object_store": object_store,
            "safetensors": safetensors,
            "collective": collective,
        }
        times: dict[str, list[float]] = {name: [] for name in PATHS}
        load_before = os.getloadavg()[0]
        version = 0
        for round_index in range(config.warmup + config.repeats):
            for name in PATHS:
                version += 1
                weights = version_weights(base, version)
                start = time.perf_counter()
                paths[name](weights, version)
                seconds = time.perf_counter() - start
                _check(ray.get([actor.state.remote() for actor in actors]), version, weights[PROBE], name)
                times[name].append(seconds)
                kind = (
                    "warm-up"
                    if round_index < config.warmup
                    else f"{round_index - config.warmup + 1}/{config.repeats}"
                )
                progress(f"{name} {kind}: {seconds:.2f} s")
        load_after = os.getloadavg()[0]
        sender.close()
    finally:
        for actor in actors:
            # A failed actor must not keep the others (or the cluster) alive: close what answers.
            with contextlib.suppress(Exception):
                ray.get(actor.close.remote(), timeout=30)
            ray.kill(actor)
        if started:
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(values[config.warmup :]) for name, values in times.items()}
    learner: dict[str, float | None] = {
        "fsdp2_max_abs_diff_vs_single": None,
        "rank_memory_ratio_2_vs_1": None,
    }
    if config.learner_steps:
        from tether.rl.parity import compare_with_single

        progress(f"learner: {config.learner_steps} steps single, then as 2 FSDP2 ranks")
        learner = dict(compare_with_single(config.model, config.learner_steps, 2, config.cache_dir))
    return {
        "model": config.model,
        "engines": config.engines,
        "parameters": sum(t.numel() for t in base.values()),
        "bytes": nbytes,
        "dtype": str(next(iter(base.values())).dtype).removeprefix("torch."),
        "backend": config.backend,
        "device": config.device,
        "bucket_mib": config.bucket_mib,
        "repeats": config.repeats,
        "warmup": config.warmup,
        "timed": "from the sender holding the tensors to every engine serving the new version",
        "object_store_s": medians["object_store"],
        "safetensors_s": medians["safetensors"],
        "collective_s": medians["collective"],
        "collective_speedup_vs_object_store": medians["object_store"] / medians["collective"],
        "collective_speedup_vs_safetensors": medians["safetensors"] / medians["collective"],
        "seconds": {name: [round(s, 4) for s in values] for name, values in times.items()},
        **learner,
        "learner_steps": config.learner_steps,
        "torch_threads_per_engine": 1,
        "cores": os.cpu_count(),
        "machine": machine_record(
            config.engines, round(load_before, 2), {"after the transfers": round(load_after, 2)}
        ),
    }


def _gpus(config: SyncBenchConfig) -> float:
    """GPUs per engine actor. NCCL needs a GPU per rank: the engines get the first ones, the sender (this
    process) the last. Over gloo, fewer GPUs than engines are shared."""
    if resolve_device(config.device).type != "cuda":
        return 0.0
    count = torch.cuda.device_count()
    if config.backend == "nccl":
        if count < config.engines + 1:
            raise ConfigError(
                f"bench-sync backend = 'nccl' needs {config.engines + 1} GPUs (one per engine, one for the "
                f"sender: NCCL refuses two ranks on one GPU), this machine has {count}; use --backend gloo"
            )
        torch.cuda.set_device(count - 1)
        return 1.0
    return min(1.0, count / config.engines)


def _check(states: list[tuple[int, float]], version: int, probe: torch.Tensor, path: str) -> None:
    expected = float(probe.double().sum())
    for rank, (held, total) in enumerate(states, start=1):
        if held != version or not math.isclose(total, expected, rel_tol=1e-6, abs_tol=1e-6):
            raise RuntimeError(
                f"bench-sync {path}: engine {rank} serves version {held} (probe sum {total}), "
                f"expected version {version} (probe sum {expected})"
            )
