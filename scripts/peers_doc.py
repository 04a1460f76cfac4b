"""Write docs/PEERS.md's flag table from the peers' own parsers (tests/fixtures/peers/*.json, dumped by
scripts/peer_flags.py) and pd-router's handling of each flag (tests/fixtures/peers/pd_router.json).

    python scripts/peers_doc.py          # rewrite the table between the markers
    python scripts/peers_doc.py --check  # exit 1 if the file is not what this would write

The table has one row per argparse action of the peers (sglang-router 0.3.2, smg 1.13.0), SMG's order first,
then what only sgl-router has; pd-router's column names the flag it answers to and its default today.
"""

from __future__ import annotations

import argparse

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "peers"
DOC = ROOT / "docs" / "PEERS.md"
BEGIN, END = "<!-- flags:begin (scripts/peers_doc.py) -->", "<!-- flags:end -->"
PEERS = {"S": "sglang_router-0.3.2", "M": "smg-1.13.0"}
CLASS_WORDS = {
    "same": "has it", "alias": "alias", "build": "to build", "ignored": "accepted, no effect",
    "refuse": "exit 2",
}


def load_peers() -> dict[str, list[dict]]:
    return {key: json.loads((FIXTURES / f"{name}.json").read_text())["actions"] for key, name in PEERS.items()}


def load_handling() -> dict[str, dict]:
    return json.loads((FIXTURES / "pd_router.json").read_text())


def pd_router_defaults() -> dict[str, str]:
    """pd-router's own flags -> its default as shown ("" for a switch), from its parser (imported only here)."""
    sys.path.insert(0, str(ROOT))
    from router.server.cli import build_parser

    return {s: "" if a.nargs == 0 else _value(a.default) for a in build_parser()._actions for s in a.option_strings
            if a.help != argparse.SUPPRESS}  # the peers' refused and ignored flags are not pd-router settings


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _meaning(help_text: str, limit: int = 150) -> str:
    text = " ".join(help_text.split())
    cut = text.find(". ")
    if 0 < cut < limit:
        text = text[:cut + 1]
    elif len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return _cell(text)


def _value(value) -> str:
    if value is None or value == "SUPPRESS":
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "[]"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"{value:.0f}"
    return f"`{value}`"


def _shape(row: dict) -> str:
    if row["action"] in ("StoreTrue", "StoreFalse"):
        shape = "switch"
    elif row["action"] == "BooleanOptional":
        shape = "switch (--no- form)"
    else:
        nargs = row["nargs"]
        shape = {None: "1 value", "*": "0+ values", "+": "1+ values", "?": "0-1 value"}.get(nargs, f"{nargs} values")
        if row["action"] == "Append":
            shape += ", repeatable"
        elif row["action"] == "Extend":
            shape += ", repeatable (extends)"
        if row.get("type") not in (None, "str"):
            shape += f" ({row['type']})"
    if row["choices"]:
        shape += ": " + ", ".join(f"`{c}`" for c in row["choices"])
    return shape


def rows() -> list[dict]:
    """One entry per peer action, merged across the peers by its first option string."""
    merged: dict[str, dict] = {}
    for key in ("M", "S"):
        for action in load_peers()[key]:
            entry = merged.setdefault(action["flags"][0], {"flags": [], "by": {}})
            for flag in action["flags"]:
                if flag not in entry["flags"]:
                    entry["flags"].append(flag)
            entry["by"][key] = action
    return list(merged.values())


def pd_router_cell(flags: list[str], handling: dict, ours: dict) -> str:
    parts = []
    for flag in flags:
        h = handling[flag]
        ours_flag = h["pd_router"] or (flag if flag in ours else None)
        text = f"**{CLASS_WORDS[h['class']]}**"
        if ours_flag and ours_flag in ours:
            text += f" `{ours_flag}`" + (f" = {ours[ours_flag]}" if ours[ours_flag] else "")
        elif ours_flag:
            text += f" as `{ours_flag}`"
        if h["note"]:
            text += f": {h['note']}"
        parts.append((flag, text))
    if len({t for _, t in parts}) == 1:
        return _cell(parts[0][1])
    return _cell("; ".join(f"{f}: {t}" for f, t in parts))


def table() -> str:
    handling, ours = load_handling(), pd_router_defaults()
    out = ["| flag | in | takes | default (sgl-router / SMG) | the peer's meaning | pd-router |",
           "|---|---|---|---|---|---|"]
    counts: dict[str, int] = {}
    for entry in rows():
        by = entry["by"]
        main = by.get("M") or by["S"]
        peers = "+".join(k for k in ("S", "M") if k in by).replace("S", "sgl-router").replace("M", "SMG")
        defaults = " / ".join(_value(by[k]["default"]) if k in by else "n/a" for k in ("S", "M"))
        shapes = {_shape(by[k]) for k in by}
        shape = " / ".join(_cell(s) for s in (_shape(by[k]) for k in ("S", "M") if k in by)) if len(shapes) > 1 \
            else _cell(shapes.pop())
        for flag in entry["flags"]:
            counts[handling[flag]["class"]] = counts.get(handling[flag]["class"], 0) + 1
        out.append(f"| {' '.join(f'`{f}`' for f in entry['flags'])} | {peers} | {shape} | {defaults} | "
                   f"{_meaning(main['help'])} | {pd_router_cell(entry['flags'], handling, ours)} |")
    total = sum(counts.values())
    summary = ", ".join(f"{counts[c]} {CLASS_WORDS[c]}" for c in CLASS_WORDS if c in counts)
    return f"{total} option strings: {summary}.\n\n" + "\n".join(out)


def render(current: str) -> str:
    head, _, rest = current.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print(f"{DOC} is out of date: run python scripts/peers_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
