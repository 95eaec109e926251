"""ARC past the size where its ghost lists read ahead (32,768 ghost entries): the Rust manager
against the reference over stores that evict, offers of keys that are ghosts (in batches and
alone), touches and finished requests."""

from __future__ import annotations

import random

import kvoffload
import kvoffload.reference as ref

#: Chunks: enough that B1 alone passes the read-ahead size once the cache has turned over.
CHUNKS = 33_000


def _answer(out: object) -> object:
    if out is None:
        return None
    return (
        list(out.keys_to_store),  # type: ignore[attr-defined]
        list(out.evicted_keys),  # type: ignore[attr-defined]
        [int(c) for c in out.store_spec.chunk_ids],  # type: ignore[attr-defined]
    )


def test_large_arc_matches_the_reference() -> None:
    rng = random.Random(7)
    keys = [rng.randbytes(32) + bytes(4) for _ in range(2 * CHUNKS)]
    managers: list[kvoffload.CPUOffloadingManager | ref.CPUOffloadingManager] = [
        kvoffload.CPUOffloadingManager(CHUNKS, cache_policy="arc"),
        ref.CPUOffloadingManager(CHUNKS, cache_policy="arc"),
    ]
    answers: list[list[object]] = [[], []]
    rounds = 3 * CHUNKS // 32
    for r in range(rounds):
        if r < 2 * CHUNKS // 32 or r % 4:
            start = (r * 32) % (len(keys) - 32)  # fill, evict it all, then offer ghosts
            batch = keys[start : start + 32]
        else:
            batch = rng.sample(keys, 32)
        for i, m in enumerate(managers):
            ctx = kvoffload.ReqContext(f"req-{r}")
            out = m.prepare_store(batch, ctx)
            answers[i].append(_answer(out))
            if out is not None:
                m.complete_store(list(out.keys_to_store), ctx)
            if r % 7 == 0:
                answers[i].append(m.touch(batch[::3], ctx))
            m.on_request_finished(ctx)
    assert answers[0] == answers[1]
    state = managers[0].policy_state()
    assert len(state["b1"]) + len(state["b2"]) >= 32_768  # past the read-ahead size
    assert state == managers[1].policy_state()
    managers[0].check_invariants()
