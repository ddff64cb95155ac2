"""JSON-schema walks that need no grammar engine: OpenAI's strict mode, and `$ref` cycles that write nothing.

Role: `strict_schema` closes every object schema that does not say otherwise (tools/plan.py uses it
for a strict tool's parameters too); `check_ref_cycles` refuses a schema whose local references lead
back to themselves before any output is written, with the chain, instead of a grammar engine's
opaque failure. Both are pure: the schema given is never modified.
"""

from __future__ import annotations

from typing import Any

from .backend import GrammarError

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


# Keywords whose subschemas describe the same JSON value (no token is written between them and their parent).
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE = ("not", "if", "then", "else")


def check_ref_cycles(schema: dict[str, Any]) -> None:
    """GrammarError naming the chain when a local `$ref` leads back to itself without writing anything first
    (`{"$ref": "#/$defs/a"}` with `a` = `{"$ref": "#/$defs/a"}`): such a schema describes no finite JSON.
    Recursion through properties or items (a tree) is fine: each level writes output."""

    def resolve(pointer: str) -> Any:
        node: Any = schema
        for part in pointer.lstrip("#").strip("/").split("/") if pointer not in ("#", "#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def refs_in_place(node: Any) -> list[str]:
        if not isinstance(node, dict):
            return []
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") else []
        for key in _IN_PLACE_LISTS:
            subs = node.get(key)
            for sub in subs if isinstance(subs, list) else []:
                found += refs_in_place(sub)
        for key in _IN_PLACE:
            found += refs_in_place(node.get(key))
        return found

    def visit(ref: str, chain: list[str]) -> None:
        if ref in chain:
            cycle = " -> ".join([*chain[chain.index(ref) :], ref])
            raise GrammarError(f"$ref cycle that writes nothing before repeating: {cycle}")
        if len(chain) > 64:
            return
        for nxt in refs_in_place(resolve(ref)):
            visit(nxt, [*chain, ref])

    for start in refs_in_place(schema):
        visit(start, [])


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: every object schema that does not say otherwise admits no undeclared keys."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict | list):
            out[key] = strict_schema(out[key])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (is_object or "properties" in out) and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
