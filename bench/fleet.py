"""What the routers are pointed at: prefill URLs with bootstrap ports, decode URLs, and the processes serving them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Fleet:
    prefill: list[tuple[str, int | None]]  # (url, bootstrap port)
    decode: list[str]
    pids: list[int] = field(default_factory=list)  # process-tree roots, for CPU accounting

    def all_urls(self) -> list[str]:
        return [url for url, _ in self.prefill] + list(self.decode)

    def mini_lb_args(self) -> list[str]:
        """The repeatable `--prefill URL [PORT] --decode URL` form that all three routers accept."""
        args: list[str] = []
        for url, port in self.prefill:
            args += ["--prefill", url] + ([str(port)] if port is not None else [])
        for url in self.decode:
            args += ["--decode", url]
        return args
