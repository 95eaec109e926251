//! Runs each operation of the `manager` bench a fixed number of times on one cache, for stable
//! instruction counts under callgrind, and prints each operation's heap allocations per key.
//! Usage: `callgrind_ops <lru|arc|fifo|sieve> <num_chunks> <batches>`.
//!
//! ```text
//! cargo build --release -p kvoffload-core --example callgrind_ops
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*::run_*' \
//!     target/release/examples/callgrind_ops arc 1000000 1000
//! callgrind_annotate --inclusive=yes callgrind.out.<pid> | grep run_
//! ```
//!
//! Each `run_*` function handles `batches` batches of 32 keys, so its inclusive Ir divided by
//! `32 * batches` is the instruction count per key; `run_reset` resets the full cache once, so
//! its Ir divided by `num_chunks` is the count per chunk. The cache fill and the inputs are made
//! outside the `run_*` functions and so are not counted. `run_store_events` runs on a second
//! manager, with events on.

#[path = "../benches/common/mod.rs"]
mod common;

use common::{
    allocations, refs, run_finish, run_load, run_lookup, run_lookup_prefix, run_reset, run_store,
    run_store_events, run_store_fail, run_touch, CountingAllocator, Workload, BATCH,
};
use kvoffload_core::PolicyKind;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Run `op` and print its allocations per key (`keys` keys in all).
fn counted<T>(name: &str, keys: usize, op: impl FnOnce() -> T) -> T {
    let (n, out) = allocations(op);
    println!("{name:<8} {:.3} allocations/key", n as f64 / keys as f64);
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: callgrind_ops <lru|arc|fifo|sieve> <num_chunks> <batches>";
    assert!(args.len() == 4, "{usage}");
    let policy = PolicyKind::from_name(&args[1]).expect(usage);
    let size: u32 = args[2].parse().expect(usage);
    let batches: usize = args[3].parse().expect(usage);
    let n = batches * BATCH;

    let mut w = Workload::new(policy, size);
    println!(
        "{} chunks={size} batches={batches} keys_per_op={n}",
        args[1]
    );

    let keys = w.fresh_keys(batches);
    let (keys, mut reqs) = (refs(&keys), w.requests(batches));
    let evicted = counted("store", n, || run_store(&mut w.manager, &keys, &mut reqs));
    assert_eq!(evicted, n, "one eviction per stored key");
    w.snapshot();

    let keys = w.random_resident(batches);
    let (keys, mut reqs) = (refs(&keys), w.requests(batches));
    counted("load", n, || run_load(&mut w.manager, &keys, &mut reqs));

    let keys = w.random_resident(batches);
    let keys = refs(&keys);
    let hits = counted("lookup", n, || run_lookup(&w.manager, &keys));
    assert_eq!(hits, n, "every key hits");

    let keys = w.random_resident(batches);
    let keys = refs(&keys);
    counted("touch", n, || run_touch(&mut w.manager, &keys));

    let mut reqs = w.finish_input(batches);
    counted("finish", n, || run_finish(&mut w.manager, &mut reqs));

    let keys = w.fresh_keys(batches);
    let (keys, mut reqs) = (refs(&keys), w.requests(batches));
    w.free_batch();
    counted("fail", n, || {
        run_store_fail(&mut w.manager, &keys, &mut reqs);
    });
    w.top_up();
    w.snapshot();

    let keys = w.random_resident(batches);
    let keys = refs(&keys);
    let hits = counted("prefix", n, || run_lookup_prefix(&w.manager, &keys));
    assert_eq!(hits, n, "every key hits");

    counted("reset", size as usize, || run_reset(&mut w.manager));

    let mut e = Workload::with_events(policy, size);
    let keys = e.fresh_keys(batches);
    let (keys, mut reqs) = (refs(&keys), e.requests(batches));
    let events = counted("events", n, || {
        run_store_events(&mut e.manager, &keys, &mut reqs)
    });
    assert_eq!(
        events,
        2 * batches,
        "an eviction and a store event per batch"
    );
}
