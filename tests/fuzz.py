"""Hypothesis strategies for fuzzing JSON routes: lone UTF-16 surrogates, deep nesting, wrong types.

Each server's property test takes a valid example body for a route and lets these strategies break it;
the property is always the same: the answer is a 2xx or a 4xx with a JSON error, never a 5xx or a hang.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Every code point, lone surrogates included (hypothesis leaves category Cs out unless asked).
any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=40)
surrogate_text = st.builds(
    lambda before, surrogate, after: before + surrogate + after,
    st.text(max_size=8),
    st.characters(categories=["Cs"]),
    st.text(max_size=8),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    any_text,
    surrogate_text,
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(any_text, children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated_bodies(draw: st.DrawFn, example: dict[str, Any]) -> dict[str, Any]:
    """`example` with some fields replaced by arbitrary JSON, some dropped and some unknown ones added."""
    body = dict(example)
    for key in draw(st.lists(st.sampled_from(sorted(example)), max_size=len(example), unique=True)):
        if draw(st.booleans()):
            body[key] = draw(json_values)
        else:
            del body[key]
    if draw(st.booleans()):
        body[draw(any_text)] = draw(json_values)
    return body


def encode(body: Any) -> bytes:
    """JSON as a client would send it: lone surrogates travel as `\\udXXX` escapes, which is valid JSON."""
    return json.dumps(body, ensure_ascii=True).encode()


def deeply_nested(depth: int = 100_000) -> bytes:
    """A body that exhausts a recursive parser or validator: `depth` nested arrays."""
    return b"[" * depth + b"]" * depth


def assert_client_error_or_success(status: int, body: bytes, *, route: str) -> None:
    """The fuzz property: no 5xx, and a refusal is a JSON document that says what was wrong."""
    assert status < 500, f"{route} answered {status}: {body[:500]!r}"
    if status >= 400:
        assert json.loads(body), f"{route} answered {status} with an empty error"
