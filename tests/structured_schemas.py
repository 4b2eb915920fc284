"""Varied JSON schemas for the structured-output tests (tests/test_structured.py and
tests/test_serve_structured.py): objects with nested objects and arrays, enums, number ranges,
required and optional fields, built from a seed. Strings and arrays are bounded so that a short
generation can finish them (and numbers, with `multipleOf`)."""

from __future__ import annotations

import random
from typing import Any

_NAMES = ["name", "city", "color", "title", "kind", "owner", "label", "status", "tag", "code", "size", "level"]
_WORDS = ["red", "green", "blue", "small", "large", "on", "off", "cat", "dog", "alpha", "beta"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "enum", "integer", "number", "boolean", "const"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 12)}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.randint(0, 10)
        # multipleOf bounds the digits: a small model may otherwise write decimals until max_tokens
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20), "multipleOf": 0.5}
    if kind == "const":
        return {"const": rng.choice(_WORDS)}
    return {"type": "boolean"}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    pick = rng.random()
    if depth < 2 and pick < 0.2:
        return random_schema(rng, depth + 1)
    if depth < 2 and pick < 0.35:
        return {"type": "array", "items": _leaf(rng), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-4 properties, some required, no additional properties."""
    names = rng.sample(_NAMES, rng.randint(1, 4 if depth == 0 else 2))
    props = {n: _value(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
