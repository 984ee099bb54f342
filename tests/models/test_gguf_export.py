"""The float32 GGUF the llama.cpp comparison serves: the same numbers as the quantized file dequantized,
every metadata field kept, and a clear error for a file that is not GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tether.models.gguf_export import FILE_TYPE_F32, GgufExportError, write_f32_gguf

WEIGHTS = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
NORM = np.arange(4, dtype=np.float16)


def write_quantized_gguf(path: Path) -> Path:
    """A two-tensor llama GGUF: one Q8_0 matrix, one float16 vector, and a tokenizer list."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_file_type(7)  # mostly Q8_0
    writer.add_token_list(["a", "b", "c"])
    quantized = gguf.quants.quantize(WEIGHTS, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", NORM)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_tensor_is_float32_with_the_dequantized_values_and_the_metadata_is_kept(tmp_path: Path) -> None:
    source = write_quantized_gguf(tmp_path / "tiny.Q8_0.gguf")
    out = write_f32_gguf(source, tmp_path / "tiny.f32.gguf")
    reader, original = gguf.GGUFReader(out), gguf.GGUFReader(source)
    assert [t.tensor_type for t in reader.tensors] == [gguf.GGMLQuantizationType.F32] * 2
    for ours, theirs in zip(reader.tensors, original.tensors, strict=True):
        assert ours.name == theirs.name and list(ours.shape) == list(theirs.shape)
        expected = gguf.quants.dequantize(theirs.data, theirs.tensor_type).reshape(ours.data.shape)
        np.testing.assert_array_equal(ours.data, expected)
    assert np.abs(reader.tensors[0].data - WEIGHTS).max() < 0.01  # Q8_0 is close to what it stored
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert fields == {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.context_length": 64,
        "general.file_type": FILE_TYPE_F32,
        "tokenizer.ggml.tokens": ["a", "b", "c"],
    }
    assert not (tmp_path / "tiny.f32.gguf.partial").exists()


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GgufExportError, match=r"cannot read GGUF file .*model\.gguf"):
        write_f32_gguf(bogus, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
