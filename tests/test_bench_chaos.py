"""`baton bench chaos --quick`: faults under load, every request classified (a smoke test: the
figures, from whatever this machine does meanwhile, are not asserted beyond 'nothing wrong')."""
from __future__ import annotations

import json

import pytest

from baton.bench import main

pytestmark = pytest.mark.slow


def test_chaos_quick_classifies_every_request_and_finds_none_wrong(tmp_path, capsys):
    assert main(["chaos", "--quick", "--duration", "25", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    document = json.loads((tmp_path / "chaos.json").read_text())
    outcomes = document["outcomes"]
    assert outcomes.get("exact", 0) > 0
    assert outcomes.get("wrong", 0) == 0, document["problems"]
    assert sum(document["faults"].values()) >= 1
    assert set(document["memory"]) == {"router", "prefill", "decode"}
    assert "outcome" in printed and "RSS end MiB" in printed
