"""Structured output (`structured/<kind>`): read a generated description, answer with JSON that matches
a given schema and carries the right values.

Scored with `jsonschema` (Draft 2020-12, `additionalProperties: false` everywhere, formats checked)
and a field-by-field comparison with the record the description was generated from. The answer must be
one JSON object: duplicate keys, NaN and Infinity are refused rather than silently resolved.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from jsonschema import Draft202012Validator  # type: ignore[import-untyped,unused-ignore]

from tether.envs.episode import Environment
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry
from tether.envs.rubric import format_followed, hedged
from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Problem, Task

SYSTEM = (
    "You convert descriptions into JSON. Answer with one JSON object that validates against the given "
    "JSON schema, with no extra keys and values taken from the description. " + ANSWER_TAG.instructions
)
FIRST = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Novak", "Haddad", "Kowalski", "Reyes", "Berg"]
CITIES = ["Lagos", "Oslo", "Lyon", "Osaka", "Recife", "Brno", "Beirut", "Gdansk", "Quito", "Perth"]
TAGS = ["beta", "vip", "newsletter", "partner", "trial", "staff", "alumni", "donor"]
CATEGORIES = ["garden", "kitchen", "outdoor", "office", "toys", "audio", "lighting", "storage"]
NOUNS = ["lamp", "kettle", "bench", "speaker", "planter", "shelf", "drone", "blender"]
STATUSES = ["pending", "paid", "shipped", "delivered", "cancelled"]
EVENTS = ["workshop", "meetup", "conference", "hackathon", "webinar", "retreat"]

Record = dict[str, Any]


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def person(rng: random.Random) -> tuple[Record, dict[str, Any], list[str]]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    record: Record = {
        "name": f"{first} {last}",
        "age": rng.randint(18, 90),
        "email": f"{first.lower()}.{last.lower()}{rng.randint(1, 99)}@example.org",
        "city": rng.choice(CITIES),
        "member": rng.random() < 0.5,
        "tags": sorted(rng.sample(TAGS, rng.randint(0, 3))),
    }
    schema = _object(
        {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string", "format": "email"},
            "city": {"type": "string", "enum": CITIES},
            "member": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        }
    )
    tags = ", ".join(record["tags"]) if record["tags"] else "none"
    facts = [
        f"{record['name']} is {record['age']} years old and lives in {record['city']}.",
        f"Their email address is {record['email']}.",
        f"They are {'a member' if record['member'] else 'not a member'} of the club.",
        f"Tags on their profile (sorted alphabetically): {tags}.",
    ]
    return record, schema, facts


def product(rng: random.Random) -> tuple[Record, dict[str, Any], list[str]]:
    noun = rng.choice(NOUNS)
    record: Record = {
        "sku": f"{noun[:3].upper()}-{rng.randint(1000, 9999)}",
        "name": f"{rng.choice(['Nordic', 'Compact', 'Deluxe', 'Solar', 'Classic'])} {noun}",
        "price": rng.randint(100, 99999) / 100,
        "in_stock": rng.random() < 0.6,
        "categories": sorted(rng.sample(CATEGORIES, rng.randint(1, 3))),
        "dimensions": {"width_cm": rng.randint(5, 200), "height_cm": rng.randint(5, 200)},
    }
    schema = _object(
        {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "name": {"type": "string"},
            "price": {"type": "number", "exclusiveMinimum": 0},
            "in_stock": {"type": "boolean"},
            "categories": {"type": "array", "items": {"type": "string", "enum": CATEGORIES}, "minItems": 1},
            "dimensions": _object({"width_cm": {"type": "integer"}, "height_cm": {"type": "integer"}}),
        }
    )
    dims = record["dimensions"]
    facts = [
        f"The {record['name']} (SKU {record['sku']}) sells for {record['price']:.2f} dollars.",
        f"It is {'in stock' if record['in_stock'] else 'out of stock'}.",
        f"It is listed under these categories, in alphabetical order: {', '.join(record['categories'])}.",
        f"It measures {dims['width_cm']} cm wide and {dims['height_cm']} cm high.",
    ]
    return record, schema, facts


def order(rng: random.Random) -> tuple[Record, dict[str, Any], list[str]]:
    items = [
        {"sku": f"{rng.choice(NOUNS)[:3].upper()}-{rng.randint(1000, 9999)}", "quantity": rng.randint(1, 9)}
        for _ in range(rng.randint(1, 4))
    ]
    record: Record = {
        "order_id": rng.randint(10000, 99999),
        "customer": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
        "status": rng.choice(STATUSES),
        "items": items,
        "total": rng.randint(500, 500000) / 100,
    }
    schema = _object(
        {
            "order_id": {"type": "integer"},
            "customer": {"type": "string"},
            "status": {"type": "string", "enum": STATUSES},
            "items": {
                "type": "array",
                "minItems": 1,
                "items": _object({"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}}),
            },
            "total": {"type": "number"},
        }
    )
    lines = "; ".join(f"{item['quantity']} x {item['sku']}" for item in items)
    facts = [
        f"Order number {record['order_id']} was placed by {record['customer']}.",
        f"Its status is {record['status']}.",
        f"It contains, in this order: {lines}.",
        f"The order total is {record['total']:.2f}.",
    ]
    return record, schema, facts


def event(rng: random.Random) -> tuple[Record, dict[str, Any], list[str]]:
    kind = rng.choice(EVENTS)
    record: Record = {
        "title": f"{rng.choice(CITIES)} {kind} {rng.randint(2020, 2030)}",
        "date": f"{rng.randint(2020, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        "attendees": rng.randint(5, 5000),
        "online": rng.random() < 0.4,
        "organizer": {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "city": rng.choice(CITIES)},
    }
    schema = _object(
        {
            "title": {"type": "string"},
            "date": {"type": "string", "format": "date"},
            "attendees": {"type": "integer", "minimum": 0},
            "online": {"type": "boolean"},
            "organizer": _object({"name": {"type": "string"}, "city": {"type": "string", "enum": CITIES}}),
        }
    )
    facts = [
        f"The {record['title']} takes place on {record['date']} (ISO date).",
        f"{record['attendees']} people are expected, {'online' if record['online'] else 'in person'}.",
        f"It is organised by {record['organizer']['name']} from {record['organizer']['city']}.",
    ]
    return record, schema, facts


KINDS: dict[str, Callable[[random.Random], tuple[Record, dict[str, Any], list[str]]]] = {
    "person": person,
    "product": product,
    "order": order,
    "event": event,
}


@dataclass(frozen=True, slots=True)
class StructuredSource:
    kind: str

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        record, schema, facts = KINDS[self.kind](rng)
        rng.shuffle(facts)
        prompt = "Description:\n" + " ".join(facts) + "\n\nJSON schema:\n" + json.dumps(schema)
        return Problem(prompt=prompt, answer=json.dumps(record), data={"schema": schema, "record": record})


def _reject(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys in {keys}")
    return dict(pairs)


def load_object(text: str) -> dict[str, Any] | None:
    """The answer as a JSON object, or None if it is anything else."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject)
    except ValueError:  # JSONDecodeError is a ValueError, as are duplicate keys and NaN
        return None
    return value if isinstance(value, dict) else None


def same(expected: Any, actual: Any) -> bool:
    """Equal as JSON values; booleans are not numbers, and 3 equals 3.0 for a `number` field."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    if isinstance(expected, int | float) and isinstance(actual, int | float):
        return abs(expected - actual) <= 1e-9 * max(1.0, abs(expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return expected.keys() == actual.keys() and all(same(expected[k], actual[k]) for k in expected)
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(same(e, a) for e, a in zip(expected, actual, strict=True))
    return type(expected) is type(actual) and expected == actual


def _answer(inp: RewardInput) -> dict[str, Any] | None:
    return None if inp.parsed.answer is None else load_object(inp.parsed.answer)


def schema_valid(inp: RewardInput) -> float:
    answer = _answer(inp)
    if answer is None:
        return 0.0
    validator = Draft202012Validator(
        inp.task.data["schema"], format_checker=Draft202012Validator.FORMAT_CHECKER
    )
    return 1.0 if validator.is_valid(answer) else 0.0


def fields_correct(inp: RewardInput) -> float:
    """The share of the record's top-level fields the answer got exactly right."""
    answer, record = _answer(inp), inp.task.data["record"]
    if answer is None:
        return 0.0
    return sum(same(value, answer.get(key)) for key, value in record.items()) / len(record)


def correctness(inp: RewardInput) -> float:
    answer = _answer(inp)
    if answer is None:
        return 0.0
    return 1.0 if schema_valid(inp) == 1.0 and same(inp.task.data["record"], answer) else 0.0


def _adversarial(task: Task) -> list[str]:
    record = json.loads(task.reference)
    first = next(iter(record))
    wrong_type = {**record, first: [record[first]]}
    extra = {**record, "note": "extra"}
    missing = {key: value for key, value in record.items() if key != first}
    duplicate = task.reference[:-1] + f", {json.dumps(first)}: {json.dumps(record[first])}}}"
    return [
        hedged(ANSWER_TAG, task.reference),
        ANSWER_TAG.format(json.dumps(wrong_type)),
        ANSWER_TAG.format(json.dumps(extra)),
        ANSWER_TAG.format(json.dumps(missing)),
        ANSWER_TAG.format(duplicate),
        ANSWER_TAG.format(json.dumps([record])),
        ANSWER_TAG.format(json.dumps(json.dumps(record))),
    ]


def structured_environment(kind: str) -> Environment:
    return Environment(
        name=f"structured/{kind}",
        source=StructuredSource(kind),
        renderer=ChatRenderer(SYSTEM),
        parser=ANSWER_TAG,
        rubric=Rubric(
            (
                Reward("correctness", correctness, 0.7, gate=True),
                Reward("schema", schema_valid, 0.1),
                Reward("fields", fields_correct, 0.1),
                Reward("format", format_followed, 0.1),
            )
        ),
        description=f"JSON for a generated {kind} description, checked by schema and field values",
        adversarial=_adversarial,
    )


def register(registry: EnvRegistry) -> None:
    for kind in KINDS:
        registry.register(f"structured/{kind}", partial(structured_environment, kind), source=__name__)
