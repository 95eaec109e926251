//! The fuzz driver: a byte string read as a manager configuration and a sequence of calls, legal
//! and illegal, run on one [`Manager`] with every invariant checked after each call.
//!
//! Shared by the libFuzzer target (`fuzz_targets/ops.rs`, `cargo fuzz`) and the stable-Rust
//! seeded loop (`examples/fuzz_ops.rs`, `tests/fuzz_ops.rs`). After every call:
//! - `Manager::validate()` holds;
//! - free + pending + ready + pinned = handed-out chunk ids <= capacity, and no chunk id is free
//!   and resident, free twice or owned by two keys;
//! - each resident key's ref count is what the driver's own model says: -1 while its store is in
//!   flight, else the number of loads prepared and not completed; a pinned or pending key is
//!   never evicted;
//! - a call that returns `Err` changed nothing (resident keys, pool, policy order, tracker);
//! - on a clock the driver advances: the age of the oldest pending write and the number pending
//!   are the model's, and an expiry ends exactly the writes older than its timeout.

use kvoffload_core::{
    Admission, Manager, ManagerConfig, PolicyKind, PolicyState, RequestState as ReqState,
};
use std::collections::{HashMap, HashSet};

/// Keys the driver draws from: few, so that calls collide; two KV groups.
const NUM_KEYS: u8 = 12;
/// Live request states at once.
const NUM_REQUESTS: usize = 3;

/// The bytes of the input, consumed front to back; zeros once exhausted.
struct Input<'a> {
    data: &'a [u8],
}

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.data.split_first()?;
        self.data = rest;
        Some(b)
    }

    fn below(&mut self, n: u8) -> u8 {
        self.byte().unwrap_or(0) % n
    }

    fn key(&mut self) -> Vec<u8> {
        let i = self.below(NUM_KEYS);
        let mut key = vec![i; 8];
        key.extend_from_slice(&u32::from(i % 2).to_be_bytes());
        key
    }

    /// Up to 7 keys, repeats allowed.
    fn keys(&mut self) -> Vec<Vec<u8>> {
        let n = self.below(8);
        (0..n).map(|_| self.key()).collect()
    }

    /// Token positions for `n` keys: none, or one each (some hostile), sometimes miscounted.
    fn positions(&mut self, n: usize) -> Option<Vec<Option<i64>>> {
        match self.below(8) {
            0..=2 => None,
            3 => Some(vec![Some(i64::MIN); n]),
            4 => Some(vec![None; n + 1]),
            _ => Some(
                (0..n)
                    .map(|_| match self.byte().unwrap_or(0) {
                        0 => None,
                        255 => Some(i64::MAX),
                        b => Some(i64::from(b) - 128),
                    })
                    .collect(),
            ),
        }
    }
}

/// What the driver expects of each key.
#[derive(Default)]
struct Model {
    /// Keys whose store is in flight.
    pending: HashSet<Vec<u8>>,
    /// Loads prepared and not completed, per key.
    pins: HashMap<Vec<u8>, i32>,
    /// When each pending key's store started (the keys of `pending`).
    started: HashMap<Vec<u8>, f64>,
}

/// Everything a failed call must leave as it was.
#[derive(PartialEq, Debug)]
struct Snapshot {
    resident: Vec<(Vec<u8>, u32, i32)>,
    pool: (u32, Vec<u32>),
    policy: PolicyState,
    tracker: Option<Vec<(Vec<u8>, u64)>>,
}

fn snapshot(m: &Manager) -> Snapshot {
    let (fresh, free) = m.pool_state();
    Snapshot {
        resident: m
            .resident()
            .into_iter()
            .map(|(k, c, r)| (k.to_vec(), c, r))
            .collect(),
        pool: (fresh, free.to_vec()),
        policy: m.policy_state(),
        tracker: m
            .tracker()
            .map(|t| t.entries().map(|(k, n)| (k.to_vec(), n)).collect()),
    }
}

/// Check every invariant; panics (which the fuzzer reports) on the first that fails.
fn check(m: &Manager, model: &Model, capacity: u32) {
    if let Err(e) = m.validate() {
        panic!("validate: {e}");
    }
    let (fresh, free) = m.pool_state();
    let resident = m.resident();
    let free_set: HashSet<u32> = free.iter().copied().collect();
    assert_eq!(free_set.len(), free.len(), "a chunk is free twice");
    let mut owned = HashSet::new();
    let (mut pending, mut ready, mut pinned) = (0usize, 0usize, 0usize);
    for (key, c, r) in &resident {
        let (key, c, r) = (key.as_slice(), *c, *r);
        assert!(owned.insert(c), "chunk {c} owned twice");
        assert!(!free_set.contains(&c), "resident chunk {c} is free");
        match r {
            -1 => pending += 1,
            0 => ready += 1,
            _ => pinned += 1,
        }
        let want = if model.pending.contains(key) {
            -1
        } else {
            model.pins.get(key).copied().unwrap_or(0)
        };
        assert_eq!(r, want, "ref count of {key:?}");
    }
    let resident_keys: HashSet<&[u8]> = resident.iter().map(|(k, _, _)| k.as_slice()).collect();
    for key in model.pending.iter().chain(model.pins.keys()) {
        assert!(
            resident_keys.contains(key.as_slice()),
            "pending or pinned {key:?} was evicted"
        );
    }
    assert_eq!(
        free.len() + pending + ready + pinned,
        fresh as usize,
        "free + pending + ready + pinned != handed out"
    );
    assert!(fresh <= capacity, "{fresh} chunks handed out of {capacity}");
}

fn slices(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

/// Run the calls `data` encodes; returns how many. Panics on a broken invariant.
pub(crate) fn run(data: &[u8]) -> usize {
    let mut input = Input { data };
    let capacity = u32::from(input.below(9));
    let config = ManagerConfig {
        num_chunks: capacity,
        policy: PolicyKind::ALL[usize::from(input.below(PolicyKind::ALL.len() as u8))].1,
        enable_events: input.below(2) == 1,
        store_threshold: u64::from(input.below(3)) + 1,
        max_tracker_size: usize::from(input.below(4)) + 1,
        admission: if input.below(2) == 1 {
            Admission::TinyLfu
        } else {
            Admission::Tracker
        },
    };
    let m = Manager::new(&config).expect("a valid configuration");
    let reqs = (0..NUM_REQUESTS).map(|_| m.new_request_state()).collect();
    let mut d = Driver {
        m,
        reqs,
        model: Model::default(),
        now: 0.0,
    };
    let mut calls = 0;
    while let Some(op) = input.byte() {
        calls += 1;
        let r = usize::from(input.below(NUM_REQUESTS as u8));
        let before = snapshot(&d.m);
        if d.step(op % 16, r, &mut input) {
            assert_eq!(
                snapshot(&d.m),
                before,
                "a failed call changed the state (op {op})"
            );
        }
        check(&d.m, &d.model, capacity);
    }
    calls
}

/// A manager, its live request states and the driver's model of it.
struct Driver {
    m: Manager,
    reqs: Vec<ReqState>,
    model: Model,
    /// The clock given to the manager, in seconds.
    now: f64,
}

impl Driver {
    /// Request `r`'s state, replaced by a fresh one if a reset made it stale (as the bindings do).
    fn req(&mut self, r: usize) -> &mut ReqState {
        if !self.m.is_current(&self.reqs[r]) {
            self.reqs[r] = self.m.new_request_state();
        }
        &mut self.reqs[r]
    }

    /// One call; returns whether it failed (`Err`).
    fn step(&mut self, op: u8, r: usize, input: &mut Input<'_>) -> bool {
        match op {
            0 => {
                let _ = self.m.lookup(&input.key());
                false
            }
            1 => {
                let keys = input.keys();
                let _ = self.m.lookup_prefix(&slices(&keys));
                false
            }
            2 | 3 => self.prepare_load(r, input),
            4 | 5 => self.complete_load(input),
            6 => {
                let keys = input.keys();
                self.m.touch(&slices(&keys));
                false
            }
            7..=9 => self.prepare_store(r, input),
            10 | 11 => {
                let keys = input.keys();
                let success = input.below(4) != 0;
                self.m.complete_store(&slices(&keys), success);
                for k in &keys {
                    self.model.pending.remove(k);
                    self.model.started.remove(k);
                }
                false
            }
            12 => {
                let n = self.reqs[r].seen_keys().len() + usize::from(input.below(8) == 0);
                let positions: Vec<Option<i64>> = (0..n)
                    .map(|_| Some(i64::from(input.byte().unwrap_or(0))))
                    .collect();
                self.m
                    .on_request_finished(&mut self.reqs[r], &positions)
                    .is_err()
            }
            13 => {
                self.reqs[r] = self.m.new_request_state();
                false
            }
            14 => {
                let _ = self.m.take_events();
                let _ = self.m.take_stats();
                self.liveness(input)
            }
            _ => {
                if input.below(8) == 0 {
                    self.m.reset_cache();
                    self.model = Model::default();
                }
                false
            }
        }
    }

    fn prepare_load(&mut self, r: usize, input: &mut Input<'_>) -> bool {
        let keys = input.keys();
        let positions = input.positions(keys.len());
        self.req(r);
        let out = self
            .m
            .prepare_load(&slices(&keys), positions.as_deref(), &mut self.reqs[r]);
        if out.is_ok() {
            for k in keys {
                *self.model.pins.entry(k).or_default() += 1;
            }
        }
        out.is_err()
    }

    fn complete_load(&mut self, input: &mut Input<'_>) -> bool {
        let keys = input.keys();
        let out = self.m.complete_load(&slices(&keys));
        if out.is_ok() {
            for k in keys {
                let n = self.model.pins.get_mut(&k).expect("an unmodelled load");
                *n -= 1;
                if *n == 0 {
                    self.model.pins.remove(&k);
                }
            }
        }
        out.is_err()
    }

    fn prepare_store(&mut self, r: usize, input: &mut Input<'_>) -> bool {
        let keys = input.keys();
        let positions = input.positions(keys.len());
        self.req(r);
        self.m.set_clock(self.now);
        match self
            .m
            .prepare_store(&slices(&keys), positions.as_deref(), &mut self.reqs[r])
        {
            Ok(Some(out)) => {
                for k in &out.evicted {
                    let k = k.to_vec();
                    assert!(!self.model.pending.contains(&k), "evicted a pending key");
                    assert!(!self.model.pins.contains_key(&k), "evicted a pinned key");
                }
                for &i in &out.to_store {
                    self.model.pending.insert(keys[i].clone());
                    self.model.started.insert(keys[i].clone(), self.now);
                }
                false
            }
            Ok(None) => false,
            Err(_) => true,
        }
    }

    /// Advance the clock; check the oldest pending write's age; sometimes expire overdue writes.
    fn liveness(&mut self, input: &mut Input<'_>) -> bool {
        self.now += f64::from(input.below(4));
        let now = self.now;
        let oldest = self
            .model
            .started
            .values()
            .map(|&t| now - t)
            .reduce(f64::max);
        assert_eq!(
            self.m.oldest_pending_write(now),
            oldest,
            "oldest pending age"
        );
        assert_eq!(self.m.num_pending_writes(), self.model.pending.len());
        if input.below(2) == 0 {
            let timeout = f64::from(input.below(4));
            for (_, k) in self.m.expire_pending_writes(now, timeout) {
                let k = k.to_vec();
                let start = self.model.started.remove(&k).expect("an unmodelled write");
                assert!(
                    now - start > timeout,
                    "expired a write of age {}",
                    now - start
                );
                self.model.pending.remove(&k);
            }
            assert!(
                self.model.started.values().all(|&t| now - t <= timeout),
                "a pending write outlived the timeout"
            );
        }
        false
    }
}
