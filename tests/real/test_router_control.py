"""Fleet-wide control through pd-router on real servers: abort (all, by rid), pause modes and continue, a weight
update with abort. Each call must reach both legs of a PD request: the request ends (abort) or stalls (pause)
on the prefill and the decode server alike, and nothing stays behind on the servers or in the router."""

import threading

import pytest

from .real_client import fully_idle, get_json, is_idle, post_json, running_requests, stream_events, wait_until

PROMPT = "Numbers 0 1 2 3 and"
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}  # ~30 s of decoding here: never finishes first
SHORT = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
STEP_TIMEOUT_S = 60.0


class Background:
    """One request in a thread; `.tokens` counts streamed tokens so far; `.result` once it ended."""

    def __init__(self, url: str, body: dict, stream: bool = True) -> None:
        self.tokens = 0
        self.result: tuple | None = None
        # Set by the client thread itself the moment 3 tokens arrived (or the request ended): a poll could miss a
        # short decode entirely on a fast machine.
        self.decoding_or_done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, body, stream), daemon=True)
        self._thread.start()

    def _on_event(self, event) -> None:
        if isinstance(event, dict):
            self.tokens = len(event.get("output_ids") or [])
            if self.tokens >= 3:
                self.decoding_or_done.set()

    def _run(self, url, body, stream):
        try:
            if stream:
                self.result = stream_events(url, dict(body, stream=True), timeout=180, on_event=self._on_event)
            else:
                self.result = post_json(url, body, timeout=180)
        finally:
            self.decoding_or_done.set()

    def join(self, timeout: float = STEP_TIMEOUT_S):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request did not end"
        return self.result

    @property
    def done(self) -> bool:
        return self.result is not None


def final_event(result) -> dict:
    status, events = result
    assert status == 200 and events[-1] == "[DONE]", result
    return events[-2]


def reference(fleet, sampling=SHORT) -> list[int]:
    status, answer = post_json(fleet.reference.url + "/generate", {"text": PROMPT, "sampling_params": sampling})
    assert status == 200, answer
    return answer["output_ids"]


def assert_fleet_quiet(router, fleet) -> None:
    for server in fleet.pd_servers:
        wait_until(lambda: fully_idle(server.url), timeout=STEP_TIMEOUT_S, what=f"{server.url} is idle")
    wait_until(lambda: all(w["inflight"] == 0 for w in router.workers()), timeout=STEP_TIMEOUT_S,
               what="the router has nothing in flight")


def router_inflight(router) -> int:
    """Requests the router has open on its decode servers (its own count, current at every call)."""
    return sum(w["inflight"] for w in router.workers() if w["role"] == "decode")


def decoding(router, body=None) -> Background:
    """A long streaming request through the router, once it is decoding (tokens arrive)."""
    request = Background(router.url + "/generate", body or {"text": PROMPT, "sampling_params": LONG})
    assert request.decoding_or_done.wait(STEP_TIMEOUT_S), "no tokens streamed"
    assert not request.done, request.result
    return request


def test_abort_all_ends_a_stream_on_both_legs(router, fleet):
    request = decoding(router)
    status, answer = post_json(router.url + "/abort_request", {"abort_all": True})
    assert (status, answer) == (200, None)  # SGLang's answer: 200, empty body
    last = final_event(request.join())
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(last["output_ids"]) < LONG["max_new_tokens"]
    assert_fleet_quiet(router, fleet)
    # and the fleet serves on
    status, answer = post_json(router.url + "/generate", {"text": PROMPT, "sampling_params": SHORT})
    assert status == 200 and answer["output_ids"] == reference(fleet)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_abort_by_rid_ends_that_request_only(router, fleet, stream):
    target = {"text": PROMPT, "sampling_params": LONG, "rid": f"real-tier-abort-{stream}"}
    other = decoding(router)
    if stream:
        request = decoding(router, target)
    else:
        request = Background(router.url + "/generate", target, stream=False)
        # the router's own count first: a decode's load row can be 15 steps old and still show the previous test's
        # two requests, and an abort sent before this one reached the router finds no such rid anywhere
        wait_until(lambda: router_inflight(router) >= 2 or request.done, timeout=STEP_TIMEOUT_S,
                   what="the router holds both requests")
        wait_until(lambda: sum(running_requests(d.url) for d in (fleet.decode, fleet.spare)) >= 2 or request.done,
                   timeout=STEP_TIMEOUT_S, what="both requests decode")
    status, answer = post_json(router.url + "/abort_request", {"rid": target["rid"]})
    assert (status, answer) == (200, None)
    if stream:
        last = final_event(request.join())
    else:
        status, last = request.join()
        assert status == 200, last
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert not other.done  # only that rid
    assert post_json(router.url + "/abort_request", {"abort_all": True})[0] == 200
    assert final_event(other.join())["meta_info"]["finish_reason"]["type"] == "abort"
    assert_fleet_quiet(router, fleet)


def held_in_router(router) -> int:
    return get_json(f"{router.url}/weight_updates")["admission"]["waiting"]


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_and_continue(router, fleet, mode):
    """abort: the running request ends with an abort. retract: it leaves the batch (the decode server can flush
    its cache meanwhile) and finishes after continue, retracted once. in_place: it stays in the batch (the flush
    is refused as busy) and finishes after continue, never retracted. A request sent while paused waits in
    the router and is answered after continue."""
    # Long enough that the pause lands mid-decode on a fast machine (~3 ms/token seen in CI), short enough to
    # finish after continue in ~20 s on a slow one.
    sampling = dict(LONG, max_new_tokens=1000)
    running = decoding(router, {"text": PROMPT, "sampling_params": sampling})
    status, answer = post_json(router.url + "/pause_generation", {"mode": mode}, timeout=STEP_TIMEOUT_S)
    assert status == 200 and answer["success"] is True, answer
    assert {w["status"] for w in answer["workers"]} == {200} and len(answer["workers"]) == 3
    assert get_json(f"{router.url}/weight_updates")["paused"] == mode
    waiting = Background(router.url + "/generate", {"text": PROMPT, "sampling_params": SHORT}, stream=False)
    wait_until(lambda: held_in_router(router) == 1, timeout=STEP_TIMEOUT_S, what="the new request is held")
    if mode == "abort":
        last = final_event(running.join())
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
    else:
        assert not running.done
        streamed_before_continue = running.tokens
        status, flushed = post_json(router.url + "/flush_cache", {})
        assert (status == 200) == (mode == "retract"), flushed
    status, answer = post_json(router.url + "/continue_generation", {}, timeout=STEP_TIMEOUT_S)
    assert status == 200 and answer["success"] is True, answer
    status, answer = waiting.join()
    assert status == 200 and answer["output_ids"] == reference(fleet)
    if mode != "abort":
        last = final_event(running.join(timeout=120))
        # the reason in full: an abort here names its origin (seen once under load: not reproduced in 22 runs)
        assert last["meta_info"]["finish_reason"]["type"] == "length", last["meta_info"]["finish_reason"]
        assert last["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
        # Nothing lost or repeated across the pause: the full length, and what was streamed before continue is
        # the reference's. Beyond that, exact identity of a long output is not asserted: on this tiny random
        # model (nearly flat logits, bf16 on CPU) a retracted request's recomputation, and the server state it
        # leaves, may turn a later argmax (seen at tokens 100 and 194 of 200, also on the next request).
        assert len(last["output_ids"]) == sampling["max_new_tokens"]
        expected_prefix = reference(fleet, dict(sampling, max_new_tokens=streamed_before_continue))
        assert last["output_ids"][:streamed_before_continue] == expected_prefix
    assert_fleet_quiet(router, fleet)


def test_registering_a_paused_server_again_is_a_409_at_once(router, fleet):
    """/register of a known server paused behind the router's back says it is paused (/ready 503), at once.
    0.5.23's /health on a paused server waits for any answer of its scheduler, up to 20 s, then 503 (measured
    here: 20 s with nothing else asked, or /v1/loads, or /model_info; 1 s while /server_info is read, which the
    router's own live-state read does): the answer must not wait for it, nor blame it."""
    spare = fleet.spare.url
    status, answer = post_json(spare + "/pause_generation", {"mode": "in_place"}, timeout=STEP_TIMEOUT_S)
    assert status == 200, answer
    try:
        # a deadline well under the router's /health probe (25 s): the answer must not wait for it
        status, answer = post_json(router.url + "/register", {"mode": "decode", "registry_url": spare}, timeout=15)
        assert status == 409 and "/ready answers 503" in answer["error"]["message"], (status, answer)
    finally:
        assert post_json(spare + "/continue_generation", {}, timeout=STEP_TIMEOUT_S)[0] == 200
    wait_until(lambda: is_idle(spare), timeout=STEP_TIMEOUT_S, what="the spare answers again")


def test_weight_update_with_abort_through_the_router(router, fleet):
    model_path = get_json(f"{fleet.prefill.url}/model_info")["model_path"]
    running = decoding(router)
    try:
        body = {"model_path": model_path, "abort_all_requests": True, "weight_version": "real-tier-v2"}
        status, answer = post_json(router.url + "/update_weights_from_disk", body, timeout=180)
        assert status == 200 and answer["success"] is True, answer
        assert answer["weight_version"] == "real-tier-v2" and not answer["left_out"]
        assert {(w["success"], w["weight_version"]) for w in answer["workers"]} == {(True, "real-tier-v2")}
        last = final_event(running.join())
        assert last["meta_info"]["finish_reason"]["type"] == "abort"  # aborted before the update, as asked
        versions = get_json(f"{router.url}/get_weight_version")
        assert versions["consistent"] is True and versions["weight_version"] == "real-tier-v2"
        # Every later answer carries the new version (same weights: same tokens), streaming or not.
        expected = reference(fleet)
        for body in ({"text": PROMPT, "sampling_params": SHORT}, {"input_ids": [1, 393, 390], "sampling_params": SHORT}):
            status, answer = post_json(router.url + "/generate", body)
            assert status == 200 and answer["meta_info"]["weight_version"] == "real-tier-v2", answer
        status, events = stream_events(router.url + "/generate", {"text": PROMPT, "sampling_params": SHORT,
                                                                  "stream": True})
        assert {e["meta_info"]["weight_version"] for e in events[:-1]} == {"real-tier-v2"}
        assert events[-2]["output_ids"] == expected
        status, answer = post_json(router.url + "/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                                    "max_tokens": 4, "temperature": 0})
        assert status == 200 and answer["metadata"]["weight_version"] == "real-tier-v2", answer
    finally:
        # back to the launch version, so that later tests compare with the reference server field for field
        body = {"model_path": model_path, "abort_all_requests": True, "weight_version": "default"}
        status, answer = post_json(router.url + "/update_weights_from_disk", body, timeout=180)
        assert status == 200 and answer["weight_version"] == "default", answer
    assert_fleet_quiet(router, fleet)


def test_weight_update_while_paused_in_place_holds_the_unflushed_decode_until_the_router_flushes_it(router, fleet):
    """0.5.23 changes the weights of a server paused in place with a request in its batch, but refuses to flush
    its cache (400 '... the cache was not flushed ...'): the router takes the update there, holds that decode out
    as `cache` (the other decode serves), and flushes it once its request has ended after continue; it rejoins
    on the new version."""
    model_path = get_json(f"{fleet.prefill.url}/model_info")["model_path"]
    running = decoding(router, {"text": PROMPT, "sampling_params": dict(LONG, max_new_tokens=300)})
    try:
        status, answer = post_json(router.url + "/pause_generation", {"mode": "in_place"}, timeout=STEP_TIMEOUT_S)
        assert status == 200, answer
        body = {"model_path": model_path, "weight_version": "real-tier-cache"}
        status, answer = post_json(router.url + "/update_weights_from_disk", body, timeout=180)
        assert status == 200 and answer["success"] is True and answer["weight_version"] == "real-tier-cache", answer
        stale = [w for w in answer["workers"] if w.get("cache") == "stale"]
        assert len(stale) == 1 and stale[0]["role"] == "decode" and stale[0]["routable"] is False, answer
        assert "cache was not flushed" in stale[0]["message"], stale[0]  # the server's own refusal, passed on
        held = {w["url"]: w for w in router.workers()}[stale[0]["url"]]
        assert (held.get("hold") or {}).get("kind") == "cache", held
        status, answer = post_json(router.url + "/continue_generation", {}, timeout=STEP_TIMEOUT_S)
        assert status == 200, answer
        last = final_event(running.join(timeout=120))
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        wait_until(lambda: {w["url"]: w for w in router.workers()}[stale[0]["url"]]["routable"],
                   timeout=STEP_TIMEOUT_S, what="the decode flushed and back in routing")
        for _ in range(3):  # both decodes serve the new version
            status, answer = post_json(router.url + "/generate", {"text": PROMPT, "sampling_params": SHORT})
            assert status == 200 and answer["meta_info"]["weight_version"] == "real-tier-cache", answer
    finally:
        post_json(router.url + "/continue_generation", {}, timeout=STEP_TIMEOUT_S)
        body = {"model_path": model_path, "abort_all_requests": True, "weight_version": "default"}
        status, answer = post_json(router.url + "/update_weights_from_disk", body, timeout=180)
        assert status == 200 and answer["weight_version"] == "default", answer
    assert_fleet_quiet(router, fleet)
