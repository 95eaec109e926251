//! The manager's steady state allocates nothing of its own: every call, for every built-in
//! policy, on a full cache that has stored twice its size (the criterion bench's workload,
//! `benches/common`), counted by its allocator, which counts this thread's allocations. What
//! a call may allocate is a new request's own state (its seen keys and their index) the first
//! time that request records keys, at most [`PER_NEW_REQUEST`] allocations once per request,
//! and now and then a kept buffer grown to a new length ([`SLACK`] over a run of calls).

#[path = "../benches/common/mod.rs"]
mod common;

use common::{
    allocations, refs, run_finish, run_load, run_lookup, run_lookup_prefix, run_reset, run_store,
    run_store_events, run_store_fail, run_touch, CountingAllocator, Workload,
};
use kvoffload_core::PolicyKind;

/// Allocations a new request's state makes when it first records keys.
const PER_NEW_REQUEST: u64 = 3;

/// Allocations allowed beyond those, over a whole run of [`BATCHES`] calls: a kept buffer
/// taken for a longer list than it was last used for grows once (a thread's kept buffers of one
/// element size serve lists of many lengths). An allocation of the call's own would add at
/// least one a call, [`BATCHES`] in all.
const SLACK: u64 = 4;

/// Batches of 32 keys per counted call.
const BATCHES: usize = 64;

/// Cache size, in chunks.
const CHUNKS: u32 = 1_000;

/// Runs of every call; only the last is checked (the others warm the kept buffers up, and
/// grow the few per-manager scratch lists to their working size, as earlier traffic would).
const ROUNDS: usize = 3;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Take the stats as a scheduler's step does, handing their samples' buffer back (uncounted).
fn step(m: &mut kvoffload_core::Manager) {
    kvoffload_core::recycle::give(m.take_stats().allocation_sizes);
}

/// Run every call [`ROUNDS`] times on `w` (`events`: the same with events on; inputs made
/// outside the counts) and return, per call, the allocations of the last run and the new
/// requests it started.
fn counted_calls(w: &mut Workload, events: &mut Workload) -> Vec<(&'static str, u64, u64)> {
    let mut out = Vec::new();
    for round in 0..ROUNDS {
        let mut got = Vec::new();
        let batches = BATCHES as u64;

        let keys = w.fresh_keys(BATCHES);
        let (keys, mut reqs) = (refs(&keys), w.requests(BATCHES));
        let (n, evicted) = allocations(|| run_store(&mut w.manager, &keys, &mut reqs));
        assert_eq!(evicted, keys.len(), "one eviction per stored key");
        got.push(("store_evict", n, batches));
        step(&mut w.manager);
        w.snapshot();

        let keys = w.fresh_keys(BATCHES);
        let (keys, mut reqs) = (refs(&keys), w.requests(BATCHES));
        w.free_batch();
        let (n, ()) = allocations(|| run_store_fail(&mut w.manager, &keys, &mut reqs));
        got.push(("store_fail", n, batches));
        step(&mut w.manager);
        w.top_up();
        w.snapshot();

        let keys = w.random_resident(BATCHES);
        let (keys, mut reqs) = (refs(&keys), w.requests(BATCHES));
        let (n, ()) = allocations(|| run_load(&mut w.manager, &keys, &mut reqs));
        got.push(("load_complete", n, batches));

        let keys = w.random_resident(BATCHES);
        let keys = refs(&keys);
        let (n, hits) = allocations(|| run_lookup(&w.manager, &keys));
        assert_eq!(hits, keys.len(), "every key hits");
        got.push(("lookup", n, 0));
        let (n, hits) = allocations(|| run_lookup_prefix(&w.manager, &keys));
        assert_eq!(hits, keys.len(), "every key hits");
        got.push(("lookup_prefix", n, 0));
        let (n, ()) = allocations(|| run_touch(&mut w.manager, &keys));
        got.push(("touch", n, 0));

        let mut reqs = w.finish_input(BATCHES);
        let (n, ()) = allocations(|| run_finish(&mut w.manager, &mut reqs));
        got.push(("request_finished", n, 0));

        let keys = events.fresh_keys(BATCHES);
        let (keys, mut reqs) = (refs(&keys), events.requests(BATCHES));
        let (n, queued) = allocations(|| run_store_events(&mut events.manager, &keys, &mut reqs));
        assert_eq!(
            queued,
            2 * BATCHES,
            "an eviction and a store event per batch"
        );
        got.push(("store_events", n, batches));
        step(&mut events.manager);

        if round == ROUNDS - 1 {
            let (n, ()) = allocations(|| run_reset(&mut w.manager));
            got.push(("reset_cache", n, 0));
            out = got;
        }
    }
    out
}

#[test]
fn every_call_allocates_nothing_but_a_new_requests_state() {
    for (name, policy) in PolicyKind::ALL {
        let mut w = Workload::new(policy, CHUNKS);
        let mut events = Workload::with_events(policy, CHUNKS);
        for (call, n, new_requests) in counted_calls(&mut w, &mut events) {
            assert!(
                n <= PER_NEW_REQUEST * new_requests + SLACK,
                "{name}: {call} allocated {n} times for {new_requests} new requests"
            );
        }
        w.manager.validate().expect("the manager's invariants hold");
        events
            .manager
            .validate()
            .expect("the manager's invariants hold");
    }
}

#[test]
fn the_count_sees_an_allocation() {
    // The test above would pass with a counter that never counts: this one would not.
    let (n, v) = allocations(|| std::hint::black_box(vec![1_u8; 100]));
    assert_eq!((n, v.len()), (1, 100));
}
