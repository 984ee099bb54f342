"""Sessions keep a working directory across runs, release it on close, and expire when idle."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import tempfile
from pathlib import Path

import pytest

from tether.errors import TetherError
from tether.sandbox import PoolConfig, RunStatus, SandboxPool, SandboxSpec
from tether.sandbox.session import SessionClosed
from tether.tools import SandboxWorkspace


async def test_session_keeps_its_directory_across_runs(pool: SandboxPool) -> None:
    async with await pool.open_session() as session:
        first = await session.run("open('state.txt', 'w').write('42')")
        second = await session.run("cat state.txt", language="bash")
        assert first.status is RunStatus.OK and second.stdout == "42"
        assert first.qc == second.qc == "passed"


async def test_upload_and_download(pool: SandboxPool) -> None:
    async with await pool.open_session() as session:
        await session.upload({"data/in.txt": "hello", "raw.bin": b"\x00\x01"})
        result = await session.run("tr a-z A-Z < data/in.txt > out.txt; wc -c < raw.bin", language="bash")
        assert result.stdout.strip() == "2"
        assert await session.download(["out.txt"]) == {"out.txt": b"HELLO"}
        with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
            await session.download(["missing.txt"])


async def test_session_files_are_invisible_to_other_runs(pool: SandboxPool) -> None:
    async with await pool.open_session() as session:
        await session.upload({"secret.txt": "s3cr3t"})
        other = await pool.run("import os\nprint(sorted(os.listdir('.')), os.path.exists('secret.txt'))")
        assert other.stdout == "['main.py'] False\n"


async def test_closed_session_returns_its_worker(pool: SandboxPool) -> None:
    session = await pool.open_session()
    assert pool.busy_slots == 1
    await session.close()
    assert pool.busy_slots == 0
    assert session.closed
    with pytest.raises(SessionClosed):
        await session.run("print(1)")
    with pytest.raises(SessionClosed):
        pool.get_session(session.id)
    assert pool.workers_replaced == 0


async def test_idle_sessions_expire() -> None:
    config = PoolConfig(slots=1, session_idle_timeout_s=0.3)
    async with SandboxPool(SandboxSpec(timeout_s=5), config) as pool:
        session = await pool.open_session()
        await asyncio.sleep(1.2)
        assert session.closed
        assert (await pool.run("print('free')")).stdout == "free\n"


async def test_concurrent_calls_on_one_session_are_serialised(pool: SandboxPool) -> None:
    async with await pool.open_session() as session:
        writes = [session.run(f"echo {i} >> log.txt", language="bash") for i in range(6)]
        uploads = [session.upload({f"f{i}.txt": str(i)}) for i in range(3)]
        results = await asyncio.gather(*writes, *uploads)
        assert all(r is None or r.status is RunStatus.OK for r in results)
        log = (await session.download(["log.txt"]))["log.txt"].decode().split()
        assert sorted(log) == [str(i) for i in range(6)]
        assert session.runs == 6 and not session.closed


async def test_a_failed_upload_keeps_the_session_directory(pool: SandboxPool) -> None:
    async with await pool.open_session(SandboxSpec(disk_mib=1)) as session:
        await session.upload({"keep.txt": "kept"})
        with pytest.raises(TetherError, match="upload to session"):
            await session.upload({"big.bin": b"x" * (4 << 20)})
        assert await session.download(["keep.txt"]) == {"keep.txt": b"kept"}
        assert not session.closed


# ---- the tool programs live outside the working directory ------------------------------------------------

LIST_WORKDIR = "import os\nprint(sorted(os.listdir('.')))"


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", LIST_WORKDIR),
        ("bash", "ls -A"),
        ("c", '#include <stdio.h>\nint main(void) { puts("c ran"); return 0; }'),
    ],
    ids=["python", "bash", "c"],
)
async def test_an_agents_own_main_py_survives_a_tool_call(
    pool: SandboxPool, language: str, code: str
) -> None:
    own = {"main.py": "print('the agent wrote this')", "main.sh": "echo mine", "main.c": "/* mine */"}
    async with await pool.open_session() as session:
        await session.upload(own)
        called = await session.run(code, language=language)
        after = await session.run(LIST_WORKDIR)
        kept = await session.download(sorted(own))
    assert called.status is RunStatus.OK, called.error or called.stderr
    assert after.stdout == "['main.c', 'main.py', 'main.sh']\n"
    assert kept == {name: text.encode() for name, text in own.items()}


async def test_a_session_program_imports_and_includes_from_the_working_directory(pool: SandboxPool) -> None:
    async with await pool.open_session() as session:
        await session.upload({"helper.py": "ANSWER = 42", "answer.h": "#define ANSWER 42"})
        python = await session.run("import helper\nprint(helper.ANSWER)")
        c = await session.run(
            '#include <stdio.h>\n#include "answer.h"\nint main(void) { printf("%d\\n", ANSWER); }', "c"
        )
    assert python.stdout == "42\n", python.stderr
    assert c.stdout == "42\n", c.error or (c.compile.stderr if c.compile else c.stderr)


async def test_a_workdir_snapshot_holds_no_tool_program_files(pool: SandboxPool) -> None:
    async with await pool.open_session() as session:
        workspace = SandboxWorkspace(session)
        await workspace.write_file("notes.txt", "mine")
        for code, language in (("print(1)", "python"), ("echo 1 > out.txt", "bash")):
            assert (await session.run(code, language=language)).status is RunStatus.OK
        snapshot = await workspace.snapshot()
    with tarfile.open(fileobj=io.BytesIO(snapshot)) as archive:
        names = sorted(name.removeprefix("./") for name in archive.getnames() if name != ".")
    assert names == ["notes.txt", "out.txt"]


async def test_a_session_close_cancelled_mid_release_leaves_no_worker_behind() -> None:
    """A caller cancelled while its session is being released (an RL rollout stopped mid-batch) must
    not strand the worker: closing the pool still stops it and removes its root."""

    def skeletons() -> list[Path]:
        prefix = f"tether-root-{os.getpid()}-"
        return [p for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefix)]

    before = skeletons()
    pool = SandboxPool(SandboxSpec(timeout_s=5), PoolConfig(slots=1))
    await pool.start()
    session = await pool.open_session()
    await session.run("echo hi > a.txt", language="bash")
    worker = session._worker
    assert worker is not None and worker.process is not None
    closing = asyncio.create_task(session.close())
    await asyncio.sleep(0)  # the release request is on its way
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await pool.close()
    assert worker.process.returncode is not None  # the stranded worker was stopped
    assert skeletons() == before
