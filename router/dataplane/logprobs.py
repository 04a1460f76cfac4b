"""Prepend prefill's input logprobs to decode's answer (the prefill leg computed them)."""

from __future__ import annotations

INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def merge_meta(prefill_item: object, decode_item: object) -> None:
    """Merge one answer item (a dict with meta_info) in place."""
    if not isinstance(prefill_item, dict) or not isinstance(decode_item, dict):
        return
    p_meta = prefill_item.get("meta_info")
    d_meta = decode_item.get("meta_info")
    if not isinstance(p_meta, dict) or not isinstance(d_meta, dict):
        return
    for key in INPUT_LOGPROB_KEYS:
        p_val = p_meta.get(key)
        if not isinstance(p_val, list):
            continue
        d_val = d_meta.get(key)
        d_meta[key] = p_val + d_val if isinstance(d_val, list) else p_val


def merge_answer(prefill_answer: object, decode_answer: object) -> None:
    """Non-streaming: a dict for a single request, a list (one per sequence) for a batch."""
    if isinstance(decode_answer, list) and isinstance(prefill_answer, list):
        for p_item, d_item in zip(prefill_answer, decode_answer):
            merge_meta(p_item, d_item)
    else:
        merge_meta(prefill_answer, decode_answer)


def index_prefill_events(events: list[dict]) -> dict[int, dict]:
    """Streaming: the first prefill event of each sequence, by its `index` (0 for a single request)."""
    first: dict[int, dict] = {}
    for event in events:
        if isinstance(event, dict):
            first.setdefault(event.get("index", 0), event)
    return first
