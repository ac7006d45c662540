"""Pydantic JSON Schema -> Kubernetes structural schema.

The API server accepts only *structural* OpenAPI v3 schemas: every node has a
``type``, no ``$ref``, no ``anyOf`` that introduces types, no ``null`` defaults.
Pydantic emits references into ``$defs``, ``anyOf: [X, null]`` for optionals and
titles everywhere. This module inlines the references, folds optionals into
"not required", drops titles, and keeps what the API server understands
(descriptions, defaults, bounds, enums, patterns and the ``x-kubernetes-*``
extensions the models declare). Nested objects whose fields all have defaults
get ``default: {}`` so the API server fills them in, as it would a scalar.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

_DROP = {"title", "$defs"}


def structural(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of ``model`` (camelCase, by alias)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    return _convert(raw, defs)


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline a ``$ref``, letting keys beside it (description, rules) override the target's."""
    if "$ref" not in node:
        return node
    target: dict[str, Any] = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
    siblings = {k: v for k, v in node.items() if k != "$ref"}
    rules = target.pop("x-kubernetes-validations", []) + siblings.pop("x-kubernetes-validations", [])
    target.update(siblings)
    if rules:
        target["x-kubernetes-validations"] = rules
    return target


def _unwrap_optional(node: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {type: null}]`` -> X with the outer keys (description, default) kept."""
    options = node.get("anyOf")
    if not options:
        return node
    kept = [o for o in options if o.get("type") != "null"]
    if len(kept) != 1:
        raise ValueError(f"schema has a union of {len(kept)} types, not structural: {node}")
    out = {**kept[0], **{k: v for k, v in node.items() if k != "anyOf"}}
    return out


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _unwrap_optional(_resolve(node, defs))
    node = _unwrap_optional(_resolve(node, defs))
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "default" and value is None:
            continue
        if key == "properties":
            out[key] = {name: _convert(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs) if isinstance(value, dict) else value
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = _convert(value, defs)
        elif key == "additionalProperties" and value is False:
            continue  # structural schemas prune unknown fields by default
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("type") == "object" and "properties" in out:
        _default_empty_objects(out)
    return out


def _default_empty_objects(obj: dict[str, Any]) -> None:
    """Give optional object properties whose own fields are all optional ``default: {}``."""
    required = set(obj.get("required", []))
    for name, prop in obj["properties"].items():
        if name in required or prop.get("type") != "object" or "properties" not in prop:
            continue
        if not prop.get("required"):
            prop.setdefault("default", {})
