"""The configuration model's base: pydantic v2 validation for every config, frozen, unknown keys refused, every
problem reported at once in the flags' own words.

A config is built as given and checked in that same pass: `problems()` lists what is wrong, `validated()` returns
the config or raises `ConfigError` with all of it. Only an unknown key is refused at once (a misspelt knob would
otherwise be dropped unseen). An invalid config is kept until `validated()` so that the command line can report
its own problems (a bad flag, an unknown policy) and the config's in one message.

Rules are pydantic validators: a one-value rule is `Annotated[type, rule(ok, problem)]` beside its field; a rule
over several fields is a field validator on the last of them, reading the earlier ones from `info.data` (pydantic
runs every field's validators even when another field failed, so every problem is found in one pass; a rule
skips what an earlier field's failure left unknown). `refuse` raises a rule's problems as written; `checked_by`
makes a rule of a function that lists them.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Self

from pydantic import (AfterValidator, BaseModel, ConfigDict, PrivateAttr, ValidationError, ValidationInfo,
                      field_validator)
from pydantic_core import PydanticCustomError

# The pydantic error type of a rule's problems (its context holds them, each written to name its flag).
_PROBLEMS = "config_problems"
# A field that failed its own rules is missing from `info.data`: rules over it say nothing.
FAILED = object()


class ConfigError(ValueError):
    """Every problem found, reported at once."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def refuse(*problems: str) -> NoReturn:
    """Fail the validator this is raised from with `problems`, reported as written."""
    raise PydanticCustomError(_PROBLEMS, "{problems}", {"problems": list(problems)})


def rule(ok: Callable[[Any], bool], problem: str) -> AfterValidator:
    """A one-value rule: `problem` (a format string of `value`) when `ok(value)` is false."""

    def check(value: Any) -> Any:
        if not ok(value):
            refuse(problem.format(value=value))
        return value

    return AfterValidator(check)


def checked_by(problems_of: Callable[[Any], list[str]]) -> AfterValidator:
    """A one-value rule that may find several problems (one per bad entry of a list): `problems_of(value)`."""

    def check(value: Any) -> Any:
        if found := problems_of(value):
            refuse(*found)
        return value

    return AfterValidator(check)


def earlier(info: ValidationInfo, name: str) -> Any:
    """An earlier field's validated value, or FAILED when it failed its own rules."""
    return info.data.get(name, FAILED)


def describe(error: ValidationError) -> list[str]:
    """A pydantic error as problems: a rule's as it wrote them, pydantic's own (a wrong type) naming the field."""
    found: list[str] = []
    wrong_types: set[object] = set()
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"])
        if item["type"] == _PROBLEMS:
            found.extend(item["ctx"]["problems"])
        elif item["type"] == "extra_forbidden":
            found.append(f"unknown field {where!r}")
        elif isinstance(nested := item.get("ctx", {}).get("error"), ConfigError):  # a group's unknown field
            found.extend(f"{where}: {problem}" for problem in nested.problems)
        elif item["loc"][:1] not in wrong_types:  # once a field: a union's every member says it in turn
            wrong_types.add(item["loc"][:1])
            found.append(f"{item['loc'][0]}: {item['msg']}, got {item['input']!r}")
    return found


def _is_unknown_key(item: Any) -> bool:
    # A group built from a dict inside its parent raises ConfigError for an unknown key (nothing else).
    return item["type"] == "extra_forbidden" or isinstance(item.get("ctx", {}).get("error"), ConfigError)


class ConfigModel(BaseModel):
    """A frozen config group. Fields are given by name (or, as the dataclasses were, in their order)."""

    # validate_default: a rule over several fields runs when some of them keep their defaults.
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    _problems: tuple[str, ...] = PrivateAttr(default=())

    def __init__(self, *args: Any, **values: Any) -> None:
        names = list(type(self).model_fields)
        if len(args) > len(names) or set(names[:len(args)]) & set(values):
            raise TypeError(f"{type(self).__name__}: too many positional arguments, or one given twice")
        values.update(zip(names, args))
        try:
            super().__init__(**values)
        except ValidationError as exc:
            problems = describe(exc)
            if any(_is_unknown_key(item) for item in exc.errors()):
                raise ConfigError(problems) from None
            self._keep_as_given(values, problems)

    @field_validator("*")
    @classmethod
    def _groups_problems(cls, value: Any) -> Any:
        """A group (or a tuple of them) brings the problems it was built with to its parent."""
        for group in value if isinstance(value, tuple) else (value,):
            if isinstance(group, ConfigModel) and group._problems:
                refuse(*group._problems)
        return value

    def _keep_as_given(self, values: dict[str, Any], problems: list[str]) -> None:
        """Hold `values` unvalidated (as `model_construct` does) with their problems, for `validated()`."""
        given = type(self).model_construct(**values)
        for name in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__"):
            object.__setattr__(self, name, getattr(given, name))
        self.__pydantic_private__["_problems"] = tuple(problems)

    def problems(self) -> list[str]:
        """Everything wrong with this config (its groups' included), each naming its flag or field."""
        return list(self._problems)

    def validated(self) -> Self:
        if self._problems:
            raise ConfigError(list(self._problems))
        return self

    def with_(self, **changes: Any) -> Self:
        """A copy with `changes`, checked again."""
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})
