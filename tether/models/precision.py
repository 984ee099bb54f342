"""Where a model runs and in which floating-point type: the `device` and `dtype` settings of every command.

One spelling across `tether train`, `serve`, `eval` and the agents' engine: `device` is `auto` (CUDA where
present, else the CPU), `cpu`, `cuda` or `cuda:N`; `dtype` is `float32`, `bfloat16` or `float16`. The
strings are checked here, once, so a typo fails with the accepted values before any model loads.
"""

from __future__ import annotations

import re
from enum import StrEnum

import torch

from tether.errors import ConfigError

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


class DType(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.value]

    @classmethod
    def parse(cls, value: str, setting: str = "dtype") -> DType:
        try:
            return cls(value)
        except ValueError:
            accepted = ", ".join(d.value for d in cls)
            raise ConfigError(f"{setting} = {value!r}: expected one of {accepted}") from None


def resolve_device(spec: str, setting: str = "device") -> torch.device:
    """The torch device `spec` names; `auto` is the first CUDA device where there is one, else the CPU.
    A CUDA device this machine lacks fails here, not at the first tensor."""
    if not re.match(DEVICE_PATTERN, spec):
        raise ConfigError(f"{setting} = {spec!r}: expected auto, cpu, cuda or cuda:N")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= available:
            raise ConfigError(
                f"{setting} = {spec!r}: this machine has {available} CUDA device(s); use cpu or auto"
            )
    return device
