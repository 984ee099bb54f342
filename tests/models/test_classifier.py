"""The sequence classifier: transformers' `*ForSequenceClassification` logits and pooling, our squash into
[0, 1], and the folders it refuses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tether.models.classifier import Squash, load_classifier, pooled_index
from tether.models.config import UnsupportedModelError
from tether.testing import make_tiny_classifier

SEQUENCES = [[5, 9, 20, 33, 41], [7, 8, 9], [100, 3, 2, 1, 0, 44, 45, 46, 47, 48, 49]]


def transformers_logits(folder: Path, sequences: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    pad = model.config.pad_token_id
    width = max(map(len, sequences))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])  # right-padded, as tokenizers do
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=ids, attention_mask=(ids != pad).long()).logits
    return logits


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Path]:
    made: dict[tuple[str, int], Path] = {}

    def get(architecture: str, labels: int = 1) -> Path:
        if (architecture, labels) not in made:
            folder = tmp_path_factory.mktemp(f"{architecture}-{labels}")
            made[architecture, labels] = make_tiny_classifier(folder, architecture, num_labels=labels)
        return made[architecture, labels]

    return get


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_equal_transformers_sequence_classification(
    classifier: Callable[[str, int], Path], architecture: str
) -> None:
    folder = classifier(architecture, 1)
    ours = load_classifier(folder).logits(SEQUENCES)
    torch.testing.assert_close(ours, transformers_logits(folder, SEQUENCES), atol=2e-5, rtol=1e-4)


def test_a_sequence_is_read_at_its_last_token_that_is_not_padding(
    classifier: Callable[[str, int], Path],
) -> None:
    folder = classifier("llama", 1)
    pad = json.loads((folder / "config.json").read_text())["pad_token_id"]
    ending_in_pad = [[11, 12, 13, pad, pad], [11, 12, 13]]
    assert pooled_index(ending_in_pad[0], pad) == 2 and pooled_index([pad, pad], pad) == 0
    ours = load_classifier(folder).logits(ending_in_pad)
    torch.testing.assert_close(ours[0], ours[1])  # both read at token 13, as transformers does
    torch.testing.assert_close(ours, transformers_logits(folder, ending_in_pad), atol=2e-5, rtol=1e-4)


def test_scores_squash_one_logit_by_sigmoid_and_several_by_the_positive_labels_probability(
    classifier: Callable[[str, int], Path],
) -> None:
    one = load_classifier(classifier("qwen3", 1))
    logits = one.logits(SEQUENCES)[:, 0]
    assert one.scores(SEQUENCES) == pytest.approx(torch.sigmoid(logits).tolist())
    shifted = one.scores(SEQUENCES, Squash(shift=0.5, scale=2.0))
    assert shifted == pytest.approx(torch.sigmoid((logits - 0.5) / 2.0).tolist())
    three = load_classifier(classifier("qwen3", 3))
    probabilities = torch.softmax(transformers_logits(classifier("qwen3", 3), SEQUENCES), dim=-1)
    assert three.scores(SEQUENCES) == pytest.approx(probabilities[:, 2].tolist(), abs=1e-5)
    assert three.scores(SEQUENCES, Squash(positive_label=0)) == pytest.approx(
        probabilities[:, 0].tolist(), abs=1e-5
    )
    with pytest.raises(ValueError, match="positive_label 3 of a classifier with 3 labels"):
        three.scores(SEQUENCES, Squash(positive_label=3))


def test_a_causal_lm_folder_is_not_a_classifier(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(UnsupportedModelError, match="not a sequence classifier; accepted: LlamaForSequence"):
        load_classifier(tiny_model("llama"))


def test_weights_that_do_not_fit_are_named(classifier: Callable[[str, int], Path], tmp_path: Path) -> None:
    folder = classifier("llama", 1)
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    del state["score.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"missing \['score.weight'\]"):
        load_classifier(tmp_path)
