//! Criterion benchmarks of the core [`Manager`](kvoffload_core::Manager): the per-key cost of
//! its hot operations, every built-in policy, at 10^3, 10^5 and 10^6 chunks, each on batches of 32
//! 36-byte keys (reported per key through `Throughput::Elements(32)`):
//!
//! - `store_evict`: `prepare_store` of 32 new keys into a full cache of evictable chunks (32
//!   evictions) + `complete_store(success)`: steady-state churn;
//! - `load_complete`: `prepare_load` + `complete_load` of 32 random resident keys;
//! - `lookup`: `lookup` of 32 random resident keys (hits);
//! - `lookup_miss`: `lookup` of 32 keys never stored (misses: what a scheduler's lookup of a
//!   request's blocks meets at the end of its cached prefix);
//! - `touch`: `touch` of 32 random resident keys;
//! - `request_finished`: `on_request_finished` of a request that loaded 32 keys, with positions.
//!
//! The workload is in `common`; filling the cache and making inputs happen outside the timed
//! code. On 64-bit Linux the timed code is measured in this thread's CPU time rather than wall
//! time, so that on a busy machine the time slices other processes get are not counted (cache
//! pollution by them still is). After criterion's report a table gives ns/key per op, policy and
//! size, and the ratio of the 10^6-chunk to the 10^3-chunk cost.
//!
//! Run `cargo bench -p kvoffload-core --bench manager` (two to three minutes; criterion's
//! `--measurement-time`, `--sample-size` and filters apply). Under `cargo test --benches` only
//! the smallest size runs, once, as a smoke test. For instruction counts, see
//! `examples/callgrind_ops.rs`.

mod common;

use common::{refs, run_finish, run_load, run_lookup, run_store, run_touch, Workload, BATCH};
use criterion::{BenchmarkId, Criterion, Throughput};
use kvoffload_core::PolicyKind;
use std::time::Duration;

/// Cache sizes, in chunks.
const SIZES: [u32; 3] = [1_000, 100_000, 1_000_000];
/// Samples per benchmark (criterion's minimum is 10).
const SAMPLES: usize = 20;
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
}

impl Op {
    /// In run order: stores first, since they change the resident set the others draw from.
    const ALL: [Op; 6] = [
        Op::Store,
        Op::Load,
        Op::Lookup,
        Op::LookupMiss,
        Op::Touch,
        Op::Finish,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::Store => "store_evict",
            Op::Load => "load_complete",
            Op::Lookup => "lookup",
            Op::LookupMiss => "lookup_miss",
            Op::Touch => "touch",
            Op::Finish => "request_finished",
        }
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

/// Make the inputs of `batches` batches of `op`, then time just the operation on them.
fn time_block(w: &mut Workload, op: Op, batches: usize) -> Duration {
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
    }
}

/// Benchmark `op` on `w` as `<op>/<policy>/<size>`; returns the median ns/key of the
/// measurement samples (`None` when the benchmark was filtered out).
fn bench_op(
    c: &mut Criterion,
    w: &mut Workload,
    op: Op,
    policy: PolicyKind,
    size: u32,
) -> Option<f64> {
    // (iterations, time) of every call, warm-up included; at the default sample size the last
    // `SAMPLES` calls are the measurement samples.
    let mut calls: Vec<(u64, Duration)> = Vec::new();
    let mut group = c.benchmark_group(op.name());
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function(BenchmarkId::new(policy_name(policy), size), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(BLOCK);
                total += time_block(w, op, n);
                left -= n;
            }
            calls.push((iters, total));
            total
        });
    });
    group.finish();
    let samples = &calls[calls.len().saturating_sub(SAMPLES)..];
    let mut per_key: Vec<f64> = samples
        .iter()
        .map(|&(iters, t)| t.as_secs_f64() * 1e9 / (iters as f64 * BATCH as f64))
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
            "{:<18}{:<6}{} {:>8}",
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
                    "{:<18}{:<6}{} {:>8}",
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
            for op in Op::ALL {
                if let Some(ns) = bench_op(&mut c, &mut w, op, policy, size) {
                    results.0.push((op, policy, size, ns));
                }
                if op == Op::Store {
                    w.snapshot();
                }
            }
            w.manager.validate().expect("the manager's invariants hold");
        }
    }
    c.final_summary();
    results.print(sizes);
}
