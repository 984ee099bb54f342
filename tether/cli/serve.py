"""`tether serve`: pull a model (or export a trained run's checkpoint) if needed and serve it over an
OpenAI-compatible HTTP API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tether.cli.common import (
    CacheDirOption,
    DeviceOption,
    DTypeOption,
    KvCacheMibOption,
    MaxModelLenOption,
    RopeScalingOption,
    cache_root,
    err_console,
    user_errors,
)
from tether.models.registry import KNOWN_MODELS


def serve_command(
    ctx: typer.Context,
    model: Annotated[
        str,
        typer.Option(
            help=f"A registered model ({', '.join(sorted(KNOWN_MODELS))}), a model folder, or a trained "
            "run: runs/NAME, runs/NAME/checkpoints/latest or runs/NAME/checkpoints/step-NNNNNN."
        ),
    ] = "smollm2-135m-instruct",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port to listen on.", min=1, max=65535)] = 8000,
    kv_cache_mib: KvCacheMibOption = 256,
    max_model_len: MaxModelLenOption = None,
    rope_scaling: RopeScalingOption = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences decoding at once.", min=1)] = 64,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Token budget of one engine step (prefill chunk size).", min=1)
    ] = 512,
    attention_block_tokens: Annotated[
        int,
        typer.Option(
            help="Tokens per tile of the block-wise attention of prompt chunks whose context reaches "
            "--blockwise-min-context (a multiple of the 16-token KV block); 0: their full score matrix.",
            min=0,
        ),
    ] = 512,
    blockwise_min_context: Annotated[
        int,
        typer.Option(
            help="Context (tokens) from which prompt chunks attend block-wise; shorter ones keep the exact "
            "per-row kernel.",
            min=1,
        ),
    ] = 4096,
    max_pending_requests: Annotated[
        int, typer.Option(help="Unfinished requests accepted before new ones get HTTP 503.", min=1)
    ] = 1024,
    kv_host_mib: Annotated[
        int,
        typer.Option(
            help="Host memory (MiB) for KV blocks evicted from the device's prefix cache and for swapped-out "
            "sequences; 0: none.",
            min=0,
        ),
    ] = 0,
    kv_disk_dir: Annotated[
        Path | None,
        typer.Option(
            help="Folder of the disk KV tier: evicted prefix blocks, kept across restarts (per model).",
            file_okay=False,
        ),
    ] = None,
    kv_disk_mib: Annotated[
        int, typer.Option(help="Most disk space of the disk KV tier, in MiB.", min=1)
    ] = 4096,
    preemption_mode: Annotated[
        str,
        typer.Option(
            help="What a preempted sequence's KV becomes: recompute (dropped), swap (to the host tier) or "
            "auto (whichever the measured cost model says is cheaper); swap and auto need --kv-host-mib."
        ),
    ] = "recompute",
    device: DeviceOption = "auto",
    dtype: DTypeOption = "float32",
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(
            help="The KV cache's type when it differs from --dtype: float32, bfloat16 or float16 (float16 "
            "beside float32 weights halves what decode attention reads, as llama.cpp's default cache)."
        ),
    ] = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Serve a model: POST /v1/chat/completions and /v1/completions, GET /v1/models, /healthz, /metrics."""
    from tether.models.config import RopeScaling
    from tether.models.loader import resolve
    from tether.models.precision import DType, resolve_device
    from tether.serving.launcher import kv_tier_options, listen, serve

    with user_errors():
        where, kind = resolve_device(device, "--device"), DType.parse(dtype, "--dtype")
        kv_kind = kind if kv_cache_dtype is None else DType.parse(kv_cache_dtype, "--kv-cache-dtype")
        rope = None if rope_scaling is None else RopeScaling.parse(rope_scaling)
        tiers = kv_tier_options(kv_host_mib, kv_disk_dir, kv_disk_mib, preemption_mode)
        listener = listen(host, port)  # before pulling or loading anything: a taken port fails at once
        with err_console.status(f"loading {model}") as status:
            folder = resolve(
                model,
                cache_root(ctx, cache_dir),
                progress=lambda message: status.update(f"{model}: {message}"),
            )
        # A plain model folder serves under its folder name; a run's checkpoint or a registered model
        # under the --model value, which is what the client that started the server knows.
        name = folder.name if folder == Path(model) else model
        cache = "" if kv_kind is kind else f", KV cache {kv_kind}"
        err_console.print(
            f"serving {name} on http://{host}:{port}/v1 ({where}, {kind}{cache})", highlight=False
        )
        serve(
            folder,
            host=host,
            port=port,
            kv_cache_mib=kv_cache_mib,
            max_model_len=max_model_len,
            rope_scaling=rope,
            device=where,
            dtype=kind.torch,
            kv_cache_dtype=kv_kind.torch,
            model_name=name,
            max_pending_requests=max_pending_requests,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            attention_block_tokens=attention_block_tokens,
            blockwise_min_context=blockwise_min_context,
            listener=listener,
            **tiers,
        )
