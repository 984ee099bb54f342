"""How each supported language is written to disk, compiled and run inside the sandbox.

A registry of plain data: adding a language is adding an entry, never a branch in the pool.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass

from tether.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Language:
    name: str
    source_file: str
    run_argv: tuple[str, ...]
    compile_argv: tuple[str, ...] | None = None
    warm_python: bool = False  # run in a forked, preloaded interpreter instead of exec'ing one


def _resolve(program: str) -> str:
    return shutil.which(program) or program


def default_languages(python_executable: str | None = None) -> dict[str, Language]:
    python = python_executable or sys.executable
    languages = [
        Language("python", "main.py", (python, "main.py"), warm_python=True),
        Language("bash", "main.sh", (_resolve("bash"), "main.sh")),
        Language(
            "c",
            "main.c",
            ("./main",),
            (_resolve("gcc"), "-O2", "-std=gnu17", "-pipe", "main.c", "-o", "main", "-lm"),
        ),
        Language(
            "cpp",
            "main.cpp",
            ("./main",),
            (_resolve("g++"), "-O2", "-std=gnu++17", "-pipe", "main.cpp", "-o", "main"),
        ),
        Language("javascript", "main.js", (_resolve("node"), "main.js")),
    ]
    return {language.name: language for language in languages}


ALIASES = {
    "python3": "python",
    "py": "python",
    "sh": "bash",
    "c++": "cpp",
    "js": "javascript",
    "node": "javascript",
    "nodejs": "javascript",
}


def lookup(languages: dict[str, Language], name: str) -> Language:
    canonical = ALIASES.get(name.lower(), name.lower())
    if canonical not in languages:
        accepted = ", ".join(sorted(languages))
        raise ConfigError(f"language {name!r} is not supported; accepted: {accepted}")
    return languages[canonical]
