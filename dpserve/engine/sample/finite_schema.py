"""Does a JSON schema admit a finite document? A pure check, run before a constraint compiles.

A schema whose every instance must contain an instance of itself (a required property, the
first items of a non-empty array, or a chain of ``$ref`` s that leads back with no other way
out) has no finite instance: a grammar built from it can only generate until ``max_tokens``
runs out, or, where the grammar library notices, generates nothing. Either way the request
could never end with a document that validates, so it is refused (400) before it runs.

The check is the least fixed point of "some finite instance exists" over the schema's nodes:
every node starts as unknown (no), and a pass marks a node yes when its own keywords allow a
finite instance given what is known of its children, until a pass changes nothing. It is
conservative: keywords it does not model count as satisfiable (the grammar library refuses
what it cannot build, and ``max_tokens`` bounds the rest), so it refuses only schemas that
certainly have no finite instance.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Instance types that are finite by themselves (no nested schema is required of them).
_SCALAR_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})


def finite_document_problem(schema: Any) -> str | None:
    """None when ``schema`` admits some finite JSON document (or that cannot be decided here),
    else why it does not."""
    known: dict[int, bool] = {}
    while True:
        before = sum(known.values())
        finite = _Pass(schema, known).finite(schema)
        if finite:
            return None
        if sum(known.values()) == before:
            return (
                "the JSON schema admits no finite document: every instance must contain "
                "another instance of it (a required property, a required array item or a "
                "$ref that leads back to itself with no other way out)"
            )


class _Pass:
    """One pass over the schema: a node on the current path counts as not (yet) finite."""

    def __init__(self, root: Any, known: dict[int, bool]) -> None:
        self.root = root
        self.known = known  # id(node) -> finite, kept across passes (only ever turns true)
        self.visiting: set[int] = set()

    def finite(self, node: Any) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, Mapping):
            return True  # not a schema this check models
        key = id(node)
        if self.known.get(key) or key in self.visiting:
            return self.known.get(key, False)
        self.visiting.add(key)
        try:
            result = self._own(node) and self._combined(node)
        finally:
            self.visiting.discard(key)
        if result:
            self.known[key] = True
        return result

    def _combined(self, node: Mapping[str, Any]) -> bool:
        reference = node.get("$ref")
        if isinstance(reference, str) and not self.finite(self._resolve(reference)):
            return False
        all_of = node.get("allOf")
        if isinstance(all_of, list) and not all(self.finite(part) for part in all_of):
            return False
        for keyword in ("anyOf", "oneOf"):
            branches = node.get(keyword)
            if (
                isinstance(branches, list)
                and branches
                and not any(self.finite(branch) for branch in branches)
            ):
                return False
        return True

    def _own(self, node: Mapping[str, Any]) -> bool:
        if "enum" in node or "const" in node:
            return True  # literal values: finite (the grammar library checks them)
        types = node.get("type")
        if types is None:
            return True  # no type: JSON Schema admits any scalar (object keywords or not)
        names = [types] if isinstance(types, str) else types if isinstance(types, list) else []
        if not names or any(name in _SCALAR_TYPES for name in names):
            return True
        return ("object" in names and self._object(node)) or (
            "array" in names and self._array(node)
        )

    def _object(self, node: Mapping[str, Any]) -> bool:
        properties = node.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        additional = node.get("additionalProperties", True)
        required = node.get("required")
        for name in required if isinstance(required, list) else []:
            schema = properties.get(name, additional) if isinstance(name, str) else True
            if not self.finite(schema):
                return False
        return True

    def _array(self, node: Mapping[str, Any]) -> bool:
        min_items = node.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return True
        prefix = node.get("prefixItems")
        items = node.get("items", True)
        if isinstance(items, list):  # drafts before 2020-12: items as a list is the prefix
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        needed = prefix[:min_items]
        if not all(self.finite(item) for item in needed):
            return False
        return len(needed) >= min_items or self.finite(items)

    def _resolve(self, reference: str) -> Any:
        """A local reference (``#``, ``#/$defs/x``); any other counts as satisfiable."""
        if not reference.startswith("#"):
            return True
        node: Any = self.root
        for raw in reference[1:].split("/")[1:] if reference != "#" else []:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True  # unresolvable: the grammar library reports it
        return node
