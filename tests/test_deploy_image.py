"""deploy/Dockerfile, checked without docker: parsed with BuildKit's own parser (the `dockerfile` package),
then held against pyproject.toml, the router's CLI and its build context; the probe it runs is run for
real against a router."""

from __future__ import annotations

import asyncio
import fnmatch
import sys
import tomllib
from pathlib import Path

import dockerfile
import pytest
from aiohttp import web

from router.server.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
PROBE = ROOT / "deploy" / "probe.py"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def stages() -> list[list[dockerfile.Command]]:
    """The Dockerfile's build stages, each a list of its instructions (FROM first)."""
    out: list[list[dockerfile.Command]] = []
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "FROM":
            out.append([])
        elif not out:
            continue  # ARG before the first FROM
        out[-1].append(command)
    return out


def final_stage() -> list[dockerfile.Command]:
    return stages()[-1]


def the(stage: list[dockerfile.Command], cmd: str) -> dockerfile.Command:
    found = [c for c in stage if c.cmd == cmd]
    assert len(found) == 1, f"expected one {cmd} in the final stage, found {len(found)}"
    return found[0]


def default_router_port() -> int:
    return build_parser().get_default("port")


def test_every_stage_is_python_3_11_slim():
    assert [stage[0].value[0] for stage in stages()] == ["python:3.11-slim"] * len(stages())


def test_entrypoint_is_the_console_script_pyproject_declares():
    entrypoint = the(final_stage(), "ENTRYPOINT")
    assert entrypoint.json, "exec form, so the router is PID 1 and receives the stop signal itself"
    assert entrypoint.value == ("pd-router",)
    assert PYPROJECT["project"]["scripts"]["pd-router"] == "router.__main__:main"


def test_default_command_listens_on_every_interface_on_the_exposed_port():
    cmd = the(final_stage(), "CMD")
    args = build_parser().parse_args(list(cmd.value))
    assert args.host == "0.0.0.0"
    assert the(final_stage(), "EXPOSE").value == (str(args.port),)
    assert args.port == default_router_port()


def test_stops_with_sigterm():
    assert the(final_stage(), "STOPSIGNAL").value == ("SIGTERM",)


def test_runs_as_a_numeric_non_root_user_created_before_it():
    stage = final_stage()
    user = the(stage, "USER").value[0]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes' runAsNonRoot can verify it"
    assert gid.isdigit() and int(gid) != 0
    creating = [c for c in stage if c.cmd == "RUN" and f"--uid {uid}" in c.value[0]]
    assert creating and stage.index(creating[0]) < stage.index(the(stage, "USER"))
    # nothing after USER needs root
    assert not [c for c in stage[stage.index(the(stage, "USER")):] if c.cmd == "RUN"]


def test_installs_the_wheel_of_every_package_pyproject_ships():
    build, run = stages()[0], final_stage()
    copied = {src.rstrip("/") for c in build if c.cmd == "COPY" for src in c.value[:-1]}
    # every top-level package setuptools would find, and the files the build reads
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()
                and any(fnmatch.fnmatch(p.name, pattern) for pattern in include)}
    assert packages and packages <= copied, f"not copied: {sorted(packages - copied)}"
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    # with the k8s extra (--service-discovery's client), in the wheels and in the install
    assert any(c.cmd == "RUN" and "pip wheel" in c.value[0] and c.value[0].rstrip().endswith(" '.[k8s]'")
               for c in build)
    installs = [c for c in run if c.cmd == "RUN" and "pip install" in c.value[0]]
    assert len(installs) == 1
    assert "--no-index" in installs[0].value[0] and installs[0].value[0].rstrip().endswith(" 'pd-router[k8s]'")
    assert "k8s" in PYPROJECT["project"]["optional-dependencies"]
    assert "from=build" in " ".join(installs[0].flags) + installs[0].value[0]
    assert PYPROJECT["project"]["name"] == "pd-router"


def dockerignore_allows(path: str) -> bool:
    """Docker's rules for the files we need: last matching pattern wins, a pattern matches a path or its parents."""
    allowed = True
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes)
        if hit:
            allowed = negate
    return allowed


def test_the_build_context_holds_every_copied_file_and_nothing_heavy():
    sources = [src.rstrip("/") for stage in stages() for c in stage
               if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags) for src in c.value[:-1]]
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the checkout"
        assert dockerignore_allows(source + ("/__init__.py" if (ROOT / source).is_dir() else "")), source
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "bench/__init__.py",
                  "router/__pycache__/x.pyc"):
        assert not dockerignore_allows(heavy), heavy


def test_healthcheck_runs_the_probe_the_image_installs():
    stage = final_stage()
    check = the(stage, "HEALTHCHECK")
    assert check.value[:2] == ("CMD", "pd-router-probe")
    installed = [c for c in stage if c.cmd == "COPY" and c.value[-1] == "/usr/local/bin/pd-router-probe"]
    assert installed and installed[0].value[0] == "deploy/probe.py"
    assert "--chmod=0755" in installed[0].flags
    assert PROBE.read_text().startswith("#!/usr/bin/env python3\n")
    assert f":{default_router_port()}/health" in PROBE.read_text()


async def run_probe(*args: str) -> int:
    process = await asyncio.create_subprocess_exec(sys.executable, str(PROBE), *args,
                                                   stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), 30)


@pytest.mark.parametrize("fleet_up", [True, False])
async def test_probe_alive_on_200_and_503_ready_only_on_200(sim_workers, make_router, fleet_up):
    workers = await sim_workers(1, 1) if fleet_up else []
    router = await make_router(workers[:1], workers[1:])
    url = str(router.make_url("/health"))
    assert (await router.get("/health")).status == (200 if fleet_up else 503)
    assert await run_probe("--url", url) == 0, "alive whether or not the fleet is"
    assert await run_probe("--ready", "--url", url) == (0 if fleet_up else 1)


async def test_probe_fails_when_nothing_answers_or_the_answer_is_an_error(aiohttp_server):
    app = web.Application()

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500)

    app.router.add_get("/health", broken)
    server = await aiohttp_server(app)
    assert await run_probe("--url", str(server.make_url("/health"))) == 1
    url = str(server.make_url("/health"))
    await server.close()
    assert await run_probe("--url", url, "--timeout", "1") == 1
