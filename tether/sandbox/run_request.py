"""The worker request of one run, from the caller's program, files and limits (pure: no I/O).

A one-shot run's program is written into its working directory, where SandboxFusion puts it too (so
relative imports, includes and `__file__` behave as there); a kept directory (a session's) belongs to
its user, so the program goes to PROGRAM_DIR instead and never overwrites their files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tether.sandbox import protocol
from tether.sandbox.languages import Language
from tether.sandbox.paths import PROGRAM_DIR
from tether.sandbox.protocol import RunRequest, StepRequest
from tether.sandbox.spec import SandboxSpec, checked_text, sandbox_path


def _encode(data: str | bytes, field: str) -> str:
    return protocol.b64encode(checked_text(data, field).encode() if isinstance(data, str) else data)


def build_run_request(
    lang: Language,
    workdir: str,
    dir_id: str,
    code: str | bytes,
    stdin: str | bytes,
    files: Mapping[str, str | bytes],
    spec: SandboxSpec,
    warm: bool = True,
    keep_dir: bool = False,
) -> RunRequest:
    """Source file, compile step if the language has one, run step (warm Python inline when `warm`)."""
    program = {lang.source_file: _encode(code, "code")}
    if keep_dir:
        lang = lang.placed_in(PROGRAM_DIR)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "PYTHONDONTWRITEBYTECODE": "1",
        **spec.env,
    }
    all_files = {
        sandbox_path(name, "files", workdir): _encode(content, f"files[{name!r}]")
        for name, content in files.items()
    }

    def step(
        argv: Sequence[str], timeout_s: float, inline: str | None = None, stdin_data: str | bytes = ""
    ) -> StepRequest:
        return StepRequest(
            argv=list(argv),
            inline_python=inline,
            stdin_b64=_encode(stdin_data, "stdin"),
            env=env,
            timeout_s=timeout_s,
            output_limit_bytes=spec.output_limit_bytes,
            cpu_time_limit_s=spec.cpu_time_limit_s(timeout_s),
            open_files_max=spec.open_files_max,
            file_size_max_bytes=spec.disk_mib * 1024 * 1024,
        )

    steps = []
    if lang.compile_argv is not None:
        steps.append(step(lang.compile_argv, spec.compile_timeout_s))
    inline = os.path.join(workdir, lang.source_file) if lang.warm_python and warm else None
    steps.append(step(lang.run_argv, spec.timeout_s, inline, stdin))
    return RunRequest(
        dir_id=dir_id,
        disk_mib=spec.disk_mib,
        files=all_files if keep_dir else {**all_files, **program},
        steps=steps,
        program=program if keep_dir else {},
        keep_dir=keep_dir,
    )
