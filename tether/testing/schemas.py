"""Random JSON schemas from a seed: nested objects, enums, arrays, required fields, integers, numbers,
booleans and strings, for the constrained decoder's tests and benchmark.

Every size is bounded (strings by `maxLength`, arrays by `maxItems`, objects by their properties, which
admit no others, nesting by `max_depth`), so a conforming document always fits a finite token budget.
Numbers are multiples of 1/2 or 1/4, whose fractions end within two digits (and which `jsonschema`
checks exactly, unlike a decimal step such as 0.01 that binary floats cannot divide).
"""

from __future__ import annotations

import random
from typing import Any

WORDS = (
    "name", "id", "count", "tags", "user", "score", "active", "price", "items", "color",
    "size", "owner", "status", "level", "notes", "label", "kind", "rank", "city", "code",
)  # fmt: skip
ENUM_VALUES = ("red", "green", "blue", "small", "large", "on", "off", "alpha", "beta", "gamma")
SCALARS = ("string", "integer", "number", "boolean", "enum")


def random_schema(rng: random.Random, max_depth: int = 2) -> dict[str, Any]:
    """An object schema of 1-4 properties, some required, none beyond those listed."""
    return _object(rng, max_depth)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4))
    properties = {name: _value(rng, depth - 1) for name in names}
    required = sorted(rng.sample(names, rng.randint(1, len(names))))
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = SCALARS + (("object", "array") if depth > 0 else ("array",))
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth)
    if kind == "array":
        item = _object(rng, depth) if depth > 0 and rng.random() < 0.3 else _scalar(rng, rng.choice(SCALARS))
        low = rng.randint(0, 2)
        return {"type": "array", "items": item, "minItems": low, "maxItems": low + rng.randint(0, 3)}
    return _scalar(rng, kind)


def _scalar(rng: random.Random, kind: str) -> dict[str, Any]:
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(1, 16)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        start = rng.uniform(-100, 100)
        return {
            "type": "number",
            "minimum": round(start, 2),
            "maximum": round(start + rng.uniform(1, 500), 2),
            "multipleOf": rng.choice((0.5, 0.25)),
        }
    if kind == "boolean":
        return {"type": "boolean"}
    assert kind == "enum"
    return {"enum": rng.sample(ENUM_VALUES, rng.randint(2, 4))}
