"""JSON schemas of varied shape for the structured-output tests: nested objects, arrays with bounds,
enums, bounded integers, strings with lengths, nulls; a fifth of them top-level arrays. Seeded, so
every run (and every test module) sees the same ones."""

from __future__ import annotations

import random


def _leaf(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object", "bounded", "null"]
                      if depth < 2 else ["string", "integer", "number", "boolean", "enum"])
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "north", "south", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "bounded":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "array":
        out = {"type": "array", "items": _leaf(rng, depth + 1)}
        if rng.random() < 0.5:
            out["minItems"] = rng.randint(1, 2)
        if rng.random() < 0.5:
            out["maxItems"] = out.get("minItems", 0) + rng.randint(0, 3)
        return out
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "string" and rng.random() < 0.3:
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 12)}
    return {"type": kind}


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["name", "age", "city", "score", "tags", "ok", "items", "id", "meta", "kind"], rng.randint(1, 4))
    props = {n: _leaf(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def generated_schemas(n=20, seed=26):
    rng = random.Random(seed)
    schemas = []
    for k in range(n):
        if k % 5 == 4:                           # some top-level arrays
            schemas.append({"type": "array", "items": _object(rng, 1), "maxItems": 3})
        else:
            schemas.append(_object(rng, 0))
    return schemas
