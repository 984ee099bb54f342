"""How each supported language is written to disk, compiled and run inside the sandbox.

A registry of plain data: adding a language is adding an entry, never a branch in the pool.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, replace

from tether.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Language:
    name: str
    source_file: str  # where the program is written, relative to the working directory
    run_argv: tuple[str, ...]
    compile_argv: tuple[str, ...] | None = None
    warm_python: bool = False  # run in a forked, preloaded interpreter instead of exec'ing one
    binary: str | None = None  # what the compile step writes beside the source

    def placed_in(self, directory: str) -> Language:
        """This language with the program's own files (source, binary) in `directory`, an absolute path.

        Every argument naming one of them is rewritten; the working directory stays the current one.
        """
        names = {self.source_file: self.source_file}
        if self.binary is not None:
            names |= {self.binary: self.binary, f"./{self.binary}": self.binary}

        def moved(argv: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(f"{directory}/{names[item]}" if item in names else item for item in argv)

        return replace(
            self,
            source_file=f"{directory}/{self.source_file}",
            run_argv=moved(self.run_argv),
            compile_argv=None if self.compile_argv is None else moved(self.compile_argv),
            binary=None if self.binary is None else f"{directory}/{self.binary}",
        )


def _resolve(program: str) -> str:
    return shutil.which(program) or program


def default_languages(python_executable: str | None = None) -> dict[str, Language]:
    python = python_executable or sys.executable
    languages = [
        Language("python", "main.py", (python, "main.py"), warm_python=True),
        Language("bash", "main.sh", (_resolve("bash"), "main.sh")),
        # `-iquote .`: headers in the working directory stay includable when the source is elsewhere.
        Language(
            "c",
            "main.c",
            ("./main",),
            (_resolve("gcc"), "-O2", "-std=gnu17", "-pipe", "-iquote", ".", "main.c", "-o", "main", "-lm"),
            binary="main",
        ),
        Language(
            "cpp",
            "main.cpp",
            ("./main",),
            (_resolve("g++"), "-O2", "-std=gnu++17", "-pipe", "-iquote", ".", "main.cpp", "-o", "main"),
            binary="main",
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
