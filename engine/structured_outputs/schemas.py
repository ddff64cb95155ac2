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
        for nxt in refs_in_place(_resolve(schema, ref)):
            visit(nxt, [*chain, ref])

    for start in refs_in_place(schema):
        visit(start, [])


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: every object schema that does not say otherwise admits no undeclared keys.

    Except the parts of an `allOf`: each branch declares only some of the keys of the one object they
    describe together, so closing a branch (or the definition a branch refers to, or the object holding
    the `allOf`) would refuse the other branches' keys and make the schema unsatisfiable."""
    merged_refs: set[str] = set()
    _collect_all_of_refs(schema, merged_refs)
    return _strict(schema, True, merged_refs, "#", schema)


def _strict(schema: Any, close: bool, merged_refs: set[str], pointer: str, root: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(item, close, merged_refs, pointer, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(sub, key != "allOf", merged_refs, pointer, root) for sub in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(sub, f"{pointer}/{key}/{name}" not in merged_refs or key == "properties",
                                      merged_refs, f"{pointer}/{key}/{name}", root)
                        for name, sub in out[key].items()}  # fmt: skip
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict | list):
            out[key] = _strict(out[key], True, merged_refs, pointer, root)
    closable = close and "additionalProperties" not in out and "patternProperties" not in out
    if closable and "allOf" in out:
        # The holder of an allOf is closed over the union of its branches' keys (listed as `true`, so only
        # the branches constrain their values): the same object, no key the schema does not name.
        keys = _declared_keys(out, root, 0)
        if keys is not None:
            out["properties"] = {**dict.fromkeys(sorted(keys), True), **out.get("properties", {})}
            out["additionalProperties"] = False
        return out
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (is_object or "properties" in out) and closable:
        out["additionalProperties"] = False
    return out


def _declared_keys(node: Any, root: Any, depth: int) -> set[str] | None:
    """Every key an object schema and its allOf branches (local $refs followed) declare; None when that is
    not knowable from the schema alone (pattern or open additional properties, alternatives, remote refs)."""
    if depth > 32 or not isinstance(node, dict):
        return None
    if isinstance(node.get("$ref"), str):
        target = _resolve(root, node["$ref"])
        return None if target is None else _declared_keys(target, root, depth + 1)
    if any(k in node for k in ("patternProperties", "anyOf", "oneOf")) or node.get("additionalProperties") not in (
        None,
        False,
    ):
        return None
    keys = set(node.get("properties") or {})
    for branch in node.get("allOf") or []:
        found = _declared_keys(branch, root, depth + 1)
        if found is None:
            return None
        keys |= found
    return keys


def _resolve(root: Any, pointer: str) -> Any:
    """The schema a local `$ref` points at (None if it is not local or leads nowhere)."""
    if not pointer.startswith("#"):
        return None
    node = root
    for part in [p for p in pointer[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _collect_all_of_refs(node: Any, found: set[str]) -> None:
    """The local `$ref`s that are branches of an `allOf` (their definitions stay open under strict)."""
    if isinstance(node, list):
        for item in node:
            _collect_all_of_refs(item, found)
    elif isinstance(node, dict):
        branches = node.get("allOf")
        for branch in branches if isinstance(branches, list) else []:
            if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                found.add(branch["$ref"].rstrip("/"))
        for value in node.values():
            _collect_all_of_refs(value, found)
