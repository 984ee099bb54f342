"""Terminal tasks (`shell/<task>`): work on a seeded file tree in a sandbox session with `shell`, `python`
and `submit`, scored by checking the final filesystem state.

Each task writes its fixtures in the setup hook (after proving the session starts empty), protects its
task statement (and, for `fixscript`, its example test) by checksum after every step, and is graded by
a trusted program in the session that compares files with the expected state. `fixscript` also runs the
repaired script on inputs the model never saw and compares its output here. Expected states live in the
task's data, which the model does not see.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tether.chat import Message, Messages
from tether.envs import qc
from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry
from tether.envs.sandboxed import new_nonce, run_trusted
from tether.envs.scoring import EpisodeState, Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Problem, Task, draw_unsolved
from tether.sandbox.result import RunStatus
from tether.tools import PYTHON, SHELL, SUBMIT

SYSTEM = (
    "You operate a Linux terminal through tools. Use `shell` to run bash commands and `python` to run "
    "Python programs; both work in the same directory, which persists between calls. Do not modify the "
    "files the task marks as protected. When the task is done, call `submit` with a one-line summary."
)
TASK_FILE = "TASK.md"
WORDS = ["alpha", "bravo", "delta", "echo", "gamma", "kilo", "lima", "oscar", "sierra", "tango", "zulu"]
_RESULTS = "shell.checks"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ShellTask:
    """One seeded terminal task: fixtures, the expected final state, and a reference solution."""

    instructions: str
    files: dict[str, str]
    expected_files: dict[str, str]  # path -> content after a correct solution
    reference: list[str]  # bash commands, one tool call each
    absent: list[str] = field(default_factory=list)  # paths that must no longer exist
    protected: list[str] = field(default_factory=lambda: [TASK_FILE])
    # fixscript: run `bash <script> <input>` on hidden inputs and compare stdout
    script: str = ""
    hidden_runs: list[tuple[str, str]] = field(default_factory=list)  # (input text, expected stdout)
    empty_dirs: list[str] = field(default_factory=list)  # directories that must end empty

    def solved_untouched(self) -> bool:
        """Whether the fixtures as written already pass the grader's file checks, so that doing nothing
        would score (`replace` once drew no `.txt` file under `docs/`). A task with hidden runs is never
        solved untouched here: its fixtures hold a broken script (`fix_script` puts two of its three
        bugs in, and the hidden inputs expose them), whose runs only the sandbox can judge."""
        if self.hidden_runs:
            return False
        present = all(self.files.get(path) == content for path, content in self.expected_files.items())
        gone = not any(path in self.files for path in self.absent)
        emptied = not any(path.startswith(f"{folder}/") for folder in self.empty_dirs for path in self.files)
        return present and gone and emptied


def _lines(rng: random.Random, count: int) -> str:
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) + "\n" for _ in range(count))


def organize(rng: random.Random) -> ShellTask:
    extensions = rng.sample(["txt", "csv", "log", "md", "json", "cfg"], 4)
    files: dict[str, str] = {}
    for _ in range(rng.randint(8, 14)):
        name = f"{rng.choice(WORDS)}-{rng.randint(1, 999)}"
        ext = rng.choice([*extensions, ""])
        files[f"inbox/{name}.{ext}" if ext else f"inbox/{name}"] = _lines(rng, rng.randint(1, 3))
    expected = {}
    for path, content in files.items():
        name = path.split("/", 1)[1]
        ext = name.rsplit(".", 1)[1] if "." in name else "none"
        expected[f"sorted/{ext}/{name}"] = content
    instructions = (
        "Move every file in `inbox/` into `sorted/<extension>/` (for example `inbox/a-1.txt` goes to "
        "`sorted/txt/a-1.txt`); files without an extension go to `sorted/none/`. Keep names and contents, "
        "and leave `inbox/` as an empty directory."
    )
    command = (
        'cd inbox && for f in *; do case "$f" in *.*) e="${f##*.}";; *) e=none;; esac; '
        'mkdir -p "../sorted/$e" && mv -- "$f" "../sorted/$e/"; done'
    )
    return ShellTask(instructions, files, expected, [command], absent=list(files), empty_dirs=["inbox"])


def replace(rng: random.Random) -> ShellTask:
    old, new = rng.sample(WORDS, 2)
    files = {}
    for index in range(rng.randint(5, 9)):
        folder = rng.choice(["docs", "docs/guide", "docs/api", "notes"])
        ext = rng.choice(["txt", "txt", "md"])
        files[f"{folder}/page{index}.{ext}"] = _lines(rng, rng.randint(2, 6)) + f"{old} {old}\n"
    expected = {
        path: content.replace(old, new) if path.startswith("docs/") and path.endswith(".txt") else content
        for path, content in files.items()
    }
    instructions = (
        f"In every `.txt` file anywhere under `docs/`, replace each occurrence of `{old}` with `{new}`. "
        "Leave every other file (other extensions, files outside `docs/`) exactly as it is."
    )
    command = f"find docs -type f -name '*.txt' -exec sed -i 's/{old}/{new}/g' {{}} +"
    return ShellTask(instructions, files, expected, [command])


def report(rng: random.Random) -> ShellTask:
    regions = rng.sample(["north", "south", "east", "west", "central", "coast", "hills"], rng.randint(3, 5))
    rows = [(rng.choice(regions), rng.randint(1, 500)) for _ in range(rng.randint(12, 30))]
    totals = Counter[str]()
    for region, amount in rows:
        totals[region] += amount
    ranked = sorted(totals.items(), key=lambda item: (-item[1], item[0]))
    files = {"data/sales.csv": "region,amount\n" + "".join(f"{r},{a}\n" for r, a in rows)}
    expected = {**files, "report.txt": "".join(f"{region} {total}\n" for region, total in ranked)}
    instructions = (
        "`data/sales.csv` has a header line and then `region,amount` rows. Write `report.txt` with one "
        "line per region, `<region> <total amount>`, ordered by total (largest first) and then by region "
        "name (alphabetically) for equal totals."
    )
    command = (
        "tail -n +2 data/sales.csv | awk -F, '{t[$1] += $2} END {for (r in t) print r, t[r]}' "
        "| sort -k2,2nr -k1,1 > report.txt"
    )
    return ShellTask(instructions, files, expected, [command])


def large_files(rng: random.Random) -> ShellTask:
    limit = rng.choice([100, 200, 300])
    files = {}
    for index in range(rng.randint(8, 14)):
        folder = rng.choice(["tree", "tree/a", "tree/b", "tree/a/deep"])
        files[f"{folder}/f{index}.dat"] = "x" * rng.randint(limit - 60, limit + 60)
    chosen = sorted(path for path, content in files.items() if len(content) > limit)
    expected = {**files, "large.txt": "".join(f"{path}\n" for path in chosen)}
    instructions = (
        f"Write `large.txt` listing the paths (like `tree/a/f3.dat`) of the files under `tree/` that are "
        f"larger than {limit} bytes, one per line, sorted in byte order (as `LC_ALL=C sort` does)."
    )
    command = f"find tree -type f -size +{limit}c | LC_ALL=C sort > large.txt"
    return ShellTask(instructions, files, expected, [command])


def _top_words(text: str, k: int) -> str:
    counts = Counter(re.findall("[a-z]+", text.lower()))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:k]
    return "".join(f"{n} {w}\n" for w, n in ranked)


def fix_script(rng: random.Random) -> ShellTask:
    k = rng.randint(2, 4)
    good = (
        "#!/bin/bash\n"
        "# Prints the K most frequent words of file $1: 'count word' lines.\n"
        "tr -cs 'A-Za-z' '\\n' < \"$1\" | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c \\\n"
        f"    | sort -k1,1nr -k2,2 | head -n {k} | awk '{{print $1, $2}}'\n"
    )
    bugs = [
        ("tr 'A-Z' 'a-z' | ", ""),  # no lowercasing
        ("sort -k1,1nr -k2,2", "sort -nr"),  # ties in the wrong order
        (f"head -n {k}", f"head -n {k + 1}"),  # one line too many
    ]
    broken = good
    for old, new in rng.sample(bugs, 2):
        broken = broken.replace(old, new)

    def sample() -> str:
        return " ".join(
            rng.choice(WORDS + [w.upper() for w in WORDS[:3]]) for _ in range(rng.randint(15, 40))
        )

    example = sample() + "\n"
    files = {
        "scripts/topwords.sh": broken,
        "tests/example.txt": example,
        "tests/expected.txt": _top_words(example, k),
        "tests/check.sh": "#!/bin/bash\nbash scripts/topwords.sh tests/example.txt > /tmp/got.txt\n"
        "diff /tmp/got.txt tests/expected.txt && echo PASS\n",
    }
    hidden = [(text, _top_words(text, k)) for text in (sample() + "\n", sample() + " " + sample() + "\n")]
    instructions = (
        f"`scripts/topwords.sh FILE` should print the {k} most frequent words of FILE (a word is a run of "
        "letters, compared case-insensitively and printed in lowercase) as `count word` lines, most "
        "frequent first, ties in alphabetical order. It is buggy: fix it. `bash tests/check.sh` runs it on "
        "an example; it will also be run on other inputs. The files under `tests/` are protected."
    )
    command = f"cat > scripts/topwords.sh <<'EOF'\n{good}EOF"
    return ShellTask(
        instructions,
        files,
        {path: files[path] for path in ("tests/example.txt", "tests/expected.txt")},
        [command, "bash tests/check.sh"],
        protected=[TASK_FILE, "tests/example.txt", "tests/expected.txt", "tests/check.sh"],
        script="scripts/topwords.sh",
        hidden_runs=hidden,
    )


def dedupe(rng: random.Random) -> ShellTask:
    contents = [_lines(rng, rng.randint(1, 3)) for _ in range(rng.randint(3, 6))]
    files: dict[str, str] = {}
    count = len(contents) + rng.randint(3, 6)  # more files than contents: some content repeats
    while len(files) < count:
        folder = rng.choice(["photos", "photos/2023", "photos/old"])
        files[f"{folder}/img{rng.randint(10, 99)}.jpg"] = rng.choice(contents)
    keep: dict[str, str] = {}
    for path in sorted(files):  # byte order, as LC_ALL=C sorts
        keep.setdefault(files[path], path)
    expected = {path: content for content, path in keep.items()}
    instructions = (
        "Some files under `photos/` have identical contents. Delete duplicates so that each distinct "
        "content is kept exactly once, in the file whose path comes first in byte order (as "
        "`LC_ALL=C sort` orders paths). Do not change the files you keep."
    )
    command = (
        "declare -A seen; find photos -type f | LC_ALL=C sort | while read -r f; do "
        'h=$(sha256sum < "$f" | cut -d" " -f1); if [ -n "${seen[$h]}" ]; then rm -- "$f"; '
        "else seen[$h]=1; fi; done"
    )
    return ShellTask(instructions, files, expected, [command], absent=sorted(set(files) - set(expected)))


def rename(rng: random.Random) -> ShellTask:
    files: dict[str, str] = {}
    count = rng.randint(5, 9)
    while len(files) < count:
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
        name = " ".join(w.capitalize() if rng.random() < 0.5 else w for w in words)
        name += f" {rng.randint(1, 99)}." + rng.choice(["TXT", "txt", "Md", "csv"])
        if name.lower().replace(" ", "_") not in {n.lower().replace(" ", "_") for n in files}:
            files[name] = _lines(rng, 1)
    expected = {f"files/{name.lower().replace(' ', '_')}": content for name, content in files.items()}
    instructions = (
        "Rename every file in `files/` to its name in lowercase with each space replaced by an "
        "underscore (`My Notes 3.TXT` becomes `my_notes_3.txt`). Keep the contents."
    )
    command = (
        "cd files && for f in *; do n=$(printf '%s' \"$f\" | tr 'A-Z ' 'a-z_'); "
        '[ "$f" = "$n" ] || mv -- "$f" "$n"; done'
    )
    return ShellTask(
        instructions,
        {f"files/{name}": content for name, content in files.items()},
        expected,
        [command],
        absent=[f"files/{name}" for name in files if name != name.lower().replace(" ", "_")],
    )


TASKS: dict[str, tuple[Callable[[random.Random], ShellTask], str]] = {
    "organize": (organize, "sort files into folders by extension"),
    "replace": (replace, "replace a word in some files of a tree"),
    "report": (report, "aggregate a CSV into a sorted report"),
    "largefiles": (large_files, "list files above a size"),
    "fixscript": (fix_script, "repair a buggy pipeline; run on hidden inputs"),
    "dedupe": (dedupe, "delete duplicate files, keeping the first path"),
    "rename": (rename, "normalise file names"),
}

GRADER_BODY = """
import hashlib, stat, sys
spec = _json.loads(sys.stdin.read())
results = {}
for path, digest in spec['files'].items():
    try:
        info = _os.lstat(path)
        with open(path, 'rb') as handle:
            same = stat.S_ISREG(info.st_mode) and hashlib.sha256(handle.read()).hexdigest() == digest
    except OSError:
        same = False
    results['file ' + path] = same
for path in spec['absent']:
    results['absent ' + path] = not _os.path.lexists(path)
for path in spec['empty_dirs']:
    results['empty ' + path] = _os.path.isdir(path) and not _os.path.islink(path) and not _os.listdir(path)
report(results)
"""


@dataclass(frozen=True, slots=True)
class ShellSource:
    name: str

    def build(self, seed: int) -> ShellTask:
        generate = TASKS[self.name][0]
        return draw_unsolved(
            lambda drawn: generate(random.Random(f"shell/{self.name}:{drawn}")),
            ShellTask.solved_untouched,
            seed,
            f"shell/{self.name}",
        )

    def problem(self, seed: int) -> Problem:
        task = self.build(seed)
        listing = "\n".join(f"  {path}" for path in sorted(task.files))
        prompt = (
            f"{task.instructions}\n\nThe working directory holds:\n  {TASK_FILE} (this statement)\n"
            f"{listing}\n\nProtected files: {', '.join(task.protected)}."
        )
        data: dict[str, Any] = {
            "files": task.files | {TASK_FILE: task.instructions + "\n"},
            "protected": task.protected,
            "expect": {
                "files": {path: sha256(content) for path, content in task.expected_files.items()},
                "absent": task.absent,
                "empty_dirs": task.empty_dirs,
            },
            "script": task.script,
            "hidden_runs": [list(run) for run in task.hidden_runs],
            "commands": task.reference,
        }
        return Problem(prompt=prompt, answer="done", data=data)


async def setup(state: EpisodeState) -> None:
    await qc.start_clean(state)
    await state.require_session().upload(state.task.data["files"])
    await qc.protect(state, state.task.data["protected"])


async def _hidden_runs(state: EpisodeState) -> dict[str, bool]:
    """Run the repaired script on inputs it never saw; compare stdout here."""
    data = state.task.data
    results = {}
    for index, (text, expected) in enumerate(data["hidden_runs"]):
        name = f".hidden-{new_nonce()[:12]}.txt"
        await state.require_session().upload({name: text})
        run = await state.run(f"bash {data['script']} {name}; rm -f {name}", "bash")
        results[f"hidden run {index}"] = run.status is RunStatus.OK and run.stdout == expected
    return results


async def check_state(state: EpisodeState) -> dict[str, bool]:
    data = state.task.data
    grader = await run_trusted(state, GRADER_BODY, stdin=json.dumps(data["expect"]))
    results = {str(k): v is True for k, v in (grader.data or {"grader failed": False}).items()}
    if data["script"]:
        results.update(await _hidden_runs(state))
    return results


def state_rubric(check: Callable[[EpisodeState], Any], call_budget: int) -> Rubric:
    """correctness (gate: every check), checks (the fraction), efficiency (tool calls within budget)."""

    async def results(inp: RewardInput) -> dict[str, bool]:
        if inp.state is None:
            raise EnvError(f"{inp.task.env} is scored on an episode's final state, not a bare completion")
        if _RESULTS not in inp.state.info:
            inp.state.info[_RESULTS] = await check(inp.state)
        found: dict[str, bool] = inp.state.info[_RESULTS]
        return found

    async def correctness(inp: RewardInput) -> float:
        found = await results(inp)
        return 1.0 if found and all(found.values()) else 0.0

    async def checks(inp: RewardInput) -> float:
        found = await results(inp)
        return sum(found.values()) / len(found) if found else 0.0

    def efficiency(inp: RewardInput) -> float:
        calls = inp.state.tool_calls if inp.state is not None else 0
        return 1.0 if calls <= call_budget else max(0.0, 1.0 - (calls - call_budget) / (2 * call_budget))

    return Rubric(
        (
            Reward("correctness", correctness, 0.8, gate=True),
            Reward("checks", checks, 0.1),
            Reward("efficiency", efficiency, 0.1),
        )
    )


def tool_call_message(name: str, arguments: dict[str, Any], index: int) -> Message:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{index}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def reference_replies(task: Task) -> Messages:
    commands = task.data["commands"]
    replies = [tool_call_message("shell", {"command": command}, i) for i, command in enumerate(commands)]
    return [*replies, tool_call_message("submit", {"answer": "done"}, len(commands))]


def adversarial(task: Task) -> list[str]:
    """Claims without actions: the state is what is scored, not what the model says about it."""
    return [
        "Done: every file is in place.",
        ANSWER_TAG.format("done"),
        "```bash\n" + task.data["commands"][0] + "\n```",
    ]


def shell_env(name: str) -> Environment:
    if name not in TASKS:
        raise EnvError(f"unknown shell task {name!r}; expected one of {', '.join(TASKS)}")
    return Environment(
        name=f"shell/{name}",
        source=ShellSource(name),
        renderer=ChatRenderer(SYSTEM),
        parser=ANSWER_TAG,
        rubric=state_rubric(check_state, call_budget=8),
        tools=(SHELL, PYTHON, SUBMIT),
        max_turns=16,
        description=f"terminal: {TASKS[name][1]}; final filesystem state checked in the sandbox",
        setup=setup,
        validators=qc.validators(),
        reference_replies=reference_replies,
        adversarial=adversarial,
    )


def register(registry: EnvRegistry) -> None:
    for name in TASKS:
        registry.register(f"shell/{name}", partial(shell_env, name), source=__name__)
