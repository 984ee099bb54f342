"""A generated repository task: its files, what is protected, the hidden tests and a reference solution.

Each task module (`ledger.py`, `textkit.py`) turns a seed into a `Repo`; `env.py` turns any `Repo`
into an episode. Hidden tests are trusted `test_*(m)` functions for the harness's `suite` mode, where
`m.<module>.<function>(...)` calls into the model's package in a child process.
"""

from __future__ import annotations

from dataclasses import dataclass

STUB = '"""{doc}"""\n\n\ndef {name}({args}):\n    raise NotImplementedError\n'
RAISES_VALUE_ERROR = (
    "def raises_value_error(call):\n"
    "    try:\n"
    "        call()\n"
    "    except Exception as error:\n"
    "        return str(error).startswith('ValueError')\n"
    "    return False\n"
)


@dataclass(frozen=True, slots=True)
class Repo:
    package: str  # the package the model implements
    files: dict[str, str]  # the repository as the model finds it
    protected: list[str]  # checksummed after every step
    hidden_tests: str  # trusted test code (suite mode)
    modules: dict[str, str]  # the reference implementation: path -> source

    @property
    def imports(self) -> str:
        """What the harness child runs to load the package's modules."""
        names = sorted(path.rsplit("/", 1)[1].removesuffix(".py") for path in self.modules)
        return f"from {self.package} import {', '.join(names)}\n"

    def prompt(self) -> str:
        return (
            f"The repository in your working directory holds a small Python package, `{self.package}`, "
            "whose functions are stubs. Implement it as README.md specifies, so that the tests pass (they "
            "will also be run against more cases than the visible ones). Files: "
            + ", ".join(sorted(self.files))
            + f". Protected (never modify): {', '.join(self.protected)}."
        )
