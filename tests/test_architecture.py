"""docs/ARCHITECTURE.md states which folder of `tether/` may import which; this holds the code to it.

Every import counts, at module level, inside functions (lazy imports) and under TYPE_CHECKING alike: an
arrow that only a type checker follows is still an arrow a reader has to follow.
"""

from __future__ import annotations

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tether"


def allowed_imports() -> dict[str, set[str]]:
    """The ```layers block of ARCHITECTURE.md: `folder: what it may import`, one line each."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    match = re.search(r"```layers\n(.*?)```", text, re.DOTALL)
    assert match, "docs/ARCHITECTURE.md has no ```layers block"
    table: dict[str, set[str]] = {}
    for line in match.group(1).strip().splitlines():
        name, _, targets = line.partition(":")
        table[name.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    return table


def unit_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found |= {name.split(".")[1] for name in names if name.startswith("tether.")}
    return found


def test_every_import_follows_the_layers_of_architecture_md() -> None:
    table = allowed_imports()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(path)
        if unit in ("__init__", "__main__"):
            continue
        assert unit in table, f"{unit} (from {path.relative_to(ROOT)}) is not in ARCHITECTURE.md's layers"
        for target in imports_of(path) - table[unit] - {unit}:
            wrong.append(f"{path.relative_to(ROOT)} imports tether.{target}")
    assert not wrong, "imports the layers do not allow:\n" + "\n".join(wrong)


def test_the_layers_have_no_cycle_and_name_only_real_folders() -> None:
    table = allowed_imports()
    units = {unit_of(path) for path in PACKAGE.rglob("*.py")} - {"__init__", "__main__"}
    assert set(table) == units, (
        f"layers name {sorted(set(table) - units)}; missing {sorted(units - set(table))}"
    )
    for unit, targets in table.items():
        assert targets <= units, f"{unit} may import unknown {sorted(targets - units)}"
    try:
        TopologicalSorter(table).prepare()
    except CycleError as error:
        raise AssertionError(f"the layers have a cycle: {error.args[1]}") from None
