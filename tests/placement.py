"""Devices and dtypes the engine and learner suites run on: a test takes the `placement` fixture
(tests/conftest.py) to run once per entry of `PLACEMENTS`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a device-parametrized test runs its model: a torch device and a `DType` value."""

    device: str
    dtype: str

    @property
    def exact(self) -> bool:
        """float32 on the CPU, where the engine's paths agree bit for bit whatever the batch (the C attention
        kernel and oneDNN's packed projections compute each row alone); elsewhere to the dtype's rounding."""
        return self.device == "cpu" and self.dtype == "float32"


# Every engine and learner suite that runs "on every device" takes these: the CPU cases run everywhere
# (bfloat16 too: a CPU without bf16 instructions runs it through slower generic kernels), the CUDA ones
# skip without a GPU (`scripts/gpu-check.sh` runs them with `-m cuda`).
PLACEMENTS = [
    pytest.param(Placement("cpu", "float32"), id="cpu-float32"),
    pytest.param(Placement("cpu", "bfloat16"), id="cpu-bfloat16"),
    pytest.param(Placement("cuda", "float32"), id="cuda-float32", marks=pytest.mark.cuda),
    pytest.param(Placement("cuda", "bfloat16"), id="cuda-bfloat16", marks=pytest.mark.cuda),
]
