"""The peers' flags that set no pd-router setting (sglang-router 0.3.2's and SMG 1.13's own parsers; the whole
table with each flag's handling: docs/PEERS.md, tests/fixtures/peers/).

- REFUSED: a feature pd-router does not have (tokenizer, parsers, MCP, databases, WASM, multimodal, mesh, vLLM's
  KV connectors, EPD, JWT, tenants). Given, the router exits 2 with one line naming the flag and saying what pd-router
  does instead, where argparse would say "unrecognized arguments" and nothing else. The peer's own
  default value asks for nothing (`--backend sglang`, `--history-backend memory`): accepted.
- IGNORED: tunes a part of the peer that pd-router does not have and does not need: accepted (so that the
  peer's command line starts unchanged) and named in one warning line at start-up (`RouterConfig.warnings`).

Both are hidden from `--help` (docs/guides/migrating.md and docs/PEERS.md list them).
"""

from __future__ import annotations

import argparse

# (what pd-router does instead, the flags). A flag ending in "!" takes no value; in "*" or "+", a list.
REFUSED: tuple[tuple[str, str], ...] = (
    ("pd-router does not tokenize: the SGLang servers apply their own tokenizer and chat template",
     "--model-path --model --tokenizer-path --chat-template --tokenizer-cache-enable-l0! "
     "--tokenizer-cache-l0-max-entries --tokenizer-cache-enable-l1! --tokenizer-cache-l0-max-memory "
     "--tokenizer-cache-l1-max-memory"),
    ("pd-router relays the servers' answers as they are: start SGLang with --reasoning-parser / --tool-call-parser",
     "--reasoning-parser --tool-call-parser --parser"),
    ("no MCP tool loop: pd-router relays generation requests", "--mcp-config-path"),
    ("pd-router routes SGLang HTTP servers (--backend sglang is accepted)", "--backend --zmq-engine-count"),
    ("no conversation or response storage (no Responses API); pd-router keeps no database",
     "--history-backend --history-memory-max-responses --history-memory-max-items --history-memory-retention-secs "
     "--schema-config --oracle-wallet-path --oracle-tns-alias --oracle-connect-descriptor --oracle-username "
     "--oracle-password --oracle-external-auth! --oracle-pool-min --oracle-pool-max --oracle-pool-timeout-secs "
     "--postgres-db-url --postgres-pool-max --postgres-op-timeout-secs --redis-url --redis-pool-max "
     "--redis-retention-days --redis-op-timeout-secs"),
    ("no WASM middleware or storage hooks: pd-router's request path is its own code",
     "--enable-wasm! --storage-hook-wasm-path --storage-context-headers*"),
    ("no router-side media processing: image_data and the like are forwarded to the servers, which fetch and "
     "process them",
     "--multimodal-tensor-transport --multimodal-shm-min-bytes --multimodal-max-inflight-bytes "
     "--mm-per-request-image-limit --mm-processing --mm-pixel-cache-mb --mm-pixel-rdma! --mm-allowed-media-domains "
     "--mm-allow-private-media-hosts! --rdma-listen-ip --rdma-slot-ttl-s --log-mm-timing!"),
    ("no mesh: router replicas share one fleet through etcd instead (--etcd-endpoints, --replicas N; "
     "docs/CLUSTER.md)",
     "--enable-mesh! --mesh-server-name --mesh-host --mesh-advertise-host --mesh-port --mesh-peer-urls* "
     "--mesh-tls-ca-cert --mesh-tls-cert --mesh-tls-key --router-selector+"),
    ("no vLLM KV connectors: pd-router routes SGLang servers, whose prefill's bootstrap port is read from "
     "--bootstrap-port-annotation or from the server",
     "--kv-connector-annotation --kv-engine-id-annotation"),
    ("pd-router routes prefill/decode pairs of one model: give --prefill URL [PORT] and --decode URL",
     "--worker-urls* --enable-igw!"),
    ("no encode servers (EPD): pd-router routes prefill/decode pairs",
     "--epd-disaggregation! --encode+ --encode-policy --encode-selector+"),
    ("no JWT or per-tenant keys: --api-key, --admin-api-key and --control-plane-api-keys are Bearer keys",
     "--jwt-issuer --jwt-audience --jwt-jwks-uri --jwt-role-mapping* --tenant-api-key"),
    ("no per-tenant scheduling: admission is one FIFO queue (--max-concurrent-requests, --queue-size, "
     "--rate-limit-tokens-per-second)",
     "--priority-scheduler-enabled! --priority-scheduler-default-max-class --priority-scheduler-config "
     "--priority-scheduler-tenant-metric-top-n --tenant-rate-limit-enabled! --tenant-rate-limit-config"),
    ("the probes (/liveness, /readiness, /health) are answered on --port", "--health-check-port"),
    ("no minimum-tokens scheduler: --dp-aware picks each leg's rank by --prefill-dp-rank-policy / "
     "--decode-dp-rank-policy (least_loaded, round_robin, random)", "--dp-minimum-tokens-scheduler!"),
)

# A refused flag given its peer's default value asks for nothing pd-router lacks.
PEER_DEFAULTS = {
    "--backend": "sglang", "--history-backend": "memory", "--parser": "legacy",
    "--tokenizer-cache-l0-max-entries": "10000", "--tokenizer-cache-l0-max-memory": "268435456",
    "--tokenizer-cache-l1-max-memory": "52428800", "--history-memory-max-responses": "10000",
    "--history-memory-max-items": "100000", "--history-memory-retention-secs": "86400", "--oracle-pool-min": "1",
    "--oracle-pool-max": "16", "--oracle-pool-timeout-secs": "30", "--postgres-pool-max": "16",
    "--postgres-op-timeout-secs": "5", "--redis-pool-max": "16", "--redis-retention-days": "30",
    "--redis-op-timeout-secs": "5", "--mesh-host": "0.0.0.0", "--mesh-port": "39527",
    "--kv-connector-annotation": "smg.ai/kv-connector",
    "--kv-engine-id-annotation": "smg.ai/kv-engine-id", "--priority-scheduler-default-max-class": "default",
    "--priority-scheduler-tenant-metric-top-n": "32",
}

IGNORED: tuple[tuple[str, str], ...] = (
    ("pd-router never loads a tokenizer: what this asks is what it does", "--disable-tokenizer-autoload!"),
    ("no job queue: POST /workers answers once the worker is registered",
     "--job-queue-capacity --job-queue-concurrency"),
    ("pd-router speaks HTTP/1.1 to the workers, over keep-alive pools (SGLang serves HTTP/1.1)", "--upstream-http2!"),
    ("a PD request is always read whole (bootstrap fields are injected), bounded by --max-payload-size",
     "--max-buffered-request-bytes"),
    ("SMG's cache_aware KV triggers; pd-router's balance guard counts requests",
     "--balance-token-usage-threshold --overload-token-usage-threshold"),
    ("no overload exclusion: admission and the load-aware policies spread load; the rebalancer moves capacity",
     "--worker-overload-waiting-requests --worker-overload-token-usage --worker-overload-protection! "
     "--disable-worker-overload-protection! --worker-overload-shed!"),
    ("SMG's event-driven KV index; pd-router's cache_aware is sgl-router's approximate prefix index over the "
     "prompt text",
     "--kv-index --block-size --cache-boundaries --cache-index --cache-ttl-secs --selection-policy "
     "--selection-accounting-ttl-ms --overlap-decay --selection-temperature"),
    ("SMG's cache warm-up slice for new workers",
     "--worker-warmup-secs --worker-warmup-share --worker-warmup-blocks --worker-warmup-thin-ratio "
     "--worker-warmup-divert-every"),
    ("pd-router judges workers by probes, the breaker and --upstream-idle-timeout-secs",
     "--worker-stall-secs --worker-wedge-secs --worker-stale-secs"),
    ("start-up reads every worker at once", "--worker-startup-delay"),
    ("the Rust gateway's allocator", "--jemalloc-prof-dir"),
    ("pd-router forwards the model field as sent; the servers answer for their model",
     "--model-alias --model-id-from"),
    ("no stored responses or conversations (no Responses API)",
     "--trust-tenant-header! --tenant-header-name --max-background-responses"),
)

IGNORED_DEST = "peer_flags_ignored"


def _flags(spec: str) -> list[tuple[str, int | str | None]]:
    """(flag, argparse nargs) for each word of a table row."""
    out = []
    for word in spec.split():
        mark = word[-1]
        if mark == "!":
            out.append((word[:-1], 0))
        elif mark in "*+":
            out.append((word[:-1], mark))
        else:
            out.append((word, None))
    return out


def refused_flags() -> dict[str, str]:
    """flag -> what pd-router does instead."""
    return {name: note for note, spec in REFUSED for name, _ in _flags(spec)}


def ignored_flags() -> dict[str, str]:
    return {name: note for note, spec in IGNORED for name, _ in _flags(spec)}


class _Refuse(argparse.Action):
    def __init__(self, option_strings, dest, note: str, **kwargs) -> None:
        self.note = note
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = values if isinstance(values, str) else None
        if given is not None and PEER_DEFAULTS.get(option_string) == given:
            return
        if self.nargs == "*" and not values:  # `--worker-urls` with no URL: the peer's default
            return
        parser.exit(2, f"pd-router: error: {option_string}: not supported: {self.note}\n")


class NameGiven(argparse.Action):
    """Takes the flag's value(s) and does nothing with them but name the flag, once, in the namespace's list
    `record_into` (the flags accepted without effect, named in one start-up warning)."""

    def __init__(self, option_strings, dest, record_into: str = IGNORED_DEST, **kwargs) -> None:
        self.record_into = record_into
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        seen = list(getattr(namespace, self.record_into, None) or ())
        if option_string not in seen:
            seen.append(option_string)
        setattr(namespace, self.record_into, seen)


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(**{IGNORED_DEST: []})
    for note, spec in REFUSED:
        for name, nargs in _flags(spec):
            parser.add_argument(name, action=_Refuse, note=note, nargs=nargs, dest=argparse.SUPPRESS,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for _, spec in IGNORED:
        for name, nargs in _flags(spec):
            parser.add_argument(name, action=NameGiven, nargs=nargs, dest=argparse.SUPPRESS,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def ignored_warning(flags: tuple[str, ...]) -> str | None:
    """The start-up line naming the peers' flags given that have no effect here."""
    if not flags:
        return None
    notes = ignored_flags()
    return ("accepted for compatibility, no effect in pd-router: "
            + "; ".join(f"{flag} ({notes.get(flag, 'not used')})" for flag in flags))
