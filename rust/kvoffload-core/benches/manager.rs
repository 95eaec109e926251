//! Criterion benchmarks of the core [`Manager`](kvoffload_core::Manager): the per-key cost of
//! every call, every built-in policy, at 10^3, 10^5 and 10^6 chunks, on batches of 32 36-byte
//! keys (reported per key through `Throughput::Elements(32)`; the reset per chunk):
//!
//! - `store_evict`: `prepare_store` of 32 new keys into a full cache of evictable chunks (32
//!   evictions) + `complete_store(success)`: steady-state churn;
//! - `load_complete`: `prepare_load` + `complete_load` of 32 random resident keys;
//! - `lookup`: `lookup` of 32 random resident keys (hits);
//! - `lookup_miss`: `lookup` of 32 keys never stored (misses: what a scheduler's lookup of a
//!   request's blocks meets at the end of its cached prefix);
//! - `touch`: `touch` of 32 random resident keys;
//! - `request_finished`: `on_request_finished` of a request that loaded 32 keys, with positions;
//! - `store_fail`: `prepare_store` of 32 new keys into a full cache with 32 free chunks (a failed
//!   store left them) + `complete_store(failure)`, which frees them again;
//! - `lookup_prefix`: `lookup_prefix` of 32 random resident keys (every key a hit);
//! - `store_events`: `store_evict` on a manager with events on, set up as the Python binding
//!   sets it up (events name chunks), each batch's two events drained after its store;
//! - `reset_cache`: `reset_cache` of a full cache, reported per resident chunk (each sample
//!   refills the cache, outside the timed code, so this op runs fewer, shorter samples).
//!
//! The workload is in `common`; filling the cache and making inputs happen outside the timed
//! code. On 64-bit Linux the timed code is measured in this thread's CPU time rather than wall
//! time, so that on a busy machine the time slices other processes get are not counted (cache
//! pollution by them still is). After criterion's report a table gives ns/key per op, policy and
//! size, and the ratio of the 10^6-chunk to the 10^3-chunk cost.
//!
//! Run `cargo bench -p kvoffload-core --bench manager` (about ten minutes; criterion's
//! `--measurement-time`, `--sample-size` and filters apply). Under `cargo test --benches` only
//! the smallest size runs, once, as a smoke test. For instruction counts, see
//! `examples/callgrind_ops.rs` and `benches/callgrind_core.py` at the repository root.

mod common;

use common::{
    refs, run_finish, run_load, run_lookup, run_lookup_prefix, run_reset, run_store,
    run_store_events, run_store_fail, run_touch, Workload, BATCH,
};
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use kvoffload_core::PolicyKind;
use std::time::Duration;

/// Cache sizes, in chunks.
const SIZES: [u32; 3] = [1_000, 100_000, 1_000_000];
/// Samples per benchmark (criterion's minimum is 10).
const SAMPLES: usize = 20;
/// Samples of `reset_cache`, each of which refills the cache outside the timed code.
const RESET_SAMPLES: usize = 10;
/// Batches per timed block: inputs of one block are made, then the block is timed.
const BLOCK: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Store,
    Load,
    Lookup,
    LookupMiss,
    Touch,
    Finish,
    StoreFail,
    LookupPrefix,
    StoreEvents,
    Reset,
}

impl Op {
    /// In run order: stores first, since they change the resident set the others draw from;
    /// the reset last, since it leaves a cache of another history (ARC's ghosts are gone).
    const ALL: [Op; 10] = [
        Op::Store,
        Op::StoreFail,
        Op::Load,
        Op::Lookup,
        Op::LookupMiss,
        Op::LookupPrefix,
        Op::Touch,
        Op::Finish,
        Op::StoreEvents,
        Op::Reset,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::Store => "store_evict",
            Op::Load => "load_complete",
            Op::Lookup => "lookup",
            Op::LookupMiss => "lookup_miss",
            Op::Touch => "touch",
            Op::Finish => "request_finished",
            Op::StoreFail => "store_fail",
            Op::LookupPrefix => "lookup_prefix",
            Op::StoreEvents => "store_events",
            Op::Reset => "reset_cache",
        }
    }

    /// Keys (chunks, for the reset) an iteration handles, on a cache of `size` chunks.
    fn keys(self, size: u32) -> usize {
        match self {
            Op::Reset => size as usize,
            _ => BATCH,
        }
    }

    /// Whether the op changes the resident keys (the others draw from a snapshot of them).
    fn changes_resident(self) -> bool {
        matches!(self, Op::Store | Op::StoreFail)
    }
}

fn policy_name(policy: PolicyKind) -> &'static str {
    policy.name()
}

/// The clock of the timed code: this thread's CPU time on 64-bit Linux.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn now() -> Duration {
    /// `struct timespec` of 64-bit Linux.
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `ts` is a live, writable `timespec` of the layout libc's `clock_gettime` expects on
    // 64-bit Linux, and the call writes nothing else.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.sec as u64, ts.nsec as u32)
}

/// The clock of the timed code: wall time where thread CPU time is not wired up.
#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn now() -> Duration {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed()
}

/// Time on [`now`]'s clock since `start`.
fn elapsed_since(start: Duration) -> Duration {
    now().saturating_sub(start)
}

/// Make the inputs of `batches` batches of `op`, then time just the operation on them
/// (`events`: the workload with events on, for [`Op::StoreEvents`]).
fn time_block(w: &mut Workload, events: &mut Workload, op: Op, batches: usize) -> Duration {
    match op {
        Op::Store => {
            let keys = w.fresh_keys(batches);
            let keys = refs(&keys);
            let mut reqs = w.requests(batches);
            let start = now();
            let evicted = run_store(&mut w.manager, &keys, &mut reqs);
            let elapsed = elapsed_since(start);
            assert_eq!(evicted, keys.len(), "one eviction per stored key");
            elapsed
        }
        Op::Load => {
            let keys = w.random_resident(batches);
            let keys = refs(&keys);
            let mut reqs = w.requests(batches);
            let start = now();
            run_load(&mut w.manager, &keys, &mut reqs);
            elapsed_since(start)
        }
        Op::Lookup | Op::LookupMiss => {
            // Resident keys (every one hits) or keys never stored (none does).
            let hit = op == Op::Lookup;
            let keys = if hit {
                w.random_resident(batches)
            } else {
                w.fresh_keys(batches)
            };
            let keys = refs(&keys);
            let start = now();
            let hits = run_lookup(&w.manager, &keys);
            let elapsed = elapsed_since(start);
            assert_eq!(hits, if hit { keys.len() } else { 0 }, "hits of {op:?}");
            elapsed
        }
        Op::Touch => {
            let keys = w.random_resident(batches);
            let keys = refs(&keys);
            let start = now();
            run_touch(&mut w.manager, &keys);
            elapsed_since(start)
        }
        Op::Finish => {
            let mut reqs = w.finish_input(batches);
            let start = now();
            run_finish(&mut w.manager, &mut reqs);
            elapsed_since(start)
        }
        Op::StoreFail => {
            let keys = w.fresh_keys(batches);
            let keys = refs(&keys);
            let mut reqs = w.requests(batches);
            w.free_batch();
            let start = now();
            run_store_fail(&mut w.manager, &keys, &mut reqs);
            let elapsed = elapsed_since(start);
            w.top_up();
            elapsed
        }
        Op::LookupPrefix => {
            let keys = w.random_resident(batches);
            let keys = refs(&keys);
            let start = now();
            let hits = run_lookup_prefix(&w.manager, &keys);
            let elapsed = elapsed_since(start);
            assert_eq!(hits, keys.len(), "every key hits");
            elapsed
        }
        Op::StoreEvents => {
            let keys = events.fresh_keys(batches);
            let keys = refs(&keys);
            let mut reqs = events.requests(batches);
            let start = now();
            let n = run_store_events(&mut events.manager, &keys, &mut reqs);
            let elapsed = elapsed_since(start);
            assert_eq!(n, 2 * batches, "an eviction and a store event per batch");
            elapsed
        }
        Op::Reset => {
            let mut total = Duration::ZERO;
            for _ in 0..batches {
                w.refill();
                let start = now();
                run_reset(&mut w.manager);
                total += elapsed_since(start);
            }
            total
        }
    }
}

/// Benchmark `op` on `w` as `<op>/<policy>/<size>`; returns the median ns/key of the
/// measurement samples (`None` when the benchmark was filtered out).
fn bench_op(
    c: &mut Criterion,
    w: &mut Workload,
    events: &mut Workload,
    op: Op,
    policy: PolicyKind,
    size: u32,
) -> Option<f64> {
    // (iterations, time) of every call, warm-up included; at the default sample size the last
    // `SAMPLES` calls are the measurement samples.
    let mut calls: Vec<(u64, Duration)> = Vec::new();
    let keys = op.keys(size);
    let mut group = c.benchmark_group(op.name());
    group.throughput(Throughput::Elements(keys as u64));
    if op == Op::Reset {
        // Every iteration refills the cache outside the timed code (about a hundred times the
        // reset's own time): few, equal samples keep the wall time in bounds.
        group
            .sampling_mode(SamplingMode::Flat)
            .sample_size(RESET_SAMPLES)
            .warm_up_time(Duration::from_millis(20))
            .measurement_time(Duration::from_millis(50));
    }
    group.bench_function(BenchmarkId::new(policy_name(policy), size), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(BLOCK);
                total += time_block(w, events, op, n);
                left -= n;
            }
            calls.push((iters, total));
            total
        });
    });
    group.finish();
    let wanted = if op == Op::Reset {
        RESET_SAMPLES
    } else {
        SAMPLES
    };
    let samples = &calls[calls.len().saturating_sub(wanted)..];
    let mut per_key: Vec<f64> = samples
        .iter()
        .map(|&(iters, t)| t.as_secs_f64() * 1e9 / (iters as f64 * keys as f64))
        .collect();
    per_key.sort_by(f64::total_cmp);
    per_key.get(per_key.len() / 2).copied()
}

/// ns/key of every (op, policy, size) that ran.
#[derive(Default)]
struct Results(Vec<(Op, PolicyKind, u32, f64)>);

impl Results {
    fn get(&self, op: Op, policy: PolicyKind, size: u32) -> Option<f64> {
        self.0
            .iter()
            .find(|r| (r.0, r.1, r.2) == (op, policy, size))
            .map(|r| r.3)
    }

    /// The ns/key table and the 10^6 / 10^3 ratios.
    fn print(&self, sizes: &[u32]) {
        if self.0.is_empty() {
            return;
        }
        let cell = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
        println!(
            "\nns/key (median of samples); ratio = cost at the largest size / at the smallest"
        );
        let header: Vec<String> = sizes.iter().map(|s| format!("{s:>10}")).collect();
        println!(
            "{:<18}{:<10}{} {:>8}",
            "op",
            "policy",
            header.join(""),
            "ratio"
        );
        for op in Op::ALL {
            for (_, policy) in PolicyKind::ALL {
                let row: Vec<Option<f64>> =
                    sizes.iter().map(|&s| self.get(op, policy, s)).collect();
                if row.iter().all(Option::is_none) {
                    continue;
                }
                let cells: Vec<String> = row.iter().map(|&v| format!("{:>10}", cell(v))).collect();
                let ratio = match (row.first(), row.last()) {
                    (Some(Some(lo)), Some(Some(hi))) if sizes.len() > 1 => {
                        format!("{:.2}x", hi / lo)
                    }
                    _ => "-".to_owned(),
                };
                println!(
                    "{:<18}{:<10}{} {:>8}",
                    op.name(),
                    policy_name(policy),
                    cells.join(""),
                    ratio
                );
            }
        }
    }
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_millis(1500))
        .nresamples(10_000)
        .configure_from_args();
    // `cargo bench` passes --bench; without it criterion only smoke-tests each benchmark.
    let sizes: &[u32] = if std::env::args().any(|a| a == "--bench") {
        &SIZES
    } else {
        &SIZES[..1]
    };
    let mut results = Results::default();
    for (_, policy) in PolicyKind::ALL {
        for &size in sizes {
            let mut w = Workload::new(policy, size);
            let mut events = Workload::with_events(policy, size);
            for op in Op::ALL {
                if let Some(ns) = bench_op(&mut c, &mut w, &mut events, op, policy, size) {
                    results.0.push((op, policy, size, ns));
                }
                if op.changes_resident() {
                    w.snapshot();
                }
            }
            w.manager.validate().expect("the manager's invariants hold");
            events
                .manager
                .validate()
                .expect("the manager's invariants hold");
        }
    }
    c.final_summary();
    results.print(sizes);
}
