"""Hostile and careless input through pd-router in front of real SGLang 0.5.23 servers.

What the real servers refuse or fail on is refused by the router first, and the servers stay up (an empty
prompt in a batch, `input_ids: [[]]`, killed the scheduler of every 0.5.23 server it reached, one after the
other as the router retried); what they refuse themselves comes back as a JSON error, not retried; the
field that tells a pd-router from a SGLang server is in no real server's answer.
"""

from router.core.router_identity import MARKER_FIELD

from .real_client import get_json, post_json, request_json

GREEDY = {"temperature": 0, "max_new_tokens": 4}
REFUSED_FIRST = [  # (path, body, param): real 0.5.23 dies on these, or answers a 500
    ("/generate", {"input_ids": [[]], "sampling_params": GREEDY}, "input_ids"),
    ("/generate", {"input_ids": [[1, 2], []], "sampling_params": GREEDY}, "input_ids"),
    ("/v1/completions", {"prompt": [[]], "max_tokens": 4}, "prompt"),
    ("/generate", {"text": "hi", "rid": ["solo"], "sampling_params": GREEDY}, "rid"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 10**9}}, "sampling_params.n"),
]


def test_what_kills_a_real_server_is_refused_before_it_reaches_one(router, fleet):
    for path, body, param in REFUSED_FIRST:
        status, answer = post_json(router.url + path, body)
        assert status == 400 and answer["error"]["param"] == param, (path, body, answer)
    for server in fleet.pd_servers:  # all still up, and the fleet serves
        assert request_json("GET", server.url + "/health", timeout=30)[0] == 200
    status, answer = post_json(router.url + "/generate", {"text": "The quick brown fox", "sampling_params": GREEDY})
    assert status == 200 and answer["meta_info"]["completion_tokens"] == 4


def test_what_a_real_server_refuses_comes_back_as_a_json_error_once(router):
    # 0.5.23's contract gate answers {"error": "<text>"}: the client gets {"error": {"message": ...}}
    status, answer = post_json(router.url + "/generate", {"text": "hi", "sampling_params": {"bogus": 1}})
    assert status == 400 and "unknown field `bogus`" in answer["error"]["message"], answer
    status, answer = post_json(router.url + "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_p": 7})
    assert 400 <= status < 500 and answer["error"]["message"], answer
    for worker in get_json(router.url + "/workers")["workers"]:
        assert worker["breaker"] == "closed" and worker["routable"], worker


def test_no_real_server_answers_the_field_that_names_a_pd_router(router, fleet):
    for server in [*fleet.pd_servers, fleet.reference]:
        for path in ("/server_info", "/model_info"):
            assert MARKER_FIELD not in get_json(server.url + path), (server.url, path)
    assert MARKER_FIELD in get_json(router.url + "/server_info")
    status, answer = post_json(router.url + "/workers", {"url": router.url, "worker_type": "decode"})
    assert status == 400 and "this router itself" in answer["error"]["message"], answer
