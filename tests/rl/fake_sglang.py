"""A fake SGLang server for the remote rollout source: SGLang's native `/generate` (token ids in, output ids
with `[logprob, token_id, text]` entries and the served `weight_version` out) and
`/update_weights_from_disk`, which reads the safetensors folder it is given and records the version, and
the distributed pair: `/init_weights_update_group` joins the trainer's group as SGLang does (its
`init_custom_process_group`: a tcp:// rendezvous and torch's `_new_process_group_helper`) and
`/update_weights_from_distributed` receives the named tensors by broadcasts from rank 0, blocking in the
collective while the request is open, as the real server does.

Its "model" is the fake vLLM's arithmetic (`fake_vllm.token_of`, seeded by `sampling_seed`), and every
logprob encodes the number of weight loads so far (`fake_vllm.logprob_of`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from safetensors import safe_open

# torch.distributed.TCPStore, documented there; typed stubs export it from here only.
from torch._C._distributed_c10d import TCPStore

from tether.engine.weight_sync import SyncBackend

from .fake_vllm import logprob_of, token_of


@dataclass(slots=True)
class FakeSGLangState:
    weight_version: str = "default"  # SGLang's own name for the weights it started with
    loads: int = 0
    refuse: bool = False
    healthy: bool = True
    """Whether `/health` answers 200 (else 503, as SGLang does while its scheduler is stuck)."""
    fail_seed: int | None = None
    """A `sampling_seed` whose `/generate` answers 500 at once; the others wait `delay_s` first."""
    delay_s: float = 0.0
    """Answer the next update `success: false`, as SGLang does when the weights do not fit the model."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    groups: dict[str, Any] = field(default_factory=dict)
    """Weight-update groups joined, by name."""
    received: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """The tensors each distributed update brought, by weight version."""
    torch_helper: bool = True
    """Join as SGLang does, on torch's helper. It registers the group's name process-wide, so of several
    fakes in one test process only one can; the others build the same group from public types."""


def join_from_public_types(body: dict[str, Any]) -> Any:
    """The same group (same store keys) as `join_like_sglang`, registered nowhere: tether's own builder."""
    from tether.rl.server_weights import WeightsGroup, form_group

    timeout = timedelta(seconds=30)
    store = TCPStore(body["master_address"], body["master_port"], body["world_size"], False, timeout=timeout)
    group = WeightsGroup(
        body["master_address"],
        body["master_port"],
        body["world_size"],
        body["group_name"],
        SyncBackend(body["backend"]),
    )
    return form_group(store, body["rank_offset"], group, timeout)


def receive_broadcast(group: Any, tensor: torch.Tensor) -> None:
    if isinstance(group, dist.ProcessGroup):  # as SGLang receives
        dist.broadcast(tensor, src=0, group=group)
        return
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def join_like_sglang(body: dict[str, Any]) -> Any:
    """SGLang's `init_custom_process_group` for its weight-update group, on torch's own helper."""
    # The private helpers SGLang itself uses.
    from torch.distributed import rendezvous  # type: ignore[attr-defined]
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=30)
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world_size = next(rendezvous(url, body["rank_offset"], body["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    name = body["group_name"]
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(body["backend"]),
        PrefixStore(name, store),
        group_name=name,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def create_fake_sglang(state: FakeSGLangState) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Any:
        return Response(status_code=200 if state.healthy else 503)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        state.requests.append(body)
        sampling = body["sampling_params"]
        if sampling.get("sampling_seed") == state.fail_seed:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        await asyncio.sleep(state.delay_s)
        count = int(sampling["max_new_tokens"])
        ids = [
            token_of(body["input_ids"], i, int(sampling.get("sampling_seed", 0)) % 7) for i in range(count)
        ]
        meta = {
            "finish_reason": {"type": "length", "length": count},
            "output_token_logprobs": [[logprob_of(state.loads), t, None] for t in ids],
            "weight_version": state.weight_version,
        }
        return {"text": "".join(chr(96 + t % 26) for t in ids), "output_ids": ids, "meta_info": meta}

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> Any:
        body = await request.json()
        if state.refuse:
            state.refuse = False
            return {"success": False, "message": "shape mismatch"}
        with safe_open(str(Path(body["model_path"]) / "model.safetensors"), "pt") as stored:
            names = list(stored.keys())
        state.updates.append({**body, "names": names})
        state.weight_version = body["weight_version"]
        state.loads += 1
        return {"success": True, "message": "Succeeded to update model weights."}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> Any:
        body = await request.json()
        join = join_like_sglang if state.torch_helper else join_from_public_types
        state.groups[body["group_name"]] = await asyncio.to_thread(join, body)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_distributed(request: Request) -> Any:
        body = await request.json()
        if state.refuse:  # before joining the broadcast, as SGLang's checks of names and dtypes are
            state.refuse = False
            return {"success": False, "message": "shape mismatch"}
        group = state.groups[body["group_name"]]

        def receive() -> dict[str, torch.Tensor]:
            tensors = {}
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                receive_broadcast(group, tensors[name])
            return tensors

        state.received[body["weight_version"]] = await asyncio.to_thread(receive)
        state.updates.append(body)
        state.weight_version = body["weight_version"]
        state.loads += 1
        return {"success": True, "message": "Succeeded to update parameter online."}

    return app
