"""The prefix-cache leak on a prefill->decode switch (upstream 0.5.23), with and without the fix.

A server launched as prefill with its prefix cache on, switched to decode, serves PD requests; upstream's
scheduler then dies at its next idle memory check ("pool memory leak detected"). With the
prefix_cache_on_role_switch patch it keeps serving. The same requests are sent in both cases.
"""

from pathlib import Path

from .real_client import convert, is_idle, live_role, output_ids, pd_generate, request_json, wait_until

from server_patches.pair import RealServer, wait_healthy
from server_patches.tinymodel import is_complete

PROMPTS = ("Hello world, this is", "The quick brown fox", "Numbers 0 1 2 3 and")
LEAK_MESSAGE = "pool memory leak detected"
DEATH_DEADLINE_S = 60
REQUEST_TIMEOUT_S = 90  # generous: the machine is shared and a first request after a switch is the slowest


def _serve_as_decode(prefill, decode):
    """The prompts through prefill -> decode, each followed by the decode server going idle (its idle memory
    check runs then); stops early only if the decode server died."""
    results = []
    for prompt in PROMPTS:
        results.append(pd_generate(prefill.url, decode.url, prefill.bootstrap_port, prompt,
                                   timeout=REQUEST_TIMEOUT_S))
        wait_until(lambda: _idle_or_dead(decode), timeout=REQUEST_TIMEOUT_S, what="decode is idle (or has died)")
        if not decode.alive():
            break
    return results


def _idle_or_dead(server) -> bool:
    if not server.alive():
        return True
    try:
        return is_idle(server.url)
    except (OSError, AssertionError):  # dying: its scheduler is gone before its HTTP server and process are
        return False


def test_switched_server_with_prefix_cache_survives_with_the_patch(pd_pair):
    p, d = pd_pair.prefill, pd_pair.decode
    baseline = [output_ids(pd_generate(p.url, d.url, p.bootstrap_port, prompt)) for prompt in PROMPTS]
    assert convert(p.url)[0] == 200 and convert(d.url)[0] == 200
    try:
        results = _serve_as_decode(d, p)  # the launched-prefill server now decodes
        assert [output_ids(r) for r in results] == baseline
        # Idle after each request means its idle memory check ran; one more request proves it passed.
        assert output_ids(pd_generate(d.url, p.url, d.bootstrap_port, PROMPTS[0])) == baseline[0]
        assert p.alive() and request_json("GET", f"{p.url}/health")[0] == 200
        assert LEAK_MESSAGE not in Path(p.info.log).read_text(errors="replace")
    finally:
        for server, role in ((p, "prefill"), (d, "decode")):
            if server.alive() and live_role(server.url) != role:
                assert convert(server.url)[0] == 200


def test_without_the_patch_the_switched_server_dies_at_the_idle_check(pd_pair, stack_paths, tmp_path):
    assert is_complete(str(stack_paths.tiny_model))
    unpatched = RealServer.launch(
        "prefill", paths=stack_paths, model=stack_paths.tiny_model, log_path=tmp_path / "unpatched.log",
        radix_cache=True, disabled_patches=("prefix_cache_on_role_switch",), die_with_parent=True,
    )
    try:
        wait_healthy([unpatched], timeout=300)
        status, answer = convert(unpatched.url)
        assert status == 200 and live_role(unpatched.url) == "decode", answer
        results = _serve_as_decode(pd_pair.prefill, unpatched)
        wait_until(lambda: not unpatched.alive(), timeout=DEATH_DEADLINE_S,
                   what=lambda: f"the unpatched switched server dies (decode answers "
                                f"{[r['decode_status'] for r in results]}); log tail:\n{unpatched.log_tail(15)}")
        assert LEAK_MESSAGE in Path(unpatched.info.log).read_text(errors="replace")
    finally:
        unpatched.stop()
    # Its peer is unharmed.
    assert pd_pair.prefill.alive() and request_json("GET", f"{pd_pair.prefill.url}/health")[0] == 200
