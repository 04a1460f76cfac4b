"""Deterministic tokenizer, detokenizer and "model" for the simulated worker.

Nothing here is random: the output of a request depends only on its input token ids and its
sampling limits, so a test can compute what any worker (prefill or decode, before or after a
role switch) must answer with :func:`expected_generation`.

- ``encode(text)``: BOS + one id per whitespace-led word (a stable hash of the word).
- ``decode(ids)``: each id is a fixed synthetic word (" ba", " kelo", ...).
- ``output_ids(input_ids, n)``: an xorshift stream seeded by the input ids.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from functools import lru_cache

VOCAB_SIZE = 32000
BOS_ID = 1
EOS_ID = 2
FIRST_WORD_ID = 4  # ids below are special (pad 0, bos 1, eos 2, unk 3)
_WORD_SPAN = VOCAB_SIZE - FIRST_WORD_ID
_WORD_RE = re.compile(r"\s*\S+|\s+")
_SYLLABLES = ("ba", "ke", "lo", "mi", "nu", "po", "ra", "si", "tu", "ve", "wa", "xo", "yi", "zu", "da", "fe")
_MASK64 = (1 << 64) - 1


def encode(text: str, *, add_bos: bool = True) -> list[int]:
    """Token ids of ``text``: BOS, then one id per word with its leading whitespace."""
    ids = list(_encode_words(text))
    return [BOS_ID, *ids] if add_bos else ids


@lru_cache(maxsize=8192)
def _encode_words(text: str) -> tuple[int, ...]:
    # load tests repeat prompts: the cache keeps tokenization off the hot path
    return tuple(FIRST_WORD_ID + zlib.crc32(piece.encode()) % _WORD_SPAN for piece in _WORD_RE.findall(text))


@lru_cache(maxsize=VOCAB_SIZE)
def token_text(token_id: int) -> str:
    """The text of one generated token: a space and two or three syllables."""
    if token_id < FIRST_WORD_ID:
        return ""
    n = token_id - FIRST_WORD_ID
    parts = [_SYLLABLES[n & 15], _SYLLABLES[(n >> 4) & 15]]
    if n >> 8:
        parts.append(_SYLLABLES[(n >> 8) & 15])
    return " " + "".join(parts)


def decode(ids: list[int]) -> str:
    return "".join(map(token_text, ids))


def _seed(input_ids: list[int]) -> int:
    # tuple-of-int hashes are not randomised per process (only str/bytes are): stable across workers
    return (hash(tuple(input_ids)) & _MASK64) or 0x9E3779B97F4A7C15


def output_ids(input_ids: list[int], count: int, *, start: int = 0) -> list[int]:
    """Generated ids ``start .. start+count-1`` for a prompt: never EOS, never special."""
    x = _seed(input_ids)
    out: list[int] = []
    for k in range(start + count):
        x ^= (x << 13) & _MASK64
        x ^= x >> 7
        x ^= (x << 17) & _MASK64
        if k >= start:
            out.append(FIRST_WORD_ID + x % _WORD_SPAN)
    return out


def token_logprob(token_id: int) -> float:
    """A fixed, plausible log-probability per token id."""
    return -0.05 - (token_id % 97) / 10.0


def apply_chat_template(messages: list[dict]) -> str:
    """The chat template of the real tiny test model: ``role: content`` lines, then ``assistant:``."""
    lines = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines.append(f"{message.get('role', 'user')}: {content or ''}\n")
    return "".join(lines) + "assistant:"


@dataclass(frozen=True)
class Generation:
    """What a simulated decode (or non-PD) worker answers for one prompt."""

    text: str
    output_ids: list[int]
    prompt_tokens: int
    finish_reason: dict


def find_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """Earliest position of any stop string in ``text``."""
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            continue
        pos = text.find(s)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def expected_generation(
    text: str | None = None,
    *,
    input_ids: list[int] | None = None,
    max_new_tokens: int = 128,
    stop: list[str] | str | None = None,
    stop_token_ids: list[int] | None = None,
) -> Generation:
    """The answer a simulated worker gives for ``text`` (or ``input_ids``) — for tests."""
    ids = list(input_ids) if input_ids is not None else encode(text or "")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    gen = Generator(ids, max_new_tokens, stops, stop_token_ids)
    while not gen.finished:
        gen.step(max_new_tokens)
    return Generation(gen.text, gen.output_ids, len(ids), gen.finish_reason or {})


class Generator:
    """Incremental output of one request: the shared logic of :func:`expected_generation` and the worker."""

    __slots__ = ("input_ids", "max_new_tokens", "stop", "stop_token_ids", "output_ids", "_text",
                 "finish_reason", "_x")

    def __init__(self, input_ids: list[int], max_new_tokens: int, stop: list[str] | None = None,
                 stop_token_ids: list[int] | None = None) -> None:
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.stop = stop or []
        self.stop_token_ids = set(stop_token_ids or ())
        self.output_ids: list[int] = []
        self._text = ""  # kept up to date only when stop strings need it
        self.finish_reason: dict | None = None
        self._x = _seed(input_ids)
        if max_new_tokens <= 0:
            self.finish_reason = {"type": "length", "length": 0}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The output text (with a matched stop string trimmed off)."""
        return self._text if self.stop else decode(self.output_ids)

    def step(self, n: int = 1) -> int:
        """Generate up to ``n`` more tokens; returns how many were added."""
        if self.finish_reason is not None:
            return 0
        if not self.stop and not self.stop_token_ids:
            return self._step_plain(n)
        added = 0
        x = self._x
        while added < n and self.finish_reason is None:
            x ^= (x << 13) & _MASK64
            x ^= x >> 7
            x ^= (x << 17) & _MASK64
            token = FIRST_WORD_ID + x % _WORD_SPAN
            self.output_ids.append(token)
            added += 1
            if token in self.stop_token_ids:
                self.finish_reason = {"type": "stop", "matched": token}
                break
            self._text += token_text(token)
            if self.stop:
                hit = find_stop(self._text, self.stop)
                if hit is not None:
                    self._text = self._text[: hit[0]]
                    self.finish_reason = {"type": "stop", "matched": hit[1]}
                    break
            if len(self.output_ids) >= self.max_new_tokens:
                self.finish_reason = {"type": "length", "length": self.max_new_tokens}
        self._x = x
        return added

    def _step_plain(self, n: int) -> int:
        """No stop conditions but the length: a tight loop."""
        out = self.output_ids
        count = min(n, self.max_new_tokens - len(out))
        x = self._x
        append = out.append
        for _ in range(count):
            x ^= (x << 13) & _MASK64
            x ^= x >> 7
            x ^= (x << 17) & _MASK64
            append(FIRST_WORD_ID + x % _WORD_SPAN)
        self._x = x
        if len(out) >= self.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.max_new_tokens}
        return count
