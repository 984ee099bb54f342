"""A sequence classifier (a reward model): our decoder as the backbone and a linear score head over the
hidden state of each sequence's last non-padding token, as transformers' `*ForSequenceClassification`
computes it, so those checkpoints (`model.*` and `score.weight`) load from a local folder as they are.

It maps token ids to logits, and logits to scores in [0, 1] (`Squash`); it knows no chat template and
no text (the caller renders conversations) and downloads nothing. Whole sequences go through the dense
forward of `dense.py` without a KV cache, packed several to a row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from tether.models.config import ARCHITECTURES, ModelConfig, UnsupportedModelError
from tether.models.dense import DenseBatch, hidden_states
from tether.models.transformer import DecoderModel

CLASSIFIER_SUFFIX = "ForSequenceClassification"
CAUSAL_SUFFIX = "ForCausalLM"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # older checkpoints' buffers; we recompute them


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    """The backbone's config, the number of logits and the id pooling skips (None: the last token)."""

    backbone: ModelConfig
    num_labels: int
    pad_token_id: int | None

    @classmethod
    def from_folder(cls, folder: Path) -> ClassifierConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{str(folder)!r} is not a model folder: it has no config.json")
        raw = json.loads(path.read_text())
        accepted = [name.removesuffix(CAUSAL_SUFFIX) + CLASSIFIER_SUFFIX for name in ARCHITECTURES]
        found = [name for name in raw.get("architectures") or [] if name in accepted]
        if not found:
            raise UnsupportedModelError(
                f"{str(folder)!r} holds {raw.get('architectures')!r}, not a sequence classifier; "
                f"accepted: {', '.join(accepted)}"
            )
        causal = found[0].removesuffix(CLASSIFIER_SUFFIX) + CAUSAL_SUFFIX
        backbone = ModelConfig.from_dict({**raw, "architectures": [causal]})
        # transformers writes id2label for every label (num_labels itself is not saved).
        num_labels = len(raw.get("id2label") or {}) or int(raw.get("num_labels", 2))
        pad = raw.get("pad_token_id")
        return cls(backbone, num_labels, None if pad is None else int(pad))


@dataclass(frozen=True, slots=True)
class Squash:
    """Logits to a score in [0, 1]: one label, sigmoid((logit - shift) / scale); several, the softmax
    probability of `positive_label` (default: the last)."""

    shift: float = 0.0
    scale: float = 1.0
    positive_label: int | None = None

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"squash scale {self.scale!r} must be > 0")

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, labels] logits -> [N] scores."""
        labels = logits.shape[-1]
        if labels == 1:
            if self.positive_label not in (None, 0):
                raise ValueError(f"positive_label {self.positive_label} of a classifier with 1 label")
            return torch.sigmoid((logits[:, 0] - self.shift) / self.scale)
        label = labels - 1 if self.positive_label is None else self.positive_label
        if not 0 <= label < labels:
            raise ValueError(f"positive_label {label} of a classifier with {labels} labels")
        return torch.softmax(logits, dim=-1)[:, label]


def pooled_index(sequence: Sequence[int], pad_token_id: int | None) -> int:
    """The position a sequence is classified at: its last token that is not `pad_token_id` (0 if all
    are), as transformers pools, so a sequence that ends in the pad id is read where transformers reads
    it."""
    if pad_token_id is None:
        return len(sequence) - 1
    return next((i for i in range(len(sequence) - 1, -1, -1) if sequence[i] != pad_token_id), 0)


class SequenceClassifier(nn.Module):
    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.classifier_config = config
        self.config = config.backbone
        self.model = DecoderModel(config.backbone)
        self.score = nn.Linear(config.backbone.hidden_size, config.num_labels, bias=False)

    @property
    def device(self) -> torch.device:
        return self.score.weight.device

    def logits(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 logits [len(sequences), num_labels] of token-id sequences."""
        if not sequences or any(not sequence for sequence in sequences):
            raise ValueError("classify at least one sequence, none of them empty")
        pad = self.classifier_config.pad_token_id
        longest = max(len(sequence) for sequence in sequences)
        batch = DenseBatch.packed(sequences, row_tokens=longest, pad_id=pad or 0).to(self.device)
        hidden = hidden_states(self, batch)
        rows = [row for row, _ in batch.columns]
        columns = [
            located[pooled_index(sequence, pad)]
            for (_, located), sequence in zip(batch.columns, sequences, strict=True)
        ]
        picked = hidden[torch.tensor(rows, device=self.device), torch.tensor(columns, device=self.device)]
        logits: torch.Tensor = self.score(picked)
        return logits.float()

    @torch.no_grad()
    def scores(self, sequences: Sequence[Sequence[int]], squash: Squash | None = None) -> list[float]:
        """One score in [0, 1] per sequence."""
        values = (squash or Squash())(self.logits(sequences))
        return [float(value) for value in values.cpu()]


def load_classifier(
    folder: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> SequenceClassifier:
    """The classifier saved in `folder` (config.json and safetensors), in eval mode on `device`."""
    config = ClassifierConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{str(folder)!r} has no *.safetensors weights")
    with torch.device("meta"):
        model = SequenceClassifier(config)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file, device=str(device)))
    state = {k: v.to(dtype) for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise UnsupportedModelError(
            f"weights in {str(folder)!r} do not fit a {config.backbone.architecture} sequence classifier: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    model.eval().requires_grad_(False)
    return model
