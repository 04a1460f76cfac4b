"""The pair itself: launched through server_patches, serving a PD request by hand."""

from .real_client import get_json, live_role, output_ids, pd_generate

PROMPT = "Hello world, this is"


def test_pair_serves_a_pd_request_deterministically(pd_pair):
    first = pd_generate(pd_pair.prefill.url, pd_pair.decode.url, pd_pair.prefill.bootstrap_port, PROMPT)
    again = pd_generate(pd_pair.prefill.url, pd_pair.decode.url, pd_pair.prefill.bootstrap_port, PROMPT)
    assert len(output_ids(first)) == 8
    assert output_ids(again) == output_ids(first)
    assert first["decode"]["meta_info"]["finish_reason"]["type"] == "length"


def test_servers_run_with_the_launch_settings_of_the_pair(pd_pair):
    for server, role in ((pd_pair.prefill, "prefill"), (pd_pair.decode, "decode")):
        info = get_json(f"{server.url}/server_info")
        assert info["disaggregation_mode"] == role == live_role(server.url)
        # --enable-pd-convert was given on the command line: the launcher maps it onto the switch flag.
        assert info["enable_pd_role_switch"] is True
        assert info["disaggregation_bootstrap_port"] == server.bootstrap_port
    assert get_json(f"{pd_pair.prefill.url}/server_info")["disable_radix_cache"] is False
