"""This machine's accelerators: how many, which share an NVLink island, and which indices a job gets.

`parse_topology_matrix` reads the matrix `nvidia-smi topo -m` prints (pure, tested on captured
outputs); `detect_islands` runs it where nvidia-smi exists, and otherwise the machine is one island.
`assign_devices` picks concrete indices for a job: the smallest island that holds the whole request
(so a 2-GPU job gets an NVLink pair, not two GPUs across PCIe), else the lowest free indices.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Collection, Sequence

Islands = tuple[tuple[int, ...], ...]

_GPU = re.compile(r"GPU(\d+)")
_LINK = re.compile(r"X|NV\d+|SYS|NODE|PHB|PXB|PIX")


def parse_topology_matrix(text: str) -> Islands:
    """GPUs linked by NVLink (`NV#` cells, transitively) as islands, in index order.

    Raises ValueError when the text holds no GPU matrix (nvidia-smi failed or printed something else).
    """
    tokens = [line.split() for line in text.splitlines()]
    header = next(
        (t for t in tokens if t and t[0] == "GPU0" and (len(t) < 2 or not _LINK.fullmatch(t[1]))), None
    )
    if header is None:
        raise ValueError("no GPU matrix in the `nvidia-smi topo -m` output")
    count = sum(1 for name in header if _GPU.fullmatch(name))
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    seen: set[int] = set()
    for row in tokens:
        match = _GPU.fullmatch(row[0]) if row else None
        cells = row[1 : count + 1]
        if match is None or len(cells) < count or not all(_LINK.fullmatch(c) for c in cells):
            continue
        gpu = int(match.group(1))
        if gpu >= count:
            raise ValueError(f"row GPU{gpu} is beyond the {count} GPU columns of the matrix")
        seen.add(gpu)
        for other, cell in enumerate(cells):
            if cell.startswith("NV"):
                parent[root(gpu)] = root(other)
    if len(seen) != count:
        raise ValueError(f"the matrix names {count} GPUs but has rows for {len(seen)}")
    groups: dict[int, list[int]] = {}
    for gpu in range(count):
        groups.setdefault(root(gpu), []).append(gpu)
    return tuple(sorted(tuple(g) for g in groups.values()))


def one_island(count: int) -> Islands:
    return (tuple(range(count)),) if count else ()


def detect_islands(count: int) -> Islands:
    """NVLink islands from `nvidia-smi topo -m` where it runs and agrees with `count`; else one island."""
    smi = shutil.which("nvidia-smi")
    if smi is None or count == 0:
        return one_island(count)
    try:
        text = subprocess.run(
            [smi, "topo", "-m"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        islands = parse_topology_matrix(text)
    except (OSError, subprocess.SubprocessError, ValueError):
        return one_island(count)
    return islands if sum(len(i) for i in islands) == count else one_island(count)


def assign_devices(islands: Islands, held: Collection[int], want: int) -> tuple[int, ...] | None:
    """`want` free device indices (None if fewer are free): best-fit island first, else the lowest."""
    if want == 0:
        return ()
    free_by_island = [[d for d in island if d not in held] for island in islands]
    fitting = [free for free in free_by_island if len(free) >= want]
    if fitting:
        return tuple(min(fitting, key=lambda free: (len(free), free[0]))[:want])
    free = sorted(d for island in free_by_island for d in island)
    return tuple(free[:want]) if len(free) >= want else None


def visible_devices(devices: Sequence[int]) -> str:
    """`CUDA_VISIBLE_DEVICES` for a job: its indices, or empty (no GPU at all) for a CPU-only job."""
    return ",".join(str(d) for d in devices)
