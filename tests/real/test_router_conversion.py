"""Live P/D conversion through pd-router on real servers, under light load, with both router endpoints.

The router runs 1P+2D (prefill P, decode D, spare decode S). The spare is what makes a swap possible: the
router never converts the last routable worker of a pool. Under load (a few clients, every answer checked
against the reference server), P and S swap roles and swap back, one endpoint each way:
    S decode->prefill  /pd_role_switch     (server's /pd_role_switch)        -> prefill {P, S}, decode {D}
    P prefill->decode  /convert_pd_role    (server's /convert_pd_role)       -> prefill {S},    decode {D, P}
    P decode->prefill  /convert_pd_role                                      -> prefill {S, P}, decode {D}
    S prefill->decode  /pd_role_switch                                       -> prefill {P},    decode {D, S}
No request may fail, and each converted server must serve requests in its new role before the next step.
"""

from .load import Load
from .real_client import fully_idle, get_json, live_role, post_json, wait_until

PROMPTS = ("Hello world, this is", "The quick brown fox", "Numbers 0 1 2 3 and", "SGLang router routes")
SAMPLING = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
CONVERSION_TIMEOUT_S = 180.0
SERVE_TIMEOUT_S = 60.0


def reference_outputs(reference) -> dict[str, list[int]]:
    expected = {}
    for prompt in PROMPTS:
        status, answer = post_json(reference.url + "/generate", {"text": prompt, "sampling_params": SAMPLING})
        assert status == 200, answer
        expected[prompt] = answer["output_ids"]
    return expected


def worker(router, url: str) -> dict:
    (found,) = [w for w in router.workers() if w["url"] == url]
    return found


def convert(router, endpoint: str, server, new_role: str, load: Load) -> dict:
    """One conversion through the router; returns its record once the server served in its new role."""
    body = ({"worker_url": server.url, "new_role": new_role} if endpoint == "/pd_role_switch"
            else {"server_url": server.url})
    served_before = worker(router, server.url)["requests_total"]
    status, answer = post_json(router.url + endpoint, body, timeout=CONVERSION_TIMEOUT_S)
    assert status == 200 and answer["success"] is True and answer["outcome"] == "converted", answer
    assert answer["new_role"] == new_role == live_role(server.url)
    if new_role == "prefill":  # an in-place switch keeps the server's own bootstrap port
        assert answer["bootstrap_port"] == server.bootstrap_port
    record = get_json(f"{router.url}/admin/conversions/{answer['conversion_id']}")
    assert [s["step"] for s in record["steps"]] == ["drain", "switch", "verify"], record
    listed = worker(router, server.url)
    assert (listed["role"], listed["state"], listed["routable"]) == (new_role, "active", True), listed
    # The load goes on through the new pairing before the next step (a few requests at least).
    before = load.completed()
    wait_until(lambda: worker(router, server.url)["requests_total"] > served_before + 1, timeout=SERVE_TIMEOUT_S,
               what=f"{server.url} serves as {new_role}")
    load.wait_completed(before + 3, timeout=SERVE_TIMEOUT_S)
    assert not load.failures(), load.failures()[:3]
    return record


def test_swap_and_back_under_load_with_both_endpoints(router, fleet):
    p, d, s = fleet.prefill, fleet.decode, fleet.spare
    expected = reference_outputs(fleet.reference)
    with Load(router.url, expected, SAMPLING, concurrency=3) as load:
        load.wait_completed(3, timeout=SERVE_TIMEOUT_S)
        steps = [
            ("/pd_role_switch", s, "prefill"),
            ("/convert_pd_role", p, "decode"),
            ("/convert_pd_role", p, "prefill"),
            ("/pd_role_switch", s, "decode"),
        ]
        records = [convert(router, endpoint, server, role, load) for endpoint, server, role in steps]
        outcomes = load.stop()
    assert not load.failures(), load.failures()[:5]
    assert len(outcomes) >= 15 and {o.stream for o in outcomes} == {True, False}
    # Each router endpoint drove the server API of its own design (server_patches adds /convert_pd_role).
    assert [r["api"] for r in records] == ["pd_role_switch", "convert_pd_role", "convert_pd_role",
                                           "pd_role_switch"]
    assert [live_role(x.url) for x in (p, d, s)] == ["prefill", "decode", "decode"]
    for server in (p, d, s):
        wait_until(lambda: fully_idle(server.url), timeout=60, what=f"{server.url} is idle")
    assert all(w["inflight"] == 0 for w in router.workers())
    # Back in the launch roles, every prompt answers as the single server does.
    for prompt, ids in expected.items():
        status, answer = post_json(router.url + "/generate", {"text": prompt, "sampling_params": SAMPLING})
        assert status == 200 and answer["output_ids"] == ids, (prompt, answer)


def test_swapped_fleet_answers_like_the_single_server(router, fleet):
    """With P and S swapped (P decodes, S prefills, D still decodes) and nothing else running, the answers are
    the reference's through both decode servers, the converted one included."""
    p, s = fleet.prefill, fleet.spare
    expected = reference_outputs(fleet.reference)
    status, answer = post_json(router.url + "/pd_role_switch", {"worker_url": s.url, "new_role": "prefill"},
                               timeout=CONVERSION_TIMEOUT_S)
    assert status == 200 and answer["outcome"] == "converted", answer
    status, answer = post_json(router.url + "/convert_pd_role", {"server_url": p.url, "mode": "abort"},
                               timeout=CONVERSION_TIMEOUT_S)
    assert status == 200 and answer["outcome"] == "converted", answer
    served = worker(router, p.url)["requests_total"]
    sent = 0
    # (random policy: keep going until the converted server decoded some, 20 requests at most)
    while worker(router, p.url)["requests_total"] <= served + 1 and sent < 20:
        prompt = PROMPTS[sent % len(PROMPTS)]
        status, out = post_json(router.url + "/generate", {"text": prompt, "sampling_params": SAMPLING})
        assert status == 200 and out["output_ids"] == expected[prompt], (prompt, out)
        sent += 1
    assert worker(router, p.url)["requests_total"] > served + 1, "the converted server decoded next to nothing"
    # back, through the admin API this time
    for server, role in ((p, "prefill"), (s, "decode")):
        worker_id = worker(router, server.url)["id"]
        status, record = post_json(f"{router.url}/admin/workers/{worker_id}/convert", {"new_role": role},
                                   timeout=CONVERSION_TIMEOUT_S)
        assert status == 200 and record["outcome"] == "converted", record


def test_restart_after_a_conversion_routes_from_the_live_roles(router, fleet, router_holder):
    """The router converts the spare to prefill (the server's /convert_pd_role), dies (SIGKILL) and is started
    again with its original command line, which still lists the spare under --decode: it reads each server's
    live role and routes the spare as prefill with its own bootstrap port; the answers are the reference's."""
    p, d, s = fleet.prefill, fleet.decode, fleet.spare
    expected = reference_outputs(fleet.reference)
    status, answer = post_json(router.url + "/convert_pd_role", {"server_url": s.url}, timeout=CONVERSION_TIMEOUT_S)
    assert status == 200 and answer["outcome"] == "converted" and live_role(s.url) == "prefill", answer
    router.kill()
    restarted = router.restarted(router_holder.log_dir / f"router-{router_holder.starts}-restarted.log")
    router_holder.current = restarted  # later tests go on with it (or restart it: RouterHolder.in_line)
    with Load(restarted.url, expected, SAMPLING, concurrency=3) as load:  # as soon as it serves
        listed = {w["url"]: w for w in restarted.workers()}
        assert (listed[s.url]["role"], listed[s.url]["bootstrap_port"], listed[s.url]["routable"]) == \
               ("prefill", s.bootstrap_port, True), listed[s.url]
        assert (listed[p.url]["role"], listed[d.url]["role"]) == ("prefill", "decode")
        wait_until(lambda: worker(restarted, s.url)["requests_total"] > 1, timeout=SERVE_TIMEOUT_S,
                   what=f"{s.url} serves as prefill")
        load.wait_completed(8, timeout=SERVE_TIMEOUT_S)
        outcomes = load.stop()
    assert not load.failures(), load.failures()[:5]
    assert {o.stream for o in outcomes} == {True, False}
    assert f"--decode {s.url} is now prefill (live role): routing it as prefill" in restarted.log()
    # Back to the launch roles through the restarted router.
    for server in (p, d, s):
        wait_until(lambda: fully_idle(server.url), timeout=60, what=f"{server.url} is idle")
    status, record = post_json(f"{restarted.url}/admin/workers/{listed[s.url]['id']}/convert",
                               {"new_role": "decode"}, timeout=CONVERSION_TIMEOUT_S)
    assert status == 200 and record["outcome"] == "converted" and live_role(s.url) == "decode", record
