"""The performance page's memory-floor section, rendered from a floor run's JSON."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"


@pytest.fixture(scope="module")
def render() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHES))
    try:
        yield importlib.import_module("render")
    finally:
        sys.path.remove(str(BENCHES))


def _floor(pointer: bool) -> dict[str, Any]:
    fl: dict[str, Any] = {
        "window": 32,
        "layout": "adjacent",
        "sizes": [1_000, 10_000_000],
        "minimal_ns": [10.0, 40.0],
        "table_ns": [20.0, 60.0],
    }
    if pointer:
        fl |= {
            "pointer_ns": [12.0, 50.0],
            "single_minimal_ns": [20.0, 200.0],
            "single_pointer_ns": [25.0, 320.0],
        }
    return fl


def test_pointer_model_gets_its_table_and_difference(render: ModuleType) -> None:
    text = "\n".join(render._floor(_floor(pointer=True), None))
    assert "| chunks | minimal | pointer | ratio | one key | one key, pointer | ratio |" in text
    assert "| 10,000,000 | 40.0 | 50.0 | 1.25x | 200 | 320 | 1.60x |" in text
    assert "costs 10.0 ns more a key in a window of 32 and 120 ns more a lookup of one key" in text
    # The pointer paragraph ends before the floor's own conclusion starts a new one.
    assert "lookup of one key.\n\nAt 10,000,000 chunks the accesses alone add 30.0 ns" in text


def test_a_run_without_the_pointer_model_renders_as_before(render: ModuleType) -> None:
    text = "\n".join(render._floor(_floor(pointer=False), None))
    assert "pointer" not in text
    assert "| 10,000,000 | 40.0 | 4.00x | 60.0 | 3.00x |" in text
