"""One tool-call parameter's text → the JSON value its schema asks for (`convert_value`).

The template writes strings raw and every other value as JSON, so a parameter's text is read back by
the types its JSON schema admits: numbers, booleans, null, objects and arrays as JSON (or a Python
literal, which models also write), strings as they are. Nothing here raises on model output: text
that fits no admitted type is returned as the string it is.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _schema_types(schema) -> list[str]:
    """The JSON types a schema admits (`type`, `anyOf`/`oneOf` members, `enum`/`const` values)."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    types = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types += _schema_types(sub)
    for v in list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else []):
        types.append(_json_type(v))
    if not types and "properties" in schema:
        types.append("object")
    if not types and "items" in schema:
        types.append("array")
    return list(dict.fromkeys(types))


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(v), "string")


def convert_value(raw: str, schema) -> Any:
    """One parameter's text → the value its schema asks for.

    Strings stay as written; other types are read as JSON (or a Python literal, which models also
    write). Where a schema admits several types, the non-string readings are tried first (the template
    writes strings raw and everything else as JSON). Text that fits no admitted type comes back as the
    string it is, for the client to judge: no schema, an unknown parameter, or a bad value never fail."""
    types = _schema_types(schema)
    text = raw.strip()
    for t in types:
        if t == "null" and text in ("null", "None"):
            return None
        if t == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if t in ("integer", "number"):
            number = _number(text, integer=(t == "integer"))
            if number is not None:
                return number
        if t in ("object", "array"):
            value = _container(text)
            if isinstance(value, dict if t == "object" else list):
                return value
    return raw


def _number(text: str, integer: bool):
    if _INT.fullmatch(text):
        try:
            return int(text)
        except ValueError:                   # past Python's int-from-text digit limit
            return None
    if not _FLOAT.fullmatch(text):
        return None
    value = float(text)
    if not math.isfinite(value):
        return None
    if integer:
        return int(value) if value.is_integer() else None
    return value


def _container(text: str):
    """JSON, else a Python literal ({'a': 1}, [True, None]: models write those too) — only if the
    result is valid JSON again (no NaN, bytes, sets or tuple keys)."""
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return None
