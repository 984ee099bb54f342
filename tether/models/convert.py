"""Convert a GGUF checkpoint into a Hugging Face folder (config.json, model.safetensors, tokenizer).

transformers dequantizes GGUF on load but refuses to save such a model, so the weights are copied into a
model built from the same config (minus its quantization settings) and that model is saved. This is the
only module that needs transformers' GGUF support; it never contacts a model hub.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from pathlib import Path
from typing import Any

import torch


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Write the converted model into `out_dir` (which must exist) and describe what was done."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    started = time.monotonic()
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    # The GGUF reader draws its own tqdm bar on stderr; callers show their own progress instead.
    with contextlib.redirect_stderr(io.StringIO()):
        quantized = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "architecture": config.architectures[0] if config.architectures else type(model).__name__,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
        "has_chat_template": tokenizer.chat_template is not None,
        "conversion_s": round(time.monotonic() - started, 2),
    }
