"""Write a float32 GGUF of a quantized one: the weights tether serves, in the file format llama.cpp reads.

tether serves a registered model as its GGUF dequantized to float32 (`convert.convert_gguf`), so a
like-for-like comparison with llama.cpp needs llama.cpp to run those same float32 numbers. This module
dequantizes every tensor with the gguf package (the same dequantization transformers uses when it builds
tether's cache) and copies every metadata field (architecture, tokenizer, chat template) unchanged, so
the two files differ only in how their weights are stored. It writes files; it loads no model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tether.errors import TetherError


class GgufExportError(TetherError):
    """A GGUF file that cannot be read or rewritten."""


# Header fields the writer sets itself (and tensor layout fields that describe the old file).
_WRITER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.alignment")
FILE_TYPE_F32 = 0  # llama.cpp's `general.file_type` for all-float32 weights (LLAMA_FTYPE_ALL_F32)


def write_f32_gguf(source: Path, out: Path) -> Path:
    """Write `source`'s weights dequantized to float32 into `out` (written whole, then renamed, so a
    half-written file is never left under that name); returns `out`."""
    import gguf

    try:
        reader = gguf.GGUFReader(source)
    except (OSError, ValueError) as error:
        raise GgufExportError(f"cannot read GGUF file {source}: {error}") from None
    architecture = reader.fields.get("general.architecture")
    if architecture is None:
        raise GgufExportError(f"{source}: no general.architecture field; expected a llama.cpp model file")
    writer_path = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(writer_path, str(architecture.contents()))
    for name, field in reader.fields.items():
        if name in _WRITER_FIELDS or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_file_type(FILE_TYPE_F32)
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions innermost first; numpy's shape is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        writer.add_tensor(tensor.name, np.ascontiguousarray(weights, dtype=np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(writer_path, out)
    return out
