"""The JSON schema set of the structured-output tests and benchmark (``benchmarks/structured_outputs.py``,
``tests/workers/test_structured_smollm2.py``): nested objects, arrays with min/max items, enums,
bounded numbers, string patterns, optional fields and ``$ref``. Strings carry a ``maxLength`` and
arrays a ``maxItems`` so that a small model finishes them within the tests' ``max_tokens``."""

from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "boolean": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
        },
        "required": ["kind", "x"],
        "additionalProperties": False,
    },
    "bounded_integer": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    },
    "exclusive_bounds": {
        "type": "object",
        "properties": {"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}},
        "required": ["n"],
        "additionalProperties": False,
    },
    "bounded_number": {
        "type": "object",
        "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["p"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
        "additionalProperties": False,
    },
    "date_pattern": {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3},
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "integer_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum_array": {
        "type": "array",
        "items": {"enum": ["a", "b", "c"]},
        "minItems": 1,
        "maxItems": 3,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": _NAME,
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                },
                "required": ["name", "id"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "deeply_nested": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": _NAME,
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": _NAME,
            "subtitle": _NAME,
            "pages": {"type": "integer", "minimum": 1, "maximum": 500},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"middle": {"anyOf": [_NAME, {"type": "null"}]}},
        "required": ["middle"],
        "additionalProperties": False,
    },
    "one_of_types": {
        "type": "object",
        "properties": {
            "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}
        },
        "required": ["v"],
        "additionalProperties": False,
    },
    "ref": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "ref_array": {
        "type": "object",
        "definitions": {"tag": {"type": "string", "enum": ["x", "y", "z"]}},
        "properties": {
            "tags": {
                "type": "array",
                "items": {"$ref": "#/definitions/tag"},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "string_length": {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "mixed": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "status": {"enum": ["open", "closed"]},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "labels": {"type": "array", "items": {"enum": ["bug", "ui"]}, "maxItems": 2},
        },
        "required": ["id", "status", "labels"],
        "additionalProperties": False,
    },
}
