"""Output constraints of a request (SamplingParams.constraint), checked without a tokenizer.

Shared by the router and the target (no torch, no xgrammar here): `constraint_from_proto`
reads the oneof into a `ConstraintSpec`, `constraint_violations` lists what is wrong with it
as (field, problem) pairs, fields named as in SamplingParams (`constraint.json_schema`, ...).
The target compiles valid constraints (services/target/structured/compiler.py), where
problems only a compiler sees (grammar syntax, a regex that admits nothing, a grammar over
the size or time limit) are refused with the same field names.

JSON schemas are checked against the Draft 2020-12 metaschema and against the keywords the
compiler enforces (`SUPPORTED_SCHEMA_KEYWORDS`): a keyword it would silently ignore
(`uniqueItems`, `not`, `if`, ...) is refused, so output that "validates" always validates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specmesh.proto.v1 import common_pb2

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_BYTES = 64 * 1024  # schema, regex or grammar text; choices together
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 32

# Keywords xgrammar's JSON-schema converter turns into grammar rules, plus annotations that
# constrain nothing. `oneOf` is left out: it is compiled like `anyOf`, which admits values
# matching two branches.
SUPPORTED_SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum",
    "const", "anyOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems",
    "maxItems", "minProperties", "maxProperties",
    # annotations
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly",
})
# Keywords whose value is a map of name -> subschema (names are not keywords).
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")
_ANNOTATIONS = ("default", "examples", "enum", "const")  # values, not subschemas


@dataclass(frozen=True)
class ConstraintSpec:
    """One request's constraint: `kind` (one of KINDS) and its text.

    `text` is the schema / regex / grammar as given; for `choice` it is the choices as a
    JSON list; for `json_object` it is "". Equal specs compile to the same grammar (the
    compiled-grammar cache key, with the tokenizer's identity)."""

    kind: str
    text: str

    @property
    def field(self) -> str:
        return f"constraint.{self.kind}"

    def choices(self) -> list[str]:
        return json.loads(self.text) if self.kind == "choice" else []


def constraint_from_proto(params: common_pb2.SamplingParams) -> ConstraintSpec | None:
    """The request's constraint, or None when it has none."""
    if not params.HasField("constraint"):
        return None
    c = params.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return ConstraintSpec(kind, "") if c.json_object else None
    if kind == "choice":
        return ConstraintSpec(kind, json.dumps(list(c.choice.choices)))
    return ConstraintSpec(kind, getattr(c, kind))


def constraint_violations(spec: ConstraintSpec | None) -> list[tuple[str, str]]:
    """(field, problem) pairs for a constraint (empty when it may be compiled)."""
    if spec is None:
        return []
    field = spec.field
    size = len(spec.text.encode())
    if size > MAX_CONSTRAINT_BYTES:
        return [(field, f"{spec.kind} is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")]
    if spec.kind == "json_schema":
        return [(field, message) for message in schema_problems(spec.text)]
    if spec.kind == "choice":
        choices = spec.choices()
        if not choices:
            return [(field, "choice needs at least one string")]
        if len(choices) > MAX_CHOICES:
            return [(field, f"{len(choices)} choices; the limit is {MAX_CHOICES}")]
        if any(c == "" for c in choices):
            return [(field, "choices must not be empty strings")]
    if spec.kind in ("regex", "grammar") and not spec.text.strip():
        return [(field, f"{spec.kind} is empty")]
    return []  # regex and grammar syntax: the target's compiler reads them (its dialect, not Python's)


def schema_problems(text: str) -> list[str]:
    """Why a JSON schema text cannot be used (empty when it can)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        return [f"invalid schema: not JSON ({exc})"]
    if not isinstance(schema, (dict, bool)):
        return [f"invalid schema: a schema is an object or a boolean, got {type(schema).__name__}"]
    import jsonschema  # imported here: the router loads it only for requests with a schema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.path)
        return [f"invalid schema at {where}: {exc.message}"]
    problems: list[str] = []
    _check_keywords(schema, "", 0, problems)
    return problems


def _check_keywords(schema, where: str, depth: int, problems: list[str]) -> None:
    if not isinstance(schema, dict) or len(problems) >= 8:
        return
    if depth > MAX_SCHEMA_DEPTH:
        problems.append(f"schema nests deeper than {MAX_SCHEMA_DEPTH} levels at {where or '/'}")
        return
    for key, value in schema.items():
        if key not in SUPPORTED_SCHEMA_KEYWORDS:
            problems.append(f"unsupported keyword {key!r} at {where or '/'}: the constraint "
                            f"compiler would not enforce it")
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _check_keywords(sub, f"{where}/{key}/{name}", depth + 1, problems)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _check_keywords(sub, f"{where}/{key}/{i}", depth + 1, problems)
        elif key in _SCHEMA_VALUES:
            _check_keywords(value, f"{where}/{key}", depth + 1, problems)
