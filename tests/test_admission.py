"""The TinyLFU admission filter (``admission="tinylfu"``) beside vLLM's bounded tracker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import _driver
from kvoffload import InvalidArgumentError, ReqContext, make_offload_key
from kvoffload.reference.sketch import FrequencySketch, sketch_hash

KEYS = [make_offload_key(i.to_bytes(2, "big"), 0) for i in range(16)]


def test_sketch_hash_is_the_rust_one() -> None:
    # The same constant is pinned in rust/kvoffload-core/src/sketch.rs.
    assert sketch_hash(b"abc") == 0xFB3DC2A042BA372A


def test_sketch_saturates_and_ages() -> None:
    s = FrequencySketch(threshold=3, width=16)
    h = sketch_hash(b"a")
    for _ in range(20):
        s.increment(h)
    assert s.estimate(h) == 15
    for i in range(200):
        s.increment(sketch_hash(bytes([i])))
    assert s.would_admit_next(h, False)
    s.age_if_due()
    assert s.estimate(h) == 7


def test_a_due_halving_counts_in_the_next_admission() -> None:
    s = FrequencySketch(threshold=3, width=16)
    h = sketch_hash(b"a")
    for _ in range(4):
        s.increment(h)
    assert s.would_admit_next(h, False)  # 4 >= 3, no halving due
    g = sketch_hash(b"b")  # one other key, counted until a halving is due
    while s.samples < s.sample_size:
        s.increment(g)
    estimate = s.estimate(h)
    assert estimate >> 1 < 3 <= estimate  # a halving decides the answer
    assert not s.would_admit_next(h, False)  # halved: 2 < 3
    assert s.would_admit_next(h, True)  # halved, and this offer counts: 3
    s.age_if_due()
    assert s.estimate(h) == estimate >> 1
    assert not s.would_admit_next(h, False)


def test_an_offer_counts_once_per_request(make_manager: Callable[..., Any]) -> None:
    m = make_manager(8, store_threshold=2, admission="tinylfu")
    a = ReqContext(req_id="a")
    for _ in range(3):  # one request offering the same key again and again: counted once
        out = m.prepare_store(KEYS[:1], a)
        assert out is not None
        assert out.keys_to_store == []
    out = m.prepare_store(KEYS[:1], ReqContext(req_id="b"))  # a second request: admitted
    assert out is not None
    assert out.keys_to_store == KEYS[:1]
    m.check_invariants()


@pytest.mark.parametrize("admission", ["tracker", "tinylfu"])
def test_offers_larger_than_the_tracker(make_manager: Callable[..., Any], admission: str) -> None:
    # Ten keys through a tracker of four: the tracker keeps counts for four of them only, so the
    # second request stores four; the sketch forgets nothing and admits all ten.
    m = make_manager(16, store_threshold=2, max_tracker_size=4, admission=admission)
    m.prepare_store(KEYS[:10], ReqContext(req_id="a"))
    out = m.prepare_store(KEYS[:10], ReqContext(req_id="b"))
    assert out is not None
    assert len(out.keys_to_store) == (10 if admission == "tinylfu" else 4)


def test_unknown_admission_raises(make_manager: Callable[..., Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        make_manager(4, store_threshold=2, admission="lfu")


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "lfu"])
@pytest.mark.parametrize("threshold", [2, 3])
def test_rust_and_reference_agree_with_the_sketch(policy: str, threshold: int) -> None:
    specs = [_driver.impl_spec(n) for n in ("rust", "reference")]
    for seed in range(25):
        result = _driver.run_sequence(specs, policy, threshold, seed, 300, admission="tinylfu")
        assert result.mismatch is None, result.mismatch
