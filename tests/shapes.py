"""What the structured-output tests check a reply with: it parses as JSON and validates
against its schema (``jsonschema``, the test dependency)."""

from __future__ import annotations

import json

import jsonschema


def valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
