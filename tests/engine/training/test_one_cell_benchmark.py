"""`benchmarks.tiny_chat_one_cell` labels a run by what it trained on, read back from its logged config."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks.tiny_chat_one_cell import cell_of, one_cell_config
from engine.training.train import TrainConfig


@pytest.mark.parametrize("family,thinking", [("add", False), ("reverse", True)])
def test_a_one_cell_run_is_read_back_as_its_cell(family, thinking):
    cfg = json.loads(json.dumps(asdict(one_cell_config(family, thinking, steps=10, hidden=64, seed=0))))
    assert cfg["family_weights"] == {family: 1.0}
    assert cell_of(cfg) == (family, thinking)


def test_the_shipped_recipe_is_not_taken_for_one_cell():
    with pytest.raises((SystemExit, ValueError)):
        cell_of(json.loads(json.dumps(asdict(TrainConfig()))))
