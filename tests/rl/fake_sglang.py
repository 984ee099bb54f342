"""A fake SGLang server for the remote rollout source: SGLang's native `/generate` (token ids in, output ids
with `[logprob, token_id, text]` entries and the served `weight_version` out) and
`/update_weights_from_disk`, which reads the safetensors folder it is given and records the version.

Its "model" is the fake vLLM's arithmetic (`fake_vllm.token_of`, seeded by `sampling_seed`), and every
logprob encodes the number of weight loads so far (`fake_vllm.logprob_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from safetensors import safe_open

from .fake_vllm import logprob_of, token_of


@dataclass(slots=True)
class FakeSGLangState:
    weight_version: str = "default"  # SGLang's own name for the weights it started with
    loads: int = 0
    refuse: bool = False
    """Answer the next update `success: false`, as SGLang does when the weights do not fit the model."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)


def create_fake_sglang(state: FakeSGLangState) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        state.requests.append(body)
        sampling = body["sampling_params"]
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

    return app
