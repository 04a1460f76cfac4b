"""The admin API over HTTP (urllib: no event loop, no import cost) and the exit codes its failures map to."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

OK, FAILED, USAGE, UNREACHABLE, AUTH = 0, 1, 2, 3, 4


class CtlError(Exception):
    """A failure the command reports on stderr and exits with."""

    exit_code = FAILED

    def __init__(self, message: str, *, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body


class Refused(CtlError):
    """The router answered, with a failure (a refused or failed operation, an unknown worker, bad input)."""


class Unreachable(CtlError):
    exit_code = UNREACHABLE


class AuthRefused(CtlError):
    exit_code = AUTH


class UsageError(CtlError):
    exit_code = USAGE


@dataclass(slots=True)
class Answer:
    status: int
    body: Any  # parsed JSON, the text when it is not JSON, None when empty


def error_message(body: Any, status: int) -> str:
    """The router's own words: `error.message` (its error shape), else SGLang's `message`, else the text."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("message"):
            return str(body["message"])
    if isinstance(body, str) and body.strip():
        return body.strip()[:500]
    return f"HTTP {status}"


def _parse(raw: bytes) -> Any:
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class AdminClient:
    def __init__(self, base_url: str, key: str | None = None, timeout: float | None = 30.0,
                 long_timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.key = key
        self.timeout = timeout  # quick calls
        self.long_timeout = long_timeout  # operations that answer when they have ended; None: no limit

    def call(self, method: str, path: str, body: Any = None, *, timeout: float | None = ...,
             accept: tuple[int, ...] = ()) -> Answer:
        """One call; a 2xx answer, or a status listed in `accept`, is returned; anything else raises.
        `timeout=None` waits as long as the router takes (its own deadlines bound its operations)."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        wait = self.timeout if timeout is ... else timeout
        try:
            with urllib.request.urlopen(request, timeout=wait) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
            exc.close()
        except (TimeoutError, socket.timeout):
            raise Unreachable(f"the router at {self.base_url} did not answer {method} {path} within {wait:g} s "
                              f"(--http-timeout)") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise Unreachable(f"the router at {self.base_url} did not accept a connection within {wait:g} s "
                                  f"(--http-timeout)") from None
            raise Unreachable(f"cannot reach the router at {self.base_url}: {exc.reason}") from None
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            raise Unreachable(f"cannot reach the router at {self.base_url}: {exc}") from None
        answer = Answer(status, _parse(raw))
        if 200 <= status < 300 or status in accept:
            return answer
        message = error_message(answer.body, status)
        if status in (401, 403):
            raise AuthRefused(f"{message} (give the admin key with --admin-key or PD_ROUTER_ADMIN_API_KEY)",
                              status=status, body=answer.body)
        raise Refused(message, status=status, body=answer.body)

    def get(self, path: str, **kw) -> Answer:
        return self.call("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw) -> Answer:
        return self.call("POST", path, {} if body is None else body, **kw)
