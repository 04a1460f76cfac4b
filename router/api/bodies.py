"""Admin request bodies: declared as pydantic models, parsed by one helper into a 400 that lists every problem.

A body model refuses unknown fields and takes JSON values as they are (strict: no "5" for 5, no 1 for true).
Each field type names what it must be in its `description`; the 400's message is built from those words
(`mode must be one of drain, abort, got 'kill'`), not from pydantic's own, so the text stays the router's:
`{"error": {"message": "invalid NAME request: p1; p2", "type", "code", "param", "problems": [p1, p2]}}`.
Admin paths are not hot: a model costs microseconds, the request path never uses one.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from router.api.access import JSON_BODY
from router.core.worker_url import worker_url_problem
from router.core.errors import BadRequest, parse_json_object

VALUE_SHOWN = 300  # characters of a refused value quoted back in a problem

BodyModel = TypeVar("BodyModel", bound="Body")


class Body(BaseModel):
    """An admin request body. A pass-through field that defaults to None (a value JSON cannot give it: its
    type refuses null) means "not given": it is not forwarded, and the server's own default applies."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def given(self, *, exclude: frozenset[str] = frozenset()) -> dict:
        """The fields the client sent, as sent (defaults left out)."""
        return self.model_dump(include=self.model_fields_set - exclude)


# ---- field types: each says in its description what a value must be --------------------------------------
def one_of(values) -> str:
    return f"one of {', '.join(values)}"


def _worker_url(value: str) -> str:
    if (problem := worker_url_problem(value)) is not None:
        raise ValueError(problem)
    return value


Text = Annotated[str, Field(description="a string")]
OptionalText = Annotated[str | None, Field(description="a string or null")]
Texts = Annotated[list[str], Field(description="a list of strings")]
OptionalTexts = Annotated[list[str] | None, Field(description="a list of strings or null")]
Flag = Annotated[bool, Field(description="true or false")]
Integer = Annotated[int, Field(description="an integer")]
PositiveNumber = Annotated[float, Field(gt=0, description="a positive number")]
NonNegativeNumber = Annotated[float, Field(ge=0, description="a non-negative number")]
PositiveIntegers = Annotated[list[Annotated[int, Field(gt=0)]],
                             Field(min_length=1, description="a non-empty list of positive integers")]
Port = Annotated[int, Field(ge=1, le=65535, description="an integer in 1..65535")]
JsonObject = Annotated[dict[str, Any], Field(description="a JSON object")]
OptionalJsonObject = Annotated[dict[str, Any] | None, Field(description="a JSON object or null")]
WorkerUrl = Annotated[str, AfterValidator(_worker_url), Field(description="a worker url (http://host:port)")]


class Empty(Body):
    """An endpoint that takes no field (an empty object or no body at all)."""


# ---- reading and parsing ---------------------------------------------------------------------------------
async def read_json_object(request: web.Request) -> dict:
    """The request's JSON object; no body at all reads as {}."""
    if (parsed := request.get(JSON_BODY)) is not None:  # already checked by the access middleware
        return parsed
    raw = await request.read()
    return parse_json_object(raw) if raw.strip() else {}


async def read_body(request: web.Request, model: type[BodyModel], name: str) -> BodyModel:
    return parse_body(model, await read_json_object(request), name)


def parse_body(model: type[BodyModel], body: dict, name: str) -> BodyModel:
    """The body as `model`, or BadRequest naming every problem: unknown fields, missing ones, then the rest
    in the order the client wrote them."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        unknown, found = [], {}
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else None
            if error["type"] == "extra_forbidden":
                unknown.append(field)
            elif field not in found:  # one problem a field: `shapes`, not each of its bad elements
                found[field] = _problem(model, field, error, body)
        written = list(body)
        fields = sorted(found, key=lambda f: written.index(f) if f in written else -1)
        problems = [found[f] for f in fields]
        if unknown:
            unknown.sort()
            problems.insert(0, f"unknown field(s) {', '.join(unknown)} "
                               f"(accepted: {', '.join(sorted(model.model_fields)) or 'none'})")
        param = unknown[0] if unknown else next((f for f in fields if f is not None), None)
        raise BadRequest(f"invalid {name} request: " + "; ".join(problems), param=param,
                         problems=problems) from None


def _problem(model: type[Body], field: str | None, error: dict, body: dict) -> str:
    if field is None:  # a rule across fields
        return error["msg"]
    if error["type"] == "missing":
        return f"{field} is required"
    if error["type"] == "value_error":  # a field type's own check (a worker url): its message says why
        return f"{field}: {error['ctx']['error']}"
    what = model.model_fields[field].description or error["msg"].lower()
    return f"{field} must be {what}, got {body.get(field)!r}"[:VALUE_SHOWN]
