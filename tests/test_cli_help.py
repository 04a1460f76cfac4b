"""`pd-router --help` in sections: no flag lost, each option shown once under one section, sections short."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from router.server.cli import build_parser
from router.server.cli_groups import SECTIONS, with_other_names

# Every option string the parser accepted before --help was split into sections (peers' refused and ignored
# flags and the retired ones included): a flag may be added, never dropped.
ACCEPTED_BEFORE = Path(__file__).resolve().parent / "fixtures" / "cli_flags.txt"
HELP_COLUMNS = 80  # a pipe's and a default terminal's width: argparse wraps to it
SECTION_MAX_LINES = 40


def accepted_flags() -> set[str]:
    return {name for action in build_parser()._actions for name in action.option_strings}


def shown_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS]


@pytest.fixture(scope="module")
def help_text() -> str:
    env = {**os.environ, "COLUMNS": str(HELP_COLUMNS)}
    proc = subprocess.run([sys.executable, "-m", "router", "--help"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def sections_of(text: str) -> dict[str, list[str]]:
    """heading -> its lines (heading included): a heading is a line at column 0 ending in ':'."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            current = line[:-1]
            sections[current] = []
        if current is not None:
            sections[current].append(line)
    return {title: lines[:-1] if lines and not lines[-1] else lines for title, lines in sections.items()}


def test_no_flag_accepted_before_is_lost():
    before = set(ACCEPTED_BEFORE.read_text().split())
    assert len(before) > 250
    lost = before - accepted_flags()
    assert not lost, f"flags the command line no longer accepts: {sorted(lost)}"


def test_every_shown_option_is_in_a_named_section():
    parser = build_parser()
    titles = {title for title, _ in SECTIONS}
    unsectioned = [a.option_strings[0] for group in parser._action_groups if group.title not in titles
                   for a in group._group_actions if a.help != argparse.SUPPRESS]
    assert unsectioned == ["-h"], \
        f"give these a section in router/server/cli_groups.py (BY_FLAG or BY_FIELD_GROUP): {unsectioned}"


def test_help_shows_the_sections_in_order_each_short(help_text):
    sections = sections_of(help_text)
    assert list(sections) == ["options"] + [title for title, _ in SECTIONS]
    too_long = {title: len(lines) for title, lines in sections.items() if len(lines) >= SECTION_MAX_LINES}
    assert not too_long, f"sections of {SECTION_MAX_LINES} lines or more at {HELP_COLUMNS} columns: {too_long}"


def test_each_option_is_one_entry_and_its_other_names_are_in_its_help(help_text):
    parser = build_parser()
    entries = re.findall(r"^  (-\S+)", help_text, re.M)
    assert sorted(entries) == sorted(a.option_strings[0] for a in shown_actions(parser))
    flat = " ".join(help_text.split())
    for action in shown_actions(parser):
        for alias in action.option_strings[1:]:
            # argparse may break a long name at its hyphens: compare with the line breaks taken out
            assert alias in flat.replace("- ", "-"), alias
    # the peers' spellings are not entries of their own
    assert "--request-timeout-secs" in accepted_flags() and "--request-timeout-secs" not in entries


def test_the_other_names_go_before_the_default():
    assert with_other_names("deadline (default: 30)", ["--timeout", "--request-timeout-secs"]) == \
        "deadline (also --request-timeout-secs) (default: 30)"
    assert with_other_names("(default: 1)", ["--a", "--b"]) == "(also --b) (default: 1)"
    assert with_other_names(None, ["--a", "--b"]) is None
    assert with_other_names("x", ["--a"]) == "x"


def test_the_usage_line_is_one_line(help_text):
    usage = help_text.split("\n\n", 1)[0]
    assert usage.count("\n") == 0 and usage.startswith("usage: pd-router ")
