"""Constraints used by the structured-output tests, each with an independent checker.

Every grammar is bounded (enums, short strings, small numbers), so that even the tiny
random models finish well within max_tokens; the checkers do not use xgrammar.
"""

from __future__ import annotations

import json
import re

import jsonschema

from specmesh.proto.v1 import common_pb2

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "active": {"type": "boolean"},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
    },
    "required": ["name", "active", "kind"],
    "additionalProperties": False,
}
# Long fixed keys: most of the output is forced by the grammar (grammar drafts).
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"enum": ["a1", "b2"]},
        "requested_delivery_window": {"enum": ["morning", "evening"]},
        "gift_wrapping_requested": {"type": "boolean"},
    },
    "required": ["customer_account_identifier", "requested_delivery_window", "gift_wrapping_requested"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ["red apple", "green pear", "blue berry"]
GRAMMAR = 'root ::= "(" num ("+" num)? ("+" num)? ")"\nnum ::= [0-9] | [1-9] [0-9]'
_GRAMMAR_RE = re.compile(r"\((\d|[1-9]\d)(\+(\d|[1-9]\d)){0,2}\)")

CONSTRAINTS = {
    "json_schema": common_pb2.Constraint(json_schema=json.dumps(PERSON_SCHEMA)),
    "regex": common_pb2.Constraint(regex=REGEX),
    "choice": common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=CHOICES)),
    "grammar": common_pb2.Constraint(grammar=GRAMMAR),
    "json_object": common_pb2.Constraint(json_object=True),
}


def valid(kind: str, text: str) -> bool:
    """True when `text` satisfies the constraint `CONSTRAINTS[kind]`."""
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, PERSON_SCHEMA)
        except jsonschema.ValidationError:
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return _GRAMMAR_RE.fullmatch(text) is not None


def valid_order(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), ORDER_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
