"""The tiers' guard (tests/tiers.py): what each tier forbids raises, and leaving the guard gives it back."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from .tiers import INPROCESS, PROCESS, TIERS, UNIT, TierGuard, TierViolation, tier_of


def test_a_unit_test_may_not_open_a_socket_or_start_a_process():
    before = (socket.socket.bind, socket.socket.connect, subprocess.Popen.__init__)
    with TierGuard(UNIT, "tests/test_planted.py"):
        with socket.socket() as sock, pytest.raises(TierViolation, match="test_planted.py is in the unit tier"):
            sock.bind(("127.0.0.1", 0))
        with socket.socket() as sock, pytest.raises(TierViolation, match="open a network socket"):
            sock.connect(("127.0.0.1", 9))
        with pytest.raises(TierViolation, match="start a process"):
            subprocess.run([sys.executable, "-c", "pass"])
    assert (socket.socket.bind, socket.socket.connect, subprocess.Popen.__init__) == before


def test_an_in_process_test_may_use_sockets_but_not_start_processes():
    with TierGuard(INPROCESS, "tests/test_planted.py"):
        assert socket.socket.bind is not None
        with pytest.raises(TierViolation, match="inprocess tier, which may not start a process"):
            subprocess.Popen([sys.executable, "-c", "pass"])


def test_a_process_test_is_not_held_back():
    before = subprocess.Popen.__init__
    with TierGuard(PROCESS, "tests/test_planted.py"):
        assert subprocess.Popen.__init__ is before


def test_every_named_module_exists_in_a_known_tier():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for module, tier in TIERS.items():
        assert (root / module).is_file(), module
        assert tier in (UNIT, PROCESS), (module, tier)  # in-process is the default: not named
    assert tier_of("tests/no_such_test.py") == INPROCESS
