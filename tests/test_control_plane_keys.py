"""SMG's control-plane keys (`--control-plane-api-keys id:name:role:key`) and audit log
(`--control-plane-audit-enabled`): which key opens what, and one line per admin call saying who, what, outcome."""

from __future__ import annotations

import logging

KEYS = ("ops:Service Account:admin:s3cret", "ro:Read Only:user:r3ad")


def _audit(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "router.audit"]


async def test_admin_role_opens_admin_routes_and_user_role_does_not(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], control_plane_api_keys=KEYS)
    assert (await router.get("/workers")).status == 401
    assert (await router.get("/workers", headers={"Authorization": "Bearer r3ad"})).status == 401
    assert (await router.get("/workers", headers={"Authorization": "Bearer s3cret"})).status == 200
    # generation needs no key without --api-key: the control-plane keys do not close it
    assert (await router.post("/generate", json={"text": "hi"})).status == 200


async def test_user_role_opens_generation_where_the_api_key_closes_it(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], api_key="gen", control_plane_api_keys=KEYS)
    assert (await router.post("/generate", json={"text": "hi"})).status == 401
    for key in ("gen", "r3ad", "s3cret"):
        assert (await router.post("/generate", json={"text": "hi"}, headers={"Authorization": f"Bearer {key}"})
                ).status == 200, key
    assert (await router.get("/workers", headers={"Authorization": "Bearer gen"})).status == 200  # sgl-router's
    assert (await router.get("/workers", headers={"Authorization": "Bearer r3ad"})).status == 401


async def test_audit_line_per_admin_call_who_what_outcome(sim_workers, make_router, caplog):
    p, d = await sim_workers()
    router = await make_router([p], [d], control_plane_api_keys=KEYS, control_plane_audit_enabled=True)
    caplog.set_level(logging.INFO, logger="router.audit")
    await router.get("/workers", headers={"Authorization": "Bearer s3cret"})
    await router.get("/workers", headers={"Authorization": "Bearer wrong"})
    await router.post("/workers", json={"url": "not a url"}, headers={"Authorization": "Bearer s3cret"})
    await router.get("/health")  # public: not audited
    await router.post("/generate", json={"text": "hi"})  # generation: not audited
    lines = _audit(caplog)
    assert [(f["method"], f["path"], f["caller"], f["status"]) for f in lines] == [
        ("GET", "/workers", "ops", 200), ("GET", "/workers", "-", 401), ("POST", "/workers", "ops", 400)]
    assert all(f["remote"] == "127.0.0.1" for f in lines)
    assert not any("s3cret" in r.getMessage() for r in caplog.records)


async def test_no_audit_without_the_flag(sim_workers, make_router, caplog):
    p, d = await sim_workers()
    router = await make_router([p], [d])
    caplog.set_level(logging.INFO, logger="router.audit")
    assert (await router.get("/workers")).status == 200
    assert _audit(caplog) == []
