import pytest
import torch

from tether.errors import ConfigError
from tether.models.precision import DType, resolve_device


def test_auto_is_cuda_exactly_when_cuda_is_available() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


def test_cpu_resolves_to_the_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "CPU", "cuda:x", ""])
def test_a_misspelt_device_names_the_accepted_values(spec: str) -> None:
    with pytest.raises(ConfigError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device(spec, "--device")


def test_a_cuda_device_this_machine_lacks_fails_before_any_tensor() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=f"has {count} CUDA device"):
        resolve_device(f"cuda:{count}")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_dtype_names_map_to_torch_types(name: str, dtype: torch.dtype) -> None:
    assert DType.parse(name).torch is dtype


def test_an_unknown_dtype_lists_the_accepted_ones() -> None:
    accepted = r"model\.dtype = 'fp8': expected one of float32, bfloat16, float16"
    with pytest.raises(ConfigError, match=accepted):
        DType.parse("fp8", "model.dtype")
