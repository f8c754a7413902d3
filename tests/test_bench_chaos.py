"""`baton bench chaos --quick`: faults under load, every request classified. A smoke test of the
suite: the figures, from whatever this machine does meanwhile, are not asserted, only the goal
(nothing wrong, lost or hung) and that the run did what it says."""
from __future__ import annotations

import json

import pytest

from baton.bench import main

pytestmark = pytest.mark.slow


def test_chaos_quick_classifies_every_request_and_loses_none(tmp_path, capsys):
    code = main(["chaos", "--quick", "--duration", "15", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    document = json.loads((tmp_path / "chaos.json").read_text())
    outcomes = document["outcomes"]
    assert outcomes["exact"] > 0 and outcomes["cancelled"] > 0
    assert {o: outcomes[o] for o in ("wrong", "lost", "hung")} == {"wrong": 0, "lost": 0, "hung": 0}, \
        document["notable"]
    assert code == 0, document["problems"]
    assert sum(document["faults"].values()) >= 1, document["fault_log"]
    assert set(document["memory"]) == {"router", "prefill", "decode"}
    assert "outcome" in printed and "RSS end MiB" in printed
