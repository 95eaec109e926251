//! The workload shared by the criterion bench (`benches/manager.rs`) and the callgrind driver
//! (`examples/callgrind_ops.rs`), so both measure the same code on the same state.
//!
//! A [`Workload`] owns a [`Manager`] whose cache is full of evictable chunks: it has stored
//! twice its capacity in fresh keys, so every chunk has been evicted and reused once and, for
//! ARC, the ghost list B1 is full. Keys are 36 bytes, as in vLLM: a 32-byte block hash, then the
//! KV-group index as a big-endian `u32`. Every operation works on batches of [`BATCH`] keys.
//!
//! The `run_*` functions are exactly the measured code; their inputs (keys, request states) are
//! made beforehand by `Workload`'s methods, outside any measurement. They are `inline(never)` so
//! that callgrind can attribute instructions to each of them.
//!
//! Not every item is used by both includers (each compiles this module on its own).
#![allow(dead_code)]

use kvoffload_core::{Manager, ManagerConfig, PolicyKind, RequestState};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;

thread_local! {
    /// Heap allocations and reallocations made by this thread, under [`CountingAllocator`].
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting each thread's allocations (so that tests running on threads
/// of their own do not count each other's). An includer that wants counts installs it:
/// `#[global_allocator] static GLOBAL: CountingAllocator = CountingAllocator;`.
pub(crate) struct CountingAllocator;

fn count_one() {
    // During a thread's teardown its counter may be gone: that allocation is nobody's.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every method forwards its arguments unchanged to `System`, which upholds the
// `GlobalAlloc` contract; counting touches no memory the allocator hands out (the counter is a
// const-initialised thread-local without a destructor, so reading it never allocates).
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: the caller's contract for `alloc` is the one `System.alloc` requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, hence from `System`, with this `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        // SAFETY: `ptr` came from `System` with `layout`; the caller guarantees `new_size`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// This thread's allocations while `op` runs (zero unless [`CountingAllocator`] is installed).
pub(crate) fn allocations<T>(op: impl FnOnce() -> T) -> (u64, T) {
    let before = ALLOCATIONS.with(Cell::get);
    let out = op();
    (ALLOCATIONS.with(Cell::get) - before, out)
}

/// Keys per operation.
pub(crate) const BATCH: usize = 32;

/// Bytes per key: a 32-byte block hash and a 4-byte KV-group index.
pub(crate) const KEY_LEN: usize = 36;

/// One key.
pub(crate) type Key = [u8; KEY_LEN];

/// Batches stored per call while filling the cache (bounds the memory of the fill inputs).
const FILL_BLOCK: usize = 1024;

/// End-token positions of a batch: vLLM's 16-token blocks, block `i` ending at `16 * (i + 1)`.
pub(crate) const POSITIONS: [Option<i64>; BATCH] = {
    let mut p = [None; BATCH];
    let mut i = 0;
    while i < BATCH {
        p[i] = Some(16 * (i as i64 + 1));
        i += 1;
    }
    p
};

/// One step of splitmix64: a fast, well-mixed pseudo-random sequence from any seed.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Key number `n`: a pseudo-random 32-byte hash (distinct for distinct `n`), KV group 0.
fn key(n: u64) -> Key {
    let mut k = [0; KEY_LEN];
    let mut state = n;
    for word in k[..32].chunks_exact_mut(8) {
        word.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    k
}

/// The keys of `keys` as the manager's API takes them.
pub(crate) fn refs(keys: &[Key]) -> Vec<&[u8]> {
    keys.iter().map(<[u8; KEY_LEN]>::as_slice).collect()
}

/// A manager in steady state plus the key sources of the benchmarks.
pub(crate) struct Workload {
    /// The manager under test.
    pub(crate) manager: Manager,
    /// Number of the next never-offered key.
    next_key: u64,
    /// The resident keys at the last [`snapshot`](Self::snapshot).
    resident: Vec<Key>,
    rng: u64,
}

impl Workload {
    /// A manager of `num_chunks` chunks (no events, no admission threshold) that has stored
    /// `2 * num_chunks` fresh keys, 32 per request, every store completed.
    pub(crate) fn new(policy: PolicyKind, num_chunks: u32) -> Self {
        Self::build(policy, num_chunks, false)
    }

    /// [`new`](Self::new) with events on, set up as the Python binding sets its manager up:
    /// events name chunks instead of copying keys, and a store's outcome carries no evicted
    /// keys. The fill's events are drained.
    pub(crate) fn with_events(policy: PolicyKind, num_chunks: u32) -> Self {
        Self::build(policy, num_chunks, true)
    }

    fn build(policy: PolicyKind, num_chunks: u32, events: bool) -> Self {
        let mut manager = Manager::new(&ManagerConfig {
            num_chunks,
            policy,
            enable_events: events,
            store_threshold: 1,
            max_tracker_size: 1,
            admission: kvoffload_core::Admission::default(),
        })
        .expect("valid manager config");
        if events {
            manager.set_event_chunks(true);
            manager.set_evicted_keys(false);
        }
        let mut w = Self {
            manager,
            next_key: 0,
            resident: Vec::new(),
            rng: 0x6b76_6f66_6c6f_6164,
        };
        let mut left = (2 * num_chunks as usize).div_ceil(BATCH);
        while left > 0 {
            let n = left.min(FILL_BLOCK);
            let keys = w.fresh_keys(n);
            let mut reqs = w.requests(n);
            store_batches(&mut w.manager, &refs(&keys), &mut reqs);
            drop_events(&mut w.manager);
            left -= n;
        }
        w.snapshot();
        assert_eq!(w.resident.len(), num_chunks as usize, "the cache is full");
        w
    }

    /// Remember the resident keys, the pool [`random_resident`](Self::random_resident) draws
    /// from. Stores change the resident set; call this after them.
    pub(crate) fn snapshot(&mut self) {
        self.resident = self
            .manager
            .resident()
            .into_iter()
            .map(|(k, _, _)| Key::try_from(k.as_slice()).expect("36-byte keys"))
            .collect();
    }

    /// `batches` batches of keys never offered before.
    pub(crate) fn fresh_keys(&mut self, batches: usize) -> Vec<Key> {
        let n = (batches * BATCH) as u64;
        let keys = (self.next_key..self.next_key + n).map(key).collect();
        self.next_key += n;
        keys
    }

    /// `batches` batches of resident keys drawn at random, distinct within a batch.
    pub(crate) fn random_resident(&mut self, batches: usize) -> Vec<Key> {
        assert!(self.resident.len() >= BATCH, "snapshot holds a batch");
        let len = self.resident.len() as u64;
        let mut keys = Vec::with_capacity(batches * BATCH);
        let mut picked = [0usize; BATCH];
        for _ in 0..batches {
            let mut n = 0;
            while n < BATCH {
                let i = (splitmix64(&mut self.rng) % len) as usize;
                if !picked[..n].contains(&i) {
                    picked[n] = i;
                    n += 1;
                }
            }
            keys.extend(picked.iter().map(|&i| self.resident[i]));
        }
        keys
    }

    /// The cache's capacity in chunks.
    pub(crate) fn capacity(&self) -> u32 {
        self.manager.pool_state().0
    }

    /// Store one batch of fresh keys (unmeasured): after [`free_batch`](Self::free_batch) or
    /// [`run_store_fail`], it fills the batch of free chunks they left, so the cache is full
    /// again.
    pub(crate) fn top_up(&mut self) {
        let keys = self.fresh_keys(1);
        let mut reqs = self.requests(1);
        store_batches(&mut self.manager, &refs(&keys), &mut reqs);
    }

    /// Leave one batch of chunks free in a full cache (unmeasured): a batch of fresh keys is
    /// placed (evicting as many) and its store fails. The input state of [`run_store_fail`].
    pub(crate) fn free_batch(&mut self) {
        let keys = self.fresh_keys(1);
        let mut reqs = self.requests(1);
        run_store_fail(&mut self.manager, &refs(&keys), &mut reqs);
    }

    /// Fill an emptied cache with fresh keys (unmeasured), one request per batch: the input
    /// state of [`run_reset`].
    pub(crate) fn refill(&mut self) {
        let mut left = self.capacity() as usize;
        while left > 0 {
            let batches = (left / BATCH).clamp(1, FILL_BLOCK);
            let keys = self.fresh_keys(batches);
            let keys = refs(&keys);
            let keys = &keys[..left.min(keys.len())];
            let mut reqs = self.requests(batches);
            for (batch, req) in keys.chunks(BATCH).zip(&mut reqs) {
                let outcome = self
                    .manager
                    .prepare_store(batch, None, req)
                    .expect("a legal offer")
                    .expect("room for the batch");
                outcome.recycle();
                self.manager.complete_store(batch, true);
            }
            drop_events(&mut self.manager);
            left -= keys.len();
        }
    }

    /// `n` fresh request states.
    pub(crate) fn requests(&self, n: usize) -> Vec<RequestState> {
        (0..n).map(|_| self.manager.new_request_state()).collect()
    }

    /// `batches` unfinished requests that each loaded one batch of random resident keys (load
    /// completed): the input of [`run_finish`].
    pub(crate) fn finish_input(&mut self, batches: usize) -> Vec<RequestState> {
        let keys = self.random_resident(batches);
        let mut reqs = self.requests(batches);
        load_batches(&mut self.manager, &refs(&keys), &mut reqs);
        reqs
    }
}

/// Per batch, one new request: `prepare_store` of the batch with positions, then
/// `complete_store(success)`. Returns the number of keys evicted.
#[inline(never)]
pub(crate) fn run_store(m: &mut Manager, keys: &[&[u8]], reqs: &mut [RequestState]) -> usize {
    store_batches(m, keys, reqs)
}

/// The body of [`run_store`], also used (unmeasured) to fill the cache.
fn store_batches(m: &mut Manager, keys: &[&[u8]], reqs: &mut [RequestState]) -> usize {
    let mut evicted = 0;
    for (batch, req) in keys.chunks_exact(BATCH).zip(reqs) {
        let outcome = m
            .prepare_store(batch, Some(&POSITIONS), req)
            .expect("a legal offer")
            .expect("room for the batch");
        evicted += outcome.evicted.len();
        // Its vectors' buffers go back for the next batch, as the Python binding's do.
        black_box(&outcome);
        outcome.recycle();
        m.complete_store(batch, true);
    }
    evicted
}

/// Per batch, one new request: `prepare_load` of the batch with positions, then
/// `complete_load`.
#[inline(never)]
pub(crate) fn run_load(m: &mut Manager, keys: &[&[u8]], reqs: &mut [RequestState]) {
    load_batches(m, keys, reqs);
}

/// The body of [`run_load`], also used (unmeasured) to make the input of [`run_finish`].
fn load_batches(m: &mut Manager, keys: &[&[u8]], reqs: &mut [RequestState]) {
    for (batch, req) in keys.chunks_exact(BATCH).zip(reqs) {
        let chunks = m
            .prepare_load(batch, Some(&POSITIONS), req)
            .expect("resident, ready keys");
        black_box(&chunks);
        kvoffload_core::recycle::give(chunks);
        m.complete_load(batch).expect("keys being loaded");
    }
}

/// Per batch, one new request: `prepare_store` of the batch with positions, then
/// `complete_store(failure)`, which frees the chunks it was given. In a full cache the first
/// batch evicts; later ones reuse the chunks the one before freed.
#[inline(never)]
pub(crate) fn run_store_fail(m: &mut Manager, keys: &[&[u8]], reqs: &mut [RequestState]) {
    for (batch, req) in keys.chunks_exact(BATCH).zip(reqs) {
        let outcome = m
            .prepare_store(batch, Some(&POSITIONS), req)
            .expect("a legal offer")
            .expect("room for the batch");
        black_box(&outcome);
        outcome.recycle();
        let freed = m.complete_store(batch, false);
        black_box(&freed);
        kvoffload_core::recycle::give(freed);
    }
}

/// [`run_store`] on a manager with events on, each batch's events drained after its store
/// (as a scheduler drains them every step); returns the number of events.
#[inline(never)]
pub(crate) fn run_store_events(
    m: &mut Manager,
    keys: &[&[u8]],
    reqs: &mut [RequestState],
) -> usize {
    let mut events = 0;
    for (batch, req) in keys.chunks_exact(BATCH).zip(reqs) {
        store_batches(m, batch, std::slice::from_mut(req));
        events += drop_events(m);
    }
    events
}

/// Drain the queued events, handing their vectors back as the Python binding does; returns
/// how many there were.
fn drop_events(m: &mut Manager) -> usize {
    let mut n = 0;
    for event in m.drain_events() {
        black_box(&event);
        kvoffload_core::recycle::give(event.keys);
        kvoffload_core::recycle::give(event.chunks);
        kvoffload_core::recycle::give(event.positions);
        n += 1;
    }
    n
}

/// `reset_cache`.
#[inline(never)]
pub(crate) fn run_reset(m: &mut Manager) {
    m.reset_cache();
}

/// `lookup_prefix` of each batch; returns the number of leading hits, summed.
#[inline(never)]
pub(crate) fn run_lookup_prefix(m: &Manager, keys: &[&[u8]]) -> usize {
    keys.chunks_exact(BATCH)
        .map(|batch| m.lookup_prefix(black_box(batch)))
        .sum()
}

/// `lookup` of every key; returns the number of hits.
#[inline(never)]
pub(crate) fn run_lookup(m: &Manager, keys: &[&[u8]]) -> usize {
    keys.iter()
        .filter(|k| m.lookup(black_box(k)) == kvoffload_core::Lookup::Hit)
        .count()
}

/// `touch` of each batch.
#[inline(never)]
pub(crate) fn run_touch(m: &mut Manager, keys: &[&[u8]]) {
    for batch in keys.chunks_exact(BATCH) {
        m.touch(batch);
    }
}

/// `on_request_finished` of each request, with the positions of its keys.
#[inline(never)]
pub(crate) fn run_finish(m: &mut Manager, reqs: &mut [RequestState]) {
    for req in reqs {
        m.on_request_finished(req, &POSITIONS)
            .expect("positions line up with the seen keys");
    }
}
