"""A JSON schema in strict form: an object schema that lists its `properties` and says nothing
about other keys allows no other keys.

JSON Schema's own default allows any undeclared key, and a small model constrained by such a
schema keeps inventing keys until `max_tokens` (its tool call never closes).  OpenAI's strict
mode and the grammar engines other servers use by default close objects the same way.  A
schema keeps its open form where it says so (`additionalProperties`, `patternProperties` or
`unevaluatedProperties` given), and where closing would change what it accepts: an object that
combines `properties` with `allOf`/`anyOf`/`oneOf`/`$ref`, and the members of an `allOf` (each
member's keys would refuse the others').
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_COMBINERS = ("allOf", "anyOf", "oneOf", "$ref")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMAS = (
    "additionalProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")


def strict_schema(schema: Any) -> Any:
    """`schema` with its objects closed (a new value; the argument is not changed)."""
    return _close(schema, in_all_of=False)


def _close(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # true, false, or something the grammar engine will refuse itself
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(value, False) for name, value in out[key].items()}
    for key in _SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], False)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(value, False) for value in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(value, True) for value in out["allOf"]]
    closable = (
        isinstance(out.get("properties"), dict)
        and not in_all_of
        and not any(key in out for key in _OPEN_KEYS + _COMBINERS)
    )
    if closable:
        out["additionalProperties"] = False
    return out
