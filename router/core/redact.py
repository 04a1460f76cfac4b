"""Secrets out of what the router relays from a server.

SGLang's `/server_info` is its launch arguments, `api_key`, `admin_api_key` and `ssl_keyfile_password`
included, and `launch_command` repeats them as flags. Everything the router passes on from a server (info
answers, per-worker messages of the fleet flows, health reasons, log lines) goes through `redact` (JSON
values) or `redact_text` (free text) first. Control plane only: generation answers are not server
arguments and never come through here.

A field is secret by its name: a word `key`, `password`, `secret`, `credential`, ... or a credential token
(`hf_token`, `access_token`; not `max_total_tokens` or `bucket_time_to_first_token`). Its value becomes
`REDACTED` (the string SGLang itself writes for its watermark keys) unless it is null or a boolean, which
tell whether a secret is set and nothing more.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

REDACTED = "<redacted>"

_SECRET_WORDS = frozenset({
    "key", "apikey", "password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials",
    "authorization", "cookie",
})
# `<word>_token` names that are credentials; other tokens are counts (`max_total_tokens`, `per_token`).
_CREDENTIAL_TOKENS = frozenset({
    "hf", "hub", "access", "auth", "api", "bearer", "refresh", "session", "id", "secret", "github", "gh",
    "wandb", "private", "service", "oauth", "jwt",
})
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")


@lru_cache(maxsize=8192)  # server_info repeats the same ~600 names on every call
def is_secret_name(name: str) -> bool:
    words = [w for w in _WORD_SPLIT.split(_CAMEL.sub(r"\1_\2", name).lower()) if w]
    if not words or words[-1] in ("error", "exception"):  # `KeyError: 'x'` in a message names no secret
        return False
    if _SECRET_WORDS.intersection(words):
        return True
    return words[-1] == "token" and (len(words) == 1 or words[-2] in _CREDENTIAL_TOKENS)


_PLAIN = (int, float, bool, type(None))  # nothing to look into (a secret name still redacts a number)


def redact(value: Any) -> Any:
    """A copy of a JSON value with every secret replaced (recursively, in dicts, lists and strings)."""
    kind = type(value)
    if kind is dict:
        return _redact_object(value)
    if kind is list:
        return [v if type(v) in _PLAIN else redact(v) for v in value]
    if kind is str:
        return redact_text(value)
    return value


def _redact_object(obj: dict) -> dict:
    out = {}
    for name, value in obj.items():
        if value is None or value is True or value is False:
            out[name] = value
        elif type(name) is str and is_secret_name(name):
            out[name] = REDACTED
        else:
            out[name] = value if type(value) in _PLAIN else redact(value)
    return out


# `--api-key VALUE`, `--admin-api-key=VALUE` (launch_command, error text quoting a command line)
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)(=|\s+)(\"[^\"]*\"|'[^']*'|(?!-)[^\s\"']+)")
# `api_key='x'` (a ServerArgs repr), `"api_key": "x"` (JSON inside a string), `token=x&` (a query)
_ASSIGNMENT = re.compile(r"(?<![\w-])([A-Za-z_][\w-]*)([\"']?\s*[:=]\s*)"
                         r"((?:(?:Bearer|Basic)\s+)?(?:\"[^\"]*\"|'[^']*'|[^\s,;&)}\]\"']+))", re.IGNORECASE)
# `scheme://user:password@host`
_USERINFO = re.compile(r"(\b[A-Za-z][\w+.-]*://[^/\s:@]*:)([^@\s/]+)@")
_BEARER = re.compile(r"(\bBearer\s+)[^\s\"',;]+", re.IGNORECASE)
# Cheap gate: text without any of these cannot match a pattern above with a secret name.
_MAYBE = re.compile(r"key|pass|secret|token|credential|auth|cookie|@|bearer", re.IGNORECASE)
_HARMLESS_VALUES = frozenset({"", "null", "none", "true", "false", REDACTED})  # nothing secret to hide


def _secret_value(match: re.Match) -> str:
    name, sep, value = match.group(1), match.group(2), match.group(3)
    if not is_secret_name(name.lstrip("-")) or value.strip("\"'").lower() in _HARMLESS_VALUES:
        return match.group(0)
    quote = value[0] if value[0] in "\"'" and len(value) > 1 else ""
    return f"{name}{sep}{quote}{REDACTED}{quote}"


def redact_text(text: str) -> str:
    """Free text (a message, a command line, a URL) with secret-looking values replaced."""
    if not _MAYBE.search(text):
        return text
    text = _FLAG.sub(_secret_value, text)
    text = _ASSIGNMENT.sub(_secret_value, text)
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    return _BEARER.sub(rf"\1{REDACTED}", text)
