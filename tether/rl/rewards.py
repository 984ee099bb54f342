"""The `[[rewards]]` of a train config, built and appended to the rubrics of the environments they name.

A judge (`tether.envs.judge`) reaches its model through `open_client`, the one way a `--model` or
`--base-url` becomes a `ChatClient` (an OpenAI-compatible server, our engine in this process through the
same app `tether serve` runs, or a scripted file); a reward model is a `SequenceClassifier`
(`tether.models.classifier`) over conversations rendered by its own chat template (`ClassifierScorer`).
Both open what they hold on first use, in the process that scores (a Ray rollout worker gets its own),
and one instance serves every environment a table names, so its cache and batches are shared. Settings
are checked here, before any model loads: a glob that matches nothing, an unreadable checkpoint, a
missing scripted file or API key are `ConfigError`s.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tether.chat import ChatClient, Messages
from tether.chat.pricing import DEFAULT_PRICES, Tier
from tether.chat.template import ChatTemplate
from tether.envs.judge import DEFAULT_RUBRIC, JudgeConfig, JudgeReward
from tether.envs.registry import EnvRegistry, mixture_from_weights
from tether.envs.reward_model import RewardModelReward
from tether.envs.scoring import Reward, RewardFn
from tether.errors import ConfigError
from tether.models.config import UnsupportedModelError
from tether.rl.agent_rollouts import is_agent_env
from tether.rl.config import TrainConfig
from tether.rl.reward_sections import RewardKind, RewardSection

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.models.classifier import SequenceClassifier, Squash

SCRIPTED = "scripted:"


class ClassifierScorer:
    """A `ConversationScorer` over the sequence classifier in `folder`, loaded on the first batch; a
    conversation longer than the classifier's context keeps its end (where the answer is)."""

    def __init__(self, folder: Path, device: str, squash: Squash) -> None:
        self.name = str(folder)
        self.folder = folder
        self.device = device
        self.squash = squash
        self._loaded: tuple[SequenceClassifier, ChatTemplate] | None = None
        self._lock = threading.Lock()  # batches are scored in worker threads

    def __getstate__(self) -> dict[str, object]:
        """What a Ray rollout worker receives: the settings; it loads the model itself."""
        return {"folder": self.folder, "device": self.device, "squash": self.squash}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._loaded = None
        self._lock = threading.Lock()

    def _model(self) -> tuple[SequenceClassifier, ChatTemplate]:
        with self._lock:
            if self._loaded is None:
                from tether.models.classifier import load_classifier
                from tether.models.loader import load_tokenizer
                from tether.models.precision import resolve_device

                model = load_classifier(self.folder, resolve_device(self.device, "rewards.device"))
                tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.folder)
                self._loaded = model, ChatTemplate(tokenizer)
            return self._loaded

    def score(self, conversations: Sequence[Messages]) -> list[float]:
        model, template = self._model()
        limit = model.config.context_limit
        ids = [
            template.encode(conversation, generation_prompt=False)[-limit:] for conversation in conversations
        ]
        return model.scores(ids, self.squash)


def _judge(section: RewardSection, config: TrainConfig) -> JudgeReward:
    model = section.model
    if model is not None and model.startswith(SCRIPTED) and not Path(model[len(SCRIPTED) :]).is_file():
        raise ConfigError(f"rewards ({section.component}): model = {model!r}: no such file")
    api_key = None
    if section.api_key_env is not None:
        api_key = os.environ.get(section.api_key_env)
        if not api_key:
            raise ConfigError(
                f"rewards ({section.component}): api_key_env = {section.api_key_env!r} is not set; "
                "export it with the judge's API key, or unset api_key_env"
            )
    judge = JudgeConfig(
        model=f"{model or 'default'}@{section.base_url}" if section.base_url else str(model),
        rubric=section.rubric or DEFAULT_RUBRIC,
        labels=section.labels,
        max_tokens=section.max_tokens,
        max_reason_chars=section.max_reason_chars,
        concurrency=section.concurrency,
        price=section.price or DEFAULT_PRICES[Tier.STANDARD],
    )
    return JudgeReward(judge, _connect(model, section.base_url, api_key, section.device, config))


def _connect(
    model: str | None, base_url: str | None, api_key: str | None, device: str, config: TrainConfig
) -> Callable[[], ChatClient]:
    def connect() -> ChatClient:
        from tether.serving.engine_client import open_client  # loads an engine only when one is asked for

        return open_client(model, base_url, config.model.cache_dir, device=device, api_key=api_key)

    return connect


def _reward_model(section: RewardSection) -> RewardModelReward:
    from tether.models.classifier import ClassifierConfig, Squash

    assert section.path is not None, "checked by RewardSection"
    try:
        labels = ClassifierConfig.from_folder(section.path).num_labels
    except UnsupportedModelError as error:
        raise ConfigError(f"rewards ({section.component}): path = {str(section.path)!r}: {error}") from None
    if section.positive_label is not None and section.positive_label >= labels:
        raise ConfigError(
            f"rewards ({section.component}): positive_label = {section.positive_label} but the classifier "
            f"has {labels} label(s) (0..{labels - 1})"
        )
    squash = Squash(section.logit_shift, section.logit_scale, section.positive_label)
    return RewardModelReward(ClassifierScorer(section.path, section.device, squash), section.max_batch)


BUILDERS: dict[RewardKind, Callable[[RewardSection, TrainConfig], RewardFn]] = {
    RewardKind.JUDGE: _judge,
    RewardKind.REWARD_MODEL: lambda section, _: _reward_model(section),
}


def add_reward_components(registry: EnvRegistry, config: TrainConfig) -> dict[str, list[str]]:
    """Append each `[[rewards]]` component to the rubric of the mixture's environments it matches, in
    `registry`; returns the components added per environment."""
    names = mixture_from_weights(registry, config.envs.weights).names
    extra: dict[str, list[Reward]] = {}
    for index, section in enumerate(config.rewards):
        patterns = [pattern.strip() for pattern in section.envs.split(",") if pattern.strip()]
        matched = [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
        where = f"rewards[{index}] ({section.component})"
        if not matched:
            raise ConfigError(
                f"{where}: envs = {section.envs!r} matches no environment of the mixture ({', '.join(names)})"
            )
        agents = [name for name in matched if is_agent_env(name)]
        if agents:
            raise ConfigError(
                f"{where}: envs = {section.envs!r} matches agent task families {agents}, which the task's "
                "success check rewards alone"
            )
        reward = Reward(
            section.component, BUILDERS[section.kind](section, config), section.weight, section.gate
        )
        for name in matched:
            extra.setdefault(name, []).append(reward)
    for name, rewards in extra.items():
        env = registry.get(name)
        try:
            rubric = env.rubric.extended(tuple(rewards))
        except ValueError as error:  # a component named like one the environment has
            raise ConfigError(f"[[rewards]] on {name}: {error}; give the component another name") from None
        registry.add(replace(env, rubric=rubric), source=registry.source_of(name), replace=True)
    return {name: [reward.name for reward in rewards] for name, rewards in extra.items()}
