"""`tether up` with real processes: a detached cluster of 2 sandbox servers, an engine replica on a tiny
random model, the gateway and an agent worker comes up healthy and wired; a piece killed by pid is
restarted; `tether down` leaves no process behind. Also the foreground run (Ctrl-C is down), a piece
that cannot start, and an unreachable service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tether.local_cluster.state import start_ticks
from tether.local_cluster.supervisor import port_taken

Env = dict[str, str]


def tether(env: Env, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tether", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def free_ports(count: int) -> int:
    """The first of `count` consecutive free local ports."""
    for base in range(20000 + os.getpid() % 20000, 60000, 97):
        if not any(port_taken("127.0.0.1", base + i) for i in range(count)):
            return base
    raise AssertionError("no run of free ports")


def write_cluster(tmp_path: Path, body: str) -> tuple[Path, Env]:
    config = tmp_path / "cluster.toml"
    config.write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_") or k == "TETHER_NO_SERVICES"}
    return config, env | {"TETHER_HOME": str(tmp_path / "home")}


def descendants(pids: list[int]) -> set[int]:
    """`pids` and every process below them, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry.name))
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def status(env: Env) -> dict[str, Any]:
    shown = tether(env, "up", "status", "--json")
    payload: dict[str, Any] = json.loads(shown.stdout)
    return payload


def test_detached_cluster_is_healthy_wired_restarts_a_killed_piece_and_goes_down_clean(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    base = free_ports(6)
    model = tiny_model("qwen3")
    config, env = write_cluster(
        tmp_path,
        f"""
name = "t"
[sandbox]
instances = 2
slots = 1
base_port = {base}
[engine]
model = "{model}"
base_port = {base + 2}
kv_cache_mib = 8
max_num_seqs = 4
[gateway]
port = {base + 3}
[agents]
workers = 1
metrics_base_port = {base + 4}
[supervisor]
backoff_s = 0.2
""",
    )
    up = tether(env, "up", "--config", str(config), "--detach")
    assert up.returncode == 0, up.stderr
    for name in ("sandbox-0", "sandbox-1", "engine-0", "gateway", "worker-0"):
        assert name in up.stdout
    try:
        shown = status(env)
        assert shown["phase"] == "up" and shown["supervisor_pid"]
        pieces = {p["piece"]: p for p in shown["pieces"]}
        assert list(pieces) == ["sandbox-0", "sandbox-1", "engine-0", "gateway", "worker-0"]
        assert all(p["healthy"] and p["status"] == "running" and p["restarts"] == 0 for p in pieces.values())

        again = tether(env, "up", "--config", str(config), "--detach")
        assert again.returncode == 2 and "cluster 't' is already up" in again.stderr

        # the worker got the fleet; a run on one of the servers answers
        environ = Path(f"/proc/{pieces['worker-0']['pid']}/environ").read_bytes().split(b"\0")
        fleet = f'TETHER_SANDBOX__FLEET=["http://127.0.0.1:{base}", "http://127.0.0.1:{base + 1}"]'
        assert fleet.encode() in environ
        ran = httpx.post(f"{pieces['sandbox-1']['url']}/v1/run", json={"code": "print(6 * 7)"}, timeout=30)
        assert ran.status_code == 200 and ran.json()["stdout"] == "42\n", ran.text

        # a request through the gateway reaches the engine replica
        gateway_config = Path(shown["state_dir"]) / "gateway.json"
        created = tether(
            env,
            "gateway",
            "keys",
            "create",
            "--tenant",
            "t",
            "--gateway-config",
            str(gateway_config),
            "--json",
        )
        assert created.returncode == 0, created.stderr
        key = json.loads(created.stdout)["key"]

        def ask() -> httpx.Response:
            return httpx.post(
                f"{pieces['gateway']['url']}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                timeout=60,
            )

        answer = ask()
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text

        # a piece killed by pid is restarted, and counted
        everything = descendants([shown["supervisor_pid"], *(p["pid"] for p in pieces.values())])
        os.kill(pieces["gateway"]["pid"], signal.SIGKILL)

        def restarted() -> dict[str, Any] | None:
            gateway = {p["piece"]: p for p in status(env)["pieces"]}["gateway"]
            return gateway if gateway["restarts"] == 1 and gateway["healthy"] else None

        gateway = wait_for(restarted, 60, "the killed gateway was not restarted")
        assert gateway["pid"] != pieces["gateway"]["pid"]
        assert ask().status_code == 200
        everything |= descendants([gateway["pid"]])
    finally:
        down = tether(env, "down")
    assert down.returncode == 0 and "cluster 't' is down (5 pieces stopped)" in down.stderr, down.stderr
    wait_for(
        lambda: not [pid for pid in everything if start_ticks(pid) is not None], 10, "processes outlived down"
    )
    assert not (tmp_path / "home" / "clusters" / "t.json").exists()
    twice = tether(env, "down")
    assert twice.returncode != 0 and "nothing is up" in twice.stderr


def test_foreground_cluster_passes_the_settings_on_and_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    base = free_ports(1)
    config, env = write_cluster(
        tmp_path, f'name = "fg"\n[sandbox]\ninstances = 1\nslots = 1\nbase_port = {base}\n'
    )
    settings = tmp_path / "settings.toml"
    settings.write_text("[sandbox]\nsession_idle_timeout_s = 60\n")
    up = subprocess.Popen(
        [sys.executable, "-m", "tether", "--config", str(settings), "up", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        shown = wait_for(
            lambda: (
                up.poll() is None and tether(env, "up", "status", "--json").returncode == 0 and status(env)
            ),
            60,
            "not up",
        )
        (piece,) = shown["pieces"]
        assert shown["supervisor_pid"] == up.pid and piece["healthy"]
        # the pieces read the settings file `tether --config` gave
        environ = Path(f"/proc/{piece['pid']}/environ").read_bytes().split(b"\0")
        assert f"TETHER_CONFIG={settings}".encode() in environ
        everything = descendants([up.pid])
        up.send_signal(signal.SIGINT)
        _, stderr = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0 and "cluster 'fg' stopped" in stderr, stderr
    assert not [pid for pid in everything if start_ticks(pid) is not None]
    assert "nothing is up" in tether(env, "up", "status").stderr


def test_a_piece_that_cannot_start_fails_up_with_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    base = free_ports(2)
    spec = tmp_path / "spec.toml"
    spec.write_text("memory_mib = -1\n")
    config, env = write_cluster(
        tmp_path, f'name = "bad"\n[sandbox]\ninstances = 2\nbase_port = {base}\nspec = "{spec}"\n'
    )
    up = tether(env, "up", "--config", str(config), "--detach")
    assert up.returncode == 1
    assert "exited with status 2 before it was healthy; the end of" in up.stderr and "memory_mib" in up.stderr
    assert not (tmp_path / "home" / "clusters" / "bad.json").exists()
    assert not port_taken("127.0.0.1", base) and not port_taken("127.0.0.1", base + 1)


def test_an_unreachable_service_stops_up_before_anything_starts(tmp_path: Path) -> None:
    port = free_ports(1)
    config, env = write_cluster(
        tmp_path,
        f'[agents]\nmodel = "scripted:/nonexistent"\nbus = "redis://127.0.0.1:{port}/0"\n',
    )
    up = tether(env, "up", "--config", str(config))
    assert up.returncode == 2
    assert f"Redis at 127.0.0.1:{port} (agents.bus) is not reachable" in up.stderr
    assert not (tmp_path / "home" / "clusters").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["up"], "give the cluster file: tether up --config cluster.toml"),
        (["up", "--detach", "status"], "--config and --detach belong to `tether up`"),
        (["up", "status"], "nothing is up"),
    ],
)
def test_up_without_what_it_needs_says_so(tmp_path: Path, args: list[str], message: str) -> None:
    _, env = write_cluster(tmp_path, "")
    result = tether(env, *args)
    assert result.returncode == 2 and message in result.stderr.replace("\n", " "), result.stderr


def test_down_stops_the_pieces_of_a_supervisor_that_died(tmp_path: Path) -> None:
    from tether.local_cluster.state import ClusterState, PieceState, ProcessRef, write_state

    _, env = write_cluster(tmp_path, "")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_ticks = start_ticks(dead.pid)
    dead.wait()
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)
    ticks = start_ticks(orphan.pid)
    assert dead_ticks is not None and ticks is not None
    piece = PieceState(
        name="sandbox-0",
        kind="sandbox",
        url="http://127.0.0.1:1",
        port=1,
        health_url="http://127.0.0.1:1/healthz",
        process=ProcessRef(pid=orphan.pid, start_ticks=ticks),
    )
    supervisor = ProcessRef(pid=dead.pid, start_ticks=dead_ticks)
    home = Path(env["TETHER_HOME"])
    write_state(
        home,
        ClusterState(
            name="o", supervisor=supervisor, config="c", state_dir="d", started_at=0, pieces=[piece]
        ),
    )
    shown = tether(env, "up", "status")
    assert shown.returncode == 1 and "is not running: nothing restarts the pieces" in shown.stderr
    down = tether(env, "down", "--name", "o")
    assert down.returncode == 0, down.stderr
    assert orphan.wait(timeout=10) == -signal.SIGTERM
    assert not (home / "clusters" / "o.json").exists()
