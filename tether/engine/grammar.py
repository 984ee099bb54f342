"""Grammar-constrained decoding: `StructuredOutput` compiled against one tokenizer's vocabulary, and the
allowed-token masks of the sequences that follow a grammar, computed off the forward pass's thread.

The library is llguidance (Rust core, a CPU wheel with no Python dependencies, the constrained decoder of
vLLM, SGLang and llama.cpp). Measured here on SmolLM2's 49,152 tokens: its tokenizer view builds in 0.3 s
once per engine, a matcher for a new JSON schema in about half a millisecond (no precomputation over the
vocabulary per grammar), one mask in about 10 microseconds; it drops the GIL while computing and
deep-copies matchers. xgrammar precomputes a token-mask cache over the vocabulary for every grammar it
compiles, and its Linux wheel requires triton and apache-tvm-ffi besides torch.

JSON (schema or any object) is compiled compact, without optional whitespace: a model cannot then fill
its token budget with blanks between tokens that the grammar would have let it close. This module never
tokenizes text and never touches the model; the engine applies the masks (`sampling.AllowedTokens`).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

from tether.engine.sampling import AllowedTokens
from tether.engine.scheduler import RequestError
from tether.engine.structured import GrammarKind, StructuredOutput
from tether.errors import ConfigError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase

# Compact JSON: no whitespace between tokens; schemas may still override it through "x-guidance".
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
PendingMasks = tuple[list[int], Future[torch.Tensor]]
"""The draws being masked, and their bitmask once computed."""
CACHED_GRAMMARS = 64
"""Compiled grammars kept per compiler, by (kind, spec): a server's repeated schemas compile once."""


class Grammar:
    """One compiled grammar; `matcher()` gives a fresh matcher for each sequence that follows it."""

    __slots__ = ("_prototype", "structured")

    def __init__(self, structured: StructuredOutput, prototype: llguidance.LLMatcher) -> None:
        self.structured = structured
        self._prototype = prototype  # never advanced: only copied

    def matcher(self) -> llguidance.LLMatcher:
        return self._prototype.deep_copy()


class GrammarCompiler:
    """Compiles `StructuredOutput` for one vocabulary of `vocab_size` tokens (the model's logits' width:
    tokens past the tokenizer's own are never allowed). Built once per engine."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        if tokenizer.vocab_size > vocab_size:
            raise ConfigError(
                f"grammars: the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                f"vocabulary of {vocab_size}"
            )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()

    @classmethod
    def from_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarCompiler:
        """From a fast Hugging Face tokenizer (about 0.3 s for SmolLM2's); `eos_token_ids` are the tokens
        that end a completion the grammar accepts."""
        try:
            wrapped = llguidance.hf.from_tokenizer(
                tokenizer,  # type: ignore[arg-type]
                n_vocab=vocab_size,
                eos_token=list(eos_token_ids) or None,
            )
        except ValueError as error:
            raise ConfigError(f"grammars: tokenizer {type(tokenizer).__name__}: {error}") from None
        return cls(wrapped, vocab_size)

    @classmethod
    def for_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarCompiler | None:
        """`from_tokenizer`, or None for a tokenizer it cannot wrap (a slow one): an engine without
        grammars serves everything but structured requests, and refuses those saying so."""
        try:
            return cls.from_tokenizer(tokenizer, vocab_size, eos_token_ids)
        except ConfigError:
            return None

    def compile(self, structured: StructuredOutput) -> Grammar:
        """The grammar of `structured`, or a `RequestError` saying what in it is wrong."""
        key = (structured.kind, structured.spec)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        text = grammar_text(structured)
        prototype = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if prototype.is_error():
            raise RequestError(f"structured output {structured.kind}: {prototype.get_error()}")
        grammar = Grammar(structured, prototype)
        self._cache[key] = grammar
        if len(self._cache) > CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return grammar


def compile_grammar(grammars: GrammarCompiler | None, structured: StructuredOutput) -> Grammar:
    """`structured` compiled by an engine's `grammars`; a `RequestError` where it has none."""
    if grammars is None:
        raise RequestError(
            "structured output needs an engine built with a grammar compiler "
            "(LLMEngine(grammars=GrammarCompiler.from_tokenizer(...)); from_pretrained builds one)"
        )
    return grammars.compile(structured)


def _json_schema(spec: str) -> str:
    try:
        schema: Any = json.loads(spec)
    except json.JSONDecodeError as error:
        raise RequestError(f"structured output json_schema: not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise RequestError(
            f"structured output json_schema: expected a JSON object, got {type(schema).__name__}"
        )
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as error:
        raise RequestError(f"structured output json_schema: {error}") from None


def _json_object(_spec: str) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)


GRAMMARS: dict[GrammarKind, Callable[[str], str]] = {
    "json_schema": _json_schema,
    "json_object": _json_object,
    "lark": llguidance.LLMatcher.grammar_from_lark,
    "regex": llguidance.LLMatcher.grammar_from_regex,
}
"""llguidance's grammar text for a spec of each kind (checked against a vocabulary when compiled)."""


def grammar_text(structured: StructuredOutput) -> str:
    return GRAMMARS[structured.kind](structured.spec)


class TokenMasks:
    """Allowed-token masks of many matchers at once, computed on a worker thread (`start`) while the
    caller runs the forward pass, then unpacked on the logits' device into one [rows, vocab] bias
    (`result`): one gather for all constrained rows, whatever their count.

    llguidance computes with `threads` Rust threads (default: one per four cores, at least one, so that on
    a small machine the masks take one core from torch's threads for microseconds, not all of them)."""

    def __init__(self, vocab_size: int, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.threads = threads if threads is not None else max(1, (os.cpu_count() or 1) // 4)
        # Started by the first `start`: an engine that never sees a structured request holds no threads.
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._bias: dict[torch.device, torch.Tensor] = {}

    def start(self, draws: list[llguidance.LLMatcher | None]) -> PendingMasks | None:
        """Begin computing the masks of the draws that have a matcher (none are advanced until `result`);
        None when no draw has one. Each mask is a row of an int32 bitmask: bit j of word w allows token
        32 w + j."""
        constrained = [i for i, matcher in enumerate(draws) if matcher is not None]
        if not constrained:
            return None
        matchers = [matcher for matcher in draws if matcher is not None]
        bitmask = torch.zeros((len(matchers), self.words), dtype=torch.int32)
        if self._executor is None or self._thread is None:
            self._executor = llguidance.LLExecutor(num_threads=self.threads)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tether-masks")
        executor = self._executor

        def fill() -> torch.Tensor:
            executor.unsafe_compute_mask_ptr(
                [(matcher, row) for row, matcher in enumerate(matchers)],
                bitmask.data_ptr(),
                self.words * 4,
                len(matchers),
            )
            return bitmask

        return constrained, self._thread.submit(fill)

    def result(self, pending: PendingMasks, device: torch.device) -> AllowedTokens:
        """The masks `start` began, as a [rows, vocab_size] float32 bias on `device`: 0 where a token is
        allowed, -inf elsewhere (an addition to the logits: cheaper than a masked fill)."""
        draws, bitmask = pending
        return AllowedTokens(draws, self.unpack(bitmask.result(), device))

    def unpack(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        # Little-endian words: byte i of a row holds tokens 8 i .. 8 i + 7, bit k token 8 i + k.
        octets = bitmask.to(device, non_blocking=True).view(torch.uint8).reshape(-1).long()
        bias = self._byte_bias(device).index_select(0, octets).reshape(bitmask.shape[0], -1)
        return bias[:, : self.vocab_size]

    def _byte_bias(self, device: torch.device) -> torch.Tensor:
        """[256, 8] float32: per byte value, 0 for each set bit (lowest first) and -inf for each clear one."""
        if device not in self._bias:
            values = torch.arange(256, dtype=torch.int32)[:, None]
            bits = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool()
            self._bias[device] = torch.where(bits, 0.0, -torch.inf).to(device)
        return self._bias[device]
