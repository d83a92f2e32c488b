"""What every API body shares: strict request models, JSON integers, text that both
databases can store, and the one error body."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)
from typing_extensions import TypeAliasType

DocumentStatus = Literal["pending", "processing", "done", "failed", "forgetting", "forgotten"]


class Strict(BaseModel):
    """A request body: unknown fields refused, and no lax coercion (``0`` is not
    ``false``, ``"5"`` is not ``5``): what the OpenAPI says is what the server takes."""

    model_config = ConfigDict(extra="forbid", strict=True)


def whole_number(v: Any) -> Any:
    # JSON Schema counts 5.0 as an integer and clients may send one; strict mode would
    # refuse it, so a float without a fractional part becomes an int first.
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


# An integer as JSON Schema means it: 5 and 5.0, never "5" or true.
JsonInt = Annotated[int, BeforeValidator(whole_number)]

# What PostgreSQL can store in text (check_storable): no NUL. Lone surrogates are refused
# too, but a schema string is Unicode text, which has none. Only the schema carries the
# pattern: the validators below say in words what is wrong.
NO_NUL = r"^[^\x00]*$"
# The characters str.isspace() (hence str.strip()) treats as white space, spelt out:
# the \s of ECMA-262 regexes (OpenAPI's dialect) is not the same set as Python's.
SPACE = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# A document's text: no NUL, and at least one character that is not white space.
TEXT_PATTERN = rf"^[^\x00]*[^\x00{SPACE}][^\x00]*$"
StoredStr = Annotated[str, WithJsonSchema({"type": "string", "pattern": NO_NUL})]


def no_nul(*names: str) -> Callable[[dict[str, Any]], None]:
    """A model's ``json_schema_extra``: these string properties (or their string branch,
    when nullable) get the NO_NUL pattern."""

    def extra(schema: dict[str, Any]) -> None:
        for name in names:
            prop = schema["properties"][name]
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") == "string":
                    branch["pattern"] = NO_NUL

    return extra


# Any JSON value that can be stored as-is (metadata): strings and keys without NUL.
StoredObject = Annotated[
    dict[str, "StoredJson"], Field(json_schema_extra={"propertyNames": {"pattern": NO_NUL}})
]
StoredJson = TypeAliasType(
    "StoredJson", "StoredObject | list[StoredJson] | StoredStr | int | float | bool | None"
)


class ErrorOut(BaseModel):
    """The body of every error answer, whatever its status."""

    model_config = ConfigDict(extra="forbid")

    error: str = Field(
        description="a stable code: bad_request (400), unauthorized (401), not_found (404), "
        "method_not_allowed (405), conflict (409), payload_too_large (413), "
        "validation_error or invalid_input (422), overloaded (429), internal_error (500), "
        "unavailable (503)",
        examples=["validation_error"],
    )
    detail: str = Field(
        description="a message for people; for validation_error, one `location: problem` "
        "clause per problem, joined by '; ' (locations are dotted paths into the body, "
        "e.g. documents.0.text, or the name of a path parameter)",
        examples=["documents.0.text: String should have at least 1 character"],
    )


def check_storable(value: Any, where: str) -> None:
    """Raise ValueError when ``value`` (a JSON value) cannot be stored as-is in both
    databases: PostgreSQL refuses NUL in text and jsonb, a lone surrogate ("\\ud800") is
    not UTF-8, and JSON columns have no NaN or Infinity."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where} contains a NUL character (U+0000), which cannot be stored")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{where} contains a lone surrogate; it is not valid Unicode"
            ) from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}; only finite numbers can be stored")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_storable(k, f"{where} key")
            check_storable(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_storable(v, f"{where}.{i}")
