"""The state file names processes by pid and start time, so a reused pid is never taken for a piece."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tether.errors import ConfigError
from tether.local_cluster.state import (
    ClusterState,
    ProcessRef,
    pick_cluster,
    read_state,
    start_ticks,
    this_process,
    write_state,
)


def test_a_process_is_alive_only_with_its_own_start_time() -> None:
    me = this_process()
    assert me.alive()
    assert not ProcessRef(pid=me.pid, start_ticks=me.start_ticks + 1).alive()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert start_ticks(child.pid) is None


def test_an_exited_but_unreaped_child_counts_as_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = start_ticks(child.pid)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited; still a zombie until reaped
    assert ticks is not None and not ProcessRef(pid=child.pid, start_ticks=ticks).alive()
    child.wait()


def test_state_round_trips_and_the_cluster_is_found_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nothing is up"):
        pick_cluster(tmp_path, None)
    for name in ("a", "b"):
        write_state(
            tmp_path,
            ClusterState(name=name, supervisor=this_process(), config="c", state_dir="d", started_at=1.0),
        )
    assert read_state(tmp_path, "a") == ClusterState(
        name="a", supervisor=this_process(), config="c", state_dir="d", started_at=1.0
    )
    assert pick_cluster(tmp_path, "b") == "b"
    with pytest.raises(ConfigError, match=r"several clusters are up \(a, b\): choose one with --name"):
        pick_cluster(tmp_path, None)
    with pytest.raises(ConfigError, match=r"no cluster named 'c' is up .*; up: a, b"):
        pick_cluster(tmp_path, "c")
    (tmp_path / "clusters" / "a.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a cluster state file"):
        read_state(tmp_path, "a")
