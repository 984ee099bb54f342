"""The `tether serve` process: take the port first (a port in use fails before a model loads), load the
model into an engine, and run the HTTP app (`app.py`) under uvicorn on that socket until interrupted.
"""

from __future__ import annotations

import errno
import logging
import socket
from pathlib import Path
from typing import Any

import torch

from tether.engine.async_engine import AsyncEngine, AsyncEngineConfig
from tether.engine.config import EngineConfig
from tether.errors import ConfigError
from tether.models.config import RopeScaling
from tether.models.omp_pools import in_passing_thread
from tether.serving.app import create_app


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, taken before a model loads: a port in use then fails at once, and
    nothing can take it between the check and the server starting."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error}; expected a local address") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: not a listening port
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        reason = "the port is already in use" if error.errno == errno.EADDRINUSE else error.strerror
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}; pass another --port") from None
    return sock


def kv_tier_options(
    host_mib: int, disk_dir: Path | None, disk_mib: int, preemption_mode: str
) -> dict[str, Any]:
    """The engine options of `tether serve`'s KV tier flags, checked as the engine will check them (so
    a bad combination fails before a model loads)."""
    options: dict[str, Any] = {
        "kv_host_tier_mib": host_mib,
        "kv_disk_tier_dir": None if disk_dir is None else str(disk_dir),
        "kv_disk_tier_mib": disk_mib,
        "preemption_mode": preemption_mode,
    }
    flags = {
        "kv_host_tier_mib": "--kv-host-mib",
        "kv_disk_tier_dir": "--kv-disk-dir",
        "kv_disk_tier_mib": "--kv-disk-mib",
        "preemption_mode": "--preemption-mode",
    }
    try:
        EngineConfig(num_blocks=1, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1, **options)
    except ConfigError as error:
        message = str(error).removeprefix("engine: ")
        for field, flag in flags.items():
            message = message.replace(field, flag)
        raise ConfigError(message) from None
    return options


def serve(
    model: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    kv_cache_mib: int = 256,
    max_model_len: int | None = None,
    rope_scaling: RopeScaling | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    model_name: str | None = None,
    max_pending_requests: int = 1024,
    log_level: str = "info",
    listener: socket.socket | None = None,
    threads: int | None = None,
    **engine_options: Any,
) -> None:
    """Take host:port (unless given its `listener`, from `listen`), load `model` (a folder or a cached
    registered name) on `device` in `dtype` (with `rope_scaling` instead of its own, holding sequences of
    `max_model_len`: `LLMEngine.from_pretrained`), then serve it with uvicorn until interrupted. On the
    CPU it follows the free cores, unless given `threads`, which it then keeps (a benchmark against
    another server compares both at the same thread count)."""
    import uvicorn

    from tether.engine.llm_engine import LLMEngine
    from tether.models import configure_threads

    sock = listener or listen(host, port)
    with sock:
        if torch.device(device).type == "cpu":  # CPU threads matter only where the model computes on them
            if threads is None:
                configure_threads()
                engine_options.setdefault("adapt_threads", True)  # the server owns the process's threads
            else:
                torch.set_num_threads(threads)
        # Loaded in a passing thread: the engine computes in a thread of its own, whose OpenMP pool must
        # be the process's only one to keep its workers spinning between ops (`models.omp_pools`).
        engine, tokenizer = in_passing_thread(
            lambda: LLMEngine.from_pretrained(
                model,
                kv_cache_mib=kv_cache_mib,
                device=device,
                dtype=dtype,
                max_model_len=max_model_len,
                rope_scaling=rope_scaling,
                **engine_options,
            )
        )
        async_engine = AsyncEngine(engine, AsyncEngineConfig(max_pending_requests=max_pending_requests))
        app = create_app(async_engine, tokenizer, model_name or Path(model).name)
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=30)
        async_engine.start()
        try:
            _announcing_server(config).run(sockets=[sock])
        finally:
            async_engine.shutdown()


def _announcing_server(config: Any) -> Any:
    """uvicorn's server for `config`, saying where it listens once it does: uvicorn is silent about the
    sockets it is handed, and the model may have taken a while to load."""
    import uvicorn

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if sockets and not self.should_exit:
                host, port = sockets[0].getsockname()[:2]
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, port
                )

    return Announcing(config)
