//! `Manager`: the scheduler-side offloading manager, composing the chunk pool, the ref counts,
//! the admission tracker and a cache policy, with per-request state kept by the caller.
//!
//! Every call validates its whole input first and only then changes state, so an `Err` means
//! nothing happened. Keys are resolved once per call through one hash index; the policy works on
//! chunk ids. Behaviour follows vLLM 0.33.0's `CPUOffloadingManager` call for call.

use crate::admission::AdmissionTracker;
use crate::error::{ensure, show_key, CoreError, Result};
use crate::key::{group_of, hash_key, KeyBuf};
use crate::liveness::PendingWrites;
use crate::policy::{
    Access, ArcPolicy, CachePolicy, FifoPolicy, FinishedKey, LfuPolicy, LruPolicy, PolicyState,
    S3FifoPolicy, SievePolicy, SlruPolicy, TwoQPolicy,
};
use crate::pool::{ChunkId, ChunkPool};
use crate::recycle;
use crate::request::{RequestState, INSERTED, REPORTED, REUSED};
use crate::sketch::{sketch_hash, FrequencySketch};
use crate::table::{storable_len, ChunkState, ChunkTable, Slots, Unpinned, MAX_KEY_LEN};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Per-call scratch lists, on buffers this thread reuses from call to call ([`recycle`]): a
/// steady stream of calls allocates none. (Inline `SmallVec`s of 32 ran 1.7-4.3% more
/// instructions a key in the store, load, `lookup_prefix` and touch rounds, callgrind: every
/// access checks whether the list spilled.)
type Scratch<T> = recycle::Recycled<T>;

/// Each key's chunk as a caller guesses it, for the completions and `touch`: `chunks[i]` may
/// hold `keys[i]` (empty: no guesses). Guesses only save work: a wrong one changes no result.
#[derive(Debug, Clone, Copy, Default)]
pub struct Hints<'a> {
    /// The guessed chunk of each key.
    pub chunks: &'a [Option<ChunkId>],
    /// The caller vouches for every guess: whenever slot `chunks[i]` holds a key, that key is
    /// `keys[i]` (the caller knows the key it last put there, say), so a guessed slot's key is
    /// not compared. A wrong vouch can make a call act on the wrong chunk: only a caller that
    /// knows may set it.
    pub vouched: bool,
}

impl Hints<'_> {
    /// No guesses.
    pub const NONE: Hints<'static> = Hints {
        chunks: &[],
        vouched: false,
    };
}

static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

/// The built-in cache policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Request-ranked LRU.
    Lru,
    /// Adaptive replacement cache.
    Arc,
    /// First in, first out.
    Fifo,
    /// SIEVE: a FIFO queue with visited bits and a sweeping hand.
    Sieve,
    /// S3-FIFO: small, main and ghost FIFO queues.
    S3Fifo,
    /// 2Q: a FIFO for chunks seen once, an LRU for the rest, ghosts of the first.
    TwoQ,
    /// Segmented LRU: probation and protected segments.
    Slru,
    /// Least frequently used, with aging.
    Lfu,
    /// The FAST 2003 paper's ARC, as libCacheSim implements it.
    ArcPaper,
}

impl PolicyKind {
    /// Every built-in policy, by name.
    pub const ALL: [(&'static str, PolicyKind); 9] = [
        ("lru", PolicyKind::Lru),
        ("arc", PolicyKind::Arc),
        ("fifo", PolicyKind::Fifo),
        ("sieve", PolicyKind::Sieve),
        ("s3fifo", PolicyKind::S3Fifo),
        ("2q", PolicyKind::TwoQ),
        ("slru", PolicyKind::Slru),
        ("lfu", PolicyKind::Lfu),
        ("arc-paper", PolicyKind::ArcPaper),
    ];

    /// The policy called `name`, if built in.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|&(_, k)| k)
    }

    /// An empty policy of this kind for `capacity` chunk slots.
    #[must_use]
    pub fn build(self, capacity: u32) -> Box<dyn CachePolicy> {
        match self {
            PolicyKind::Lru => Box::new(LruPolicy::new(capacity)),
            PolicyKind::Arc => Box::new(ArcPolicy::new(capacity)),
            PolicyKind::Fifo => Box::new(FifoPolicy::new()),
            PolicyKind::Sieve => Box::new(SievePolicy::new()),
            PolicyKind::S3Fifo => Box::new(S3FifoPolicy::new(capacity)),
            PolicyKind::TwoQ => Box::new(TwoQPolicy::new(capacity)),
            PolicyKind::Slru => Box::new(SlruPolicy::new(capacity)),
            PolicyKind::Lfu => Box::new(LfuPolicy::new()),
            PolicyKind::ArcPaper => Box::new(ArcPolicy::paper(capacity)),
        }
    }

    /// Whether the policy reads token positions during calls (LRU does; others never).
    #[must_use]
    pub fn reads_positions(self) -> bool {
        self == PolicyKind::Lru
    }

    /// Its name.
    #[must_use]
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|&&(_, k)| k == self)
            .map_or("?", |&(n, _)| n)
    }
}

/// Construction parameters of a [`Manager`].
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Slots of the host pool.
    pub num_chunks: u32,
    /// Which policy orders evictions.
    pub policy: PolicyKind,
    /// Queue stored/removed events for `take_events`.
    pub enable_events: bool,
    /// Offers a key needs before it is stored; the tracker exists only at 2 or more.
    pub store_threshold: u64,
    /// Bound of the admission tracker; with [`Admission::TinyLfu`], the sketch's width.
    pub max_tracker_size: usize,
    /// What counts offers for `store_threshold`.
    pub admission: Admission,
}

/// What counts offers for `store_threshold` (at 2 or more).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Admission {
    /// vLLM's bounded offer-count table ([`AdmissionTracker`]).
    #[default]
    Tracker,
    /// A `TinyLFU` frequency sketch ([`FrequencySketch`]), counting a key once per request.
    TinyLfu,
}

/// What `lookup` finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Absent.
    Miss,
    /// Readable (ready or pinned).
    Hit,
    /// A store is in flight.
    HitPending,
}

/// A stored or removed batch of keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The keys, in the order the call handled them; empty when the event carries `chunks`
    /// instead ([`Manager::set_event_chunks`]).
    pub keys: Vec<KeyBuf>,
    /// The chunks the keys were at, in the same order, when the manager was told to give
    /// chunks instead of keys; else empty.
    pub chunks: Vec<ChunkId>,
    /// With chunks given, for an event of [`Manager::complete_store`]: each key's place among
    /// the keys of that call (whose key objects the caller may want in the event); else empty.
    pub positions: Vec<u32>,
    /// Removed (`true`) or stored (`false`).
    pub removed: bool,
    /// The cleanup of a failed store rather than an eviction.
    pub metadata_only: bool,
}

/// The result of a `prepare_store` that could place its candidates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Positions in the offer of the keys to store, ascending.
    pub to_store: Vec<usize>,
    /// Their chunks, lined up with `to_store`.
    pub chunks: Vec<ChunkId>,
    /// Keys evicted to make room, in eviction order; empty when the manager was told not to
    /// copy them ([`Manager::set_evicted_keys`]) and events are off.
    pub evicted: Vec<KeyBuf>,
    /// The chunks they held, lined up with `evicted` (now free, or reused by `chunks`).
    pub evicted_chunks: Vec<ChunkId>,
}

impl StoreOutcome {
    /// Hand the vectors' buffers back for later calls on this thread ([`recycle`]): a caller
    /// done with an outcome may call this instead of dropping it.
    pub fn recycle(self) {
        recycle::give(self.to_store);
        recycle::give(self.chunks);
        recycle::give(self.evicted);
        recycle::give(self.evicted_chunks);
    }
}

/// Raw counters behind `get_stats`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawStats {
    /// Slots of the pool.
    pub num_chunks: u32,
    /// Pending or pinned slots.
    pub num_used: usize,
    /// Pending slots.
    pub num_pending: usize,
    /// Candidate counts of the `prepare_store` calls since the last report.
    pub allocation_sizes: Vec<u64>,
    /// Candidates dropped by the threshold since the last report (`None`: no tracker).
    pub stores_skipped: Option<u64>,
}

/// What `prepare_store` placed: victims, their keys, and the candidates' chunks.
type Placed = (Vec<ChunkId>, Vec<KeyBuf>, Vec<ChunkId>);

/// The scheduler-side manager. See the module docs.
pub struct Manager {
    id: u64,
    generation: u64,
    pool: ChunkPool,
    /// Key, hash and ref count of each chunk slot, and the key index (shared with lock-free
    /// readers and releasers).
    slots: Slots,
    policy: Box<dyn CachePolicy>,
    tracker: Option<AdmissionTracker>,
    sketch: Option<FrequencySketch>,
    events: Option<Vec<Event>>,
    allocation_sizes: Vec<u64>,
    stores_skipped: u64,
    /// One bit per chunk, all clear between calls: the scratch of `prepare_load` (the chunks
    /// named twice) and of [`make_room`](Self::make_room) (the chunks its
    /// eviction must spare); a pool of 10^5 chunks takes 12.5 KiB, which stays in the nearest
    /// caches.
    marks: Vec<u64>,
    /// Pinning calls ask the table for pins without compare-and-swap
    /// ([`set_exclusive`](Self::set_exclusive)).
    exclusive_pins: bool,
    /// The policy is external (plug-in code that may fail): calls check it and undo their
    /// changes when it does, and ref-count changes are mirrored to it.
    external: bool,
    /// Start times of the pending writes, oldest first.
    liveness: PendingWrites,
    /// [`StoreOutcome::evicted`] carries the evicted keys ([`set_evicted_keys`](Self::set_evicted_keys)).
    evicted_keys: bool,
    /// What events name their keys by ([`set_event_chunks`](Self::set_event_chunks)).
    event_keys: EventKeys,
}

/// What an [`Event`] names its keys by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventKeys {
    /// Copies of the keys.
    Copies,
    /// The chunks they were at (and a completion's places in its call).
    Chunks,
}

impl Manager {
    /// A manager with an empty cache.
    pub fn new(config: &ManagerConfig) -> Result<Self> {
        Self::build(config, config.policy.build(config.num_chunks), false)
    }

    /// A manager driving an external `policy` (`config.policy` is ignored).
    ///
    /// An external policy may fail any call ([`CachePolicy::failed`]); the manager then returns
    /// [`CoreError::Policy`] and undoes its own changes of that call:
    /// - `prepare_load`: nothing is pinned; pins already reported are reported released.
    /// - `prepare_store`: the offer is neither counted nor recorded; keys already inserted are
    ///   removed again and their chunks go back to the pool as they were. Chunks the policy
    ///   evicted before the failure stay evicted (the policy has dropped them): they are freed
    ///   and their removal event is queued.
    /// - `complete_load`, `complete_store`, `touch`, `on_request_finished`, `reset_cache`: the
    ///   call completes; the failure is for the caller to report afterwards.
    ///
    /// A method that fails is taken not to have changed the policy. An eviction that breaks the
    /// contract (not exactly `n` distinct, ready, unprotected, resident chunks) is refused the
    /// same way.
    pub fn with_policy(config: &ManagerConfig, policy: Box<dyn CachePolicy>) -> Result<Self> {
        Self::build(config, policy, true)
    }

    fn build(config: &ManagerConfig, policy: Box<dyn CachePolicy>, external: bool) -> Result<Self> {
        if config.store_threshold >= 2 && config.max_tracker_size == 0 {
            return Err(CoreError::InvalidArgument(
                "max_tracker_size must be >= 1 when store_threshold >= 2".into(),
            ));
        }
        let n = config.num_chunks;
        Ok(Self {
            id: NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed),
            generation: 0,
            pool: ChunkPool::new(n),
            slots: Slots::new(n).ok_or_else(|| {
                CoreError::InvalidArgument(format!("cannot map the tables of {n} chunks"))
            })?,
            policy,
            tracker: (config.store_threshold >= 2 && config.admission == Admission::Tracker)
                .then(|| AdmissionTracker::new(config.store_threshold, config.max_tracker_size)),
            sketch: (config.store_threshold >= 2 && config.admission == Admission::TinyLfu)
                .then(|| FrequencySketch::new(config.store_threshold, config.max_tracker_size))
                .transpose()?,
            events: config.enable_events.then(Vec::new),
            allocation_sizes: Vec::new(),
            stores_skipped: 0,
            marks: Vec::new(),
            exclusive_pins: false,
            external,
            liveness: PendingWrites::new(),
            evicted_keys: true,
            event_keys: EventKeys::Copies,
        })
    }

    /// Whether [`StoreOutcome::evicted`] carries the keys evicted (on for a new manager). A
    /// caller that keeps its own copy of every stored key, by chunk (the Python binding keeps
    /// the key objects), turns it off: an eviction then copies no key, unless events are on
    /// (they carry the keys).
    pub fn set_evicted_keys(&mut self, on: bool) {
        self.evicted_keys = on;
    }

    /// Whether events carry the chunks of their keys ([`Event::chunks`]) instead of copies of
    /// the keys (off for a new manager). For a caller that keeps its own copy of every stored
    /// key, by chunk, and takes each call's events ([`take_events`](Self::take_events)) before
    /// the chunks named change hands: before it moves the keys of evicted or freed chunks out,
    /// and before another call can reuse those chunks.
    pub fn set_event_chunks(&mut self, on: bool) {
        self.event_keys = if on {
            EventKeys::Chunks
        } else {
            EventKeys::Copies
        };
    }

    /// The policy (a binding reaches its external policy through [`CachePolicy::as_any_mut`]).
    pub fn policy_mut(&mut self) -> &mut dyn CachePolicy {
        &mut *self.policy
    }

    /// Whether an external policy reported a failure (always `false` for built-in ones).
    fn policy_failed(&mut self) -> bool {
        self.external && self.policy.failed()
    }

    /// Tell an external policy chunk `c`'s current ref count.
    fn mirror_ref(&mut self, c: ChunkId) {
        if self.external {
            self.policy.set_ref(c, self.slots.raw(c));
        }
    }

    /// Release one pin of each chunk, last first, reporting those back at 0 as evictable
    /// (undoing a failed `prepare_load`; failures of these reports are not checked).
    fn undo_pins(&mut self, chunks: &[ChunkId]) {
        for &c in chunks.iter().rev() {
            let zero = self.slots.unpin_all(&[c]).is_ok_and(|z| z.get(0));
            self.mirror_ref(c);
            if zero {
                self.policy.mark_evictable(c);
            }
        }
        self.policy.failed();
    }

    // --- request state ---

    /// Fresh, unfinished request state for this manager's current generation.
    #[must_use]
    pub fn new_request_state(&self) -> RequestState {
        RequestState::new(self.id, self.generation)
    }

    /// Whether `state` belongs to this manager and its current cache generation.
    #[must_use]
    pub fn is_current(&self, state: &RequestState) -> bool {
        state.owner == self.id && state.generation == self.generation
    }

    // --- lookups ---

    fn find(&self, key: &[u8], hash: u64) -> Option<ChunkId> {
        self.slots.find(key, hash)
    }

    /// The chunk of each key (`hashes`: from [`Slots::hash_batch`], which requested their
    /// buckets), resolved with the cache misses of the batch overlapped: every candidate
    /// chunk's key and policy data are prefetched before any key is compared.
    fn resolve(&self, keys: &[&[u8]], hashes: &[u64]) -> Scratch<Option<ChunkId>> {
        self.resolve_for(keys, hashes, true)
    }

    /// [`resolve`](Self::resolve), prefetching the candidates' policy data only when `policy`
    /// (a call that only reads the keys' states leaves those lines alone).
    fn resolve_for(
        &self,
        keys: &[&[u8]],
        hashes: &[u64],
        policy: bool,
    ) -> Scratch<Option<ChunkId>> {
        if keys.len() > 1 {
            // The buckets were requested as the keys were hashed (`hash_batch`).
            // Each key's candidate slot, prefetched, then compared first: its bucket is read
            // once (a miss with no candidate is known absent at once).
            let mut found: Scratch<Option<ChunkId>> = hashes
                .iter()
                .map(|&h| {
                    let c = self.slots.candidate(h);
                    if let Some(c) = c {
                        self.slots.prefetch(c);
                        if policy {
                            self.policy.prefetch(c);
                        }
                    }
                    c
                })
                .collect();
            // Each candidate replaced by the key's chunk, in place.
            for ((k, &h), c) in keys.iter().zip(hashes).zip(found.iter_mut()) {
                *c = self.slots.find_from(k, h, *c);
            }
            return found;
        }
        keys.iter()
            .zip(hashes)
            .map(|(k, &h)| self.find(k, h))
            .collect()
    }

    /// [`resolve`](Self::resolve) with a guess per key (see [`Hints`]). A guess is used only
    /// when its slot holds that very key ([`at_guess`](Self::at_guess)), so a wrong or stale
    /// one costs a comparison; the other keys are hashed and looked up.
    fn resolve_hinted(&self, keys: &[&[u8]], hints: Hints<'_>) -> Scratch<Option<ChunkId>> {
        let Hints {
            chunks: hints,
            vouched,
        } = hints;
        if hints.len() != keys.len() {
            let hashes: Scratch<u64> = self.slots.hash_batch(keys);
            return self.resolve(keys, &hashes);
        }
        let mut found: Scratch<Option<ChunkId>> = keys
            .iter()
            .zip(hints)
            .map(|(k, h)| h.filter(|&c| self.at_guess(c, k, vouched)))
            .collect();
        if found.iter().all(Option::is_some) {
            // Every guess held (the usual completion): nothing to look up.
            return found;
        }
        if found.iter().all(Option::is_none) {
            // No guess held (a call without a prepare before it): the plain lookup.
            let hashes: Scratch<u64> = self.slots.hash_batch(keys);
            return self.resolve(keys, &hashes);
        }
        let rest: Scratch<usize> = (0..keys.len()).filter(|&i| found[i].is_none()).collect();
        let rest_keys: Scratch<&[u8]> = rest.iter().map(|&i| keys[i]).collect();
        let hashes: Scratch<u64> = self.slots.hash_batch(&rest_keys);
        for (&i, &c) in rest.iter().zip(self.resolve(&rest_keys, &hashes).iter()) {
            found[i] = c;
        }
        found
    }

    /// Whether slot `c`, guessed for `key`, holds it: under a vouch (see [`Hints`]), whether
    /// it holds a key at all.
    #[inline]
    fn at_guess(&self, c: ChunkId, key: &[u8], vouched: bool) -> bool {
        if vouched {
            self.slots.resident(c)
        } else {
            self.slots.holds_at(c, key)
        }
    }

    fn chunk_of(&self, key: &[u8]) -> Option<ChunkId> {
        self.find(key, hash_key(key))
    }

    /// Whether `key` is resident (pending, ready or pinned).
    #[must_use]
    pub fn is_resident(&self, key: &[u8]) -> bool {
        self.chunk_of(key).is_some()
    }

    /// `Miss`, `HitPending` or `Hit`; changes nothing.
    #[must_use]
    pub fn lookup(&self, key: &[u8]) -> Lookup {
        match self.chunk_of(key).map(|c| self.slots.state(c)) {
            None | Some(ChunkState::Absent) => Lookup::Miss,
            Some(ChunkState::Pending) => Lookup::HitPending,
            Some(ChunkState::Ready(_)) => Lookup::Hit,
        }
    }

    /// The number of leading keys that are HIT.
    #[must_use]
    pub fn lookup_prefix(&self, keys: &[&[u8]]) -> usize {
        let mut hits = 0;
        // Batches of 32: the misses of a batch overlap, and a miss early on ends the work.
        for batch in keys.chunks(32) {
            let hashes: Scratch<u64> = self.slots.hash_batch(batch);
            let found = self.resolve_for(batch, &hashes, false);
            let n = found
                .iter()
                .take_while(|c| {
                    c.is_some_and(|c| matches!(self.slots.state(c), ChunkState::Ready(_)))
                })
                .count();
            hits += n;
            if n < batch.len() {
                break;
            }
        }
        hits
    }

    // --- loads ---

    /// Pin readable keys for a load; returns their chunks, lined up with `keys`.
    pub fn prepare_load(
        &mut self,
        keys: &[&[u8]],
        positions: Option<&[Option<i64>]>,
        req: &mut RequestState,
    ) -> Result<Vec<ChunkId>> {
        self.pinning(|m| m.prepare_load_pinning(keys, Some((positions, req))))
    }

    /// Pin readable keys for a read that is no request's access: a copy out of the cache to
    /// another tier (vLLM's `prepare_read`). As [`prepare_load`](Self::prepare_load), and the
    /// same errors, but no request's state, rank or recorded access changes; the pins are
    /// released by [`complete_load`](Self::complete_load).
    pub fn prepare_read(&mut self, keys: &[&[u8]]) -> Result<Vec<ChunkId>> {
        self.pinning(|m| m.prepare_load_pinning(keys, None))
    }

    /// [`prepare_load`](Self::prepare_load) (given a request) or
    /// [`prepare_read`](Self::prepare_read), inside [`pinning`](Self::pinning).
    fn prepare_load_pinning(
        &mut self,
        keys: &[&[u8]],
        request: Option<(Option<&[Option<i64>]>, &mut RequestState)>,
    ) -> Result<Vec<ChunkId>> {
        self.apply_releases();
        let mut request = request;
        if let Some((positions, req)) = request.as_mut() {
            check_positions(keys, *positions)?;
            req.reserve_fetched(keys.len());
        }
        let hashes: Scratch<u64> = self.slots.hash_batch(keys);
        let found = self.resolve(keys, &hashes);
        let mut chunks = recycle::take(keys.len());
        // One pass checks each key's state, marks its chunk in `marks` (a bit found set is a
        // repeat; a chunk past the bits, never a resident one, counts as one and so takes the
        // exact way) and checks one more pin, whose failure is raised only once every key is
        // known to be loadable. The words marked are zeroed again before anything returns.
        let mut repeated = false;
        let mut full = None;
        for (k, &c) in keys.iter().zip(&found) {
            let (wrong, pinnable) = match c {
                None => (Some("not in the cache"), true),
                Some(c) => {
                    let (pending, pinnable) = self.slots.pending_and_pinnable(c);
                    (pending.then_some("its store has not completed"), pinnable)
                }
            };
            let (Some(c), None) = (c, wrong) else {
                clear_marks(&mut self.marks, chunks.iter().copied());
                return Err(CoreError::KeyState(format!(
                    "cannot {} {}: {}",
                    if request.is_some() { "load" } else { "read" },
                    show_key(k),
                    wrong.unwrap_or_default()
                )));
            };
            repeated |= !mark(&mut self.marks, c);
            if full.is_none() && !pinnable {
                full = Some(c);
            }
            chunks.push(c);
        }
        clear_marks(&mut self.marks, chunks.iter().copied());
        // Distinct chunks: distinct keys.
        let distinct = !repeated;
        if distinct {
            if let Some(c) = full {
                self.slots.check_pin(c, 1)?;
            }
        } else {
            for (c, times) in multiplicities(&chunks).iter().copied() {
                self.slots.check_pin(c, times)?;
            }
        }
        let mut call = match request.as_ref() {
            Some((positions, req)) => {
                let call = Call::lazy(keys, &hashes, *positions, req, distinct);
                call.check_may_record(req, 0..keys.len())?;
                Some(call)
            }
            None => None,
        };

        if self.external {
            for (n, &c) in chunks.iter().enumerate() {
                if self.slots.pin(c) {
                    self.policy.mark_non_evictable(c);
                    if self.policy_failed() {
                        // Its report failed: release it silently, then undo the reported ones.
                        let _ = self.slots.unpin_all(&[c]);
                        self.undo_pins(&chunks[..n]);
                        return Err(policy_error("mark_non_evictable"));
                    }
                }
                self.mirror_ref(c);
            }
        } else {
            // A built-in policy: its reports cannot fail, and there are no ref counts to mirror.
            for &c in &chunks {
                if self.slots.pin(c) {
                    self.policy.mark_non_evictable(c);
                }
            }
        }
        if let (Some((_, req)), Some(call)) = (request, call.as_mut()) {
            let mark = req.seen.len();
            if !self.record_new::<true>(req, call, 0..keys.len(), |i| Some(chunks[i])) {
                req.truncate(mark);
                self.undo_pins(&chunks);
                return Err(policy_error("on_request_access"));
            }
            if self.external {
                // A built-in policy's recording marked them (it cannot fail).
                mark_reused(req, call, 0..keys.len());
            }
        }
        Ok(chunks)
    }

    /// Release one pin per key; a chunk whose count reaches 0 is evictable again.
    pub fn complete_load(&mut self, keys: &[&[u8]]) -> Result<()> {
        self.complete_load_hinted(keys, Hints::NONE)
    }

    /// [`complete_load`](Self::complete_load) given a guess of each key's chunk ([`Hints`]):
    /// the result is the same.
    pub fn complete_load_hinted(&mut self, keys: &[&[u8]], hints: Hints<'_>) -> Result<()> {
        self.pinning(|m| m.complete_load_pinning(keys, hints))
    }

    /// [`complete_load_hinted`](Self::complete_load_hinted), inside
    /// [`pinning`](Self::pinning).
    fn complete_load_pinning(&mut self, keys: &[&[u8]], hints: Hints<'_>) -> Result<()> {
        self.apply_releases();
        // The usual call: every key at its guess, pinned. One pass checks them; any other call
        // takes the general way below, which finds the same chunks for these keys.
        if hints.chunks.len() == keys.len() {
            let mut chunks: Scratch<ChunkId> = Scratch::with_capacity(keys.len());
            for (k, &h) in keys.iter().zip(hints.chunks) {
                match h {
                    // Under a vouch, the slot holds this key whenever it holds one.
                    Some(c) if hints.vouched || self.slots.holds_at(c, k) => chunks.push(c),
                    _ => break,
                }
            }
            // Their pins are checked as they are dropped: all or none. If one is missing (a
            // slot not pinned, or not holding the key at all), nothing changed, and the general
            // way below finds the keys again and names the failure as it always does.
            if chunks.len() == keys.len() {
                if let Ok(zero) = self.slots.unpin_all(&chunks) {
                    self.unpinned(&chunks, &zero);
                    return Ok(());
                }
            }
        }
        let found = self.resolve_hinted(keys, hints);
        let mut chunks: Scratch<ChunkId> = Scratch::with_capacity(keys.len());
        for (k, &c) in keys.iter().zip(&found) {
            let pinned =
                c.filter(|&c| matches!(self.slots.state(c), ChunkState::Ready(n) if n > 0));
            let Some(c) = pinned else {
                return Err(CoreError::KeyState(format!(
                    "cannot complete a load of {}: it is not being loaded",
                    show_key(k)
                )));
            };
            chunks.push(c);
        }
        self.unpin_loaded(keys, &chunks)
    }

    /// Drop one pin of each of `chunks` (those of `keys`, pinned), all or none: a lock-free
    /// release on another thread may have taken a pin meanwhile, and a chunk listed more times
    /// than it has pins fails the call too, and is then named.
    fn unpin_loaded(&mut self, keys: &[&[u8]], chunks: &[ChunkId]) -> Result<()> {
        let zero = self.slots.unpin_all(chunks).map_err(|i| {
            for (c, times) in multiplicities(chunks).iter().copied() {
                if let ChunkState::Ready(n) = self.slots.state(c) {
                    if times > n {
                        return CoreError::KeyState(format!(
                            "cannot complete {times} loads of {}: only {n} in flight",
                            show_key(&self.slots.key(c))
                        ));
                    }
                }
            }
            CoreError::KeyState(format!(
                "cannot complete a load of {}: it is not being loaded",
                show_key(keys[i])
            ))
        })?;
        self.unpinned(chunks, &zero);
        Ok(())
    }

    /// Tell the policy of the pins just dropped on `chunks` ([`Slots::unpin_all`]'s `zero`).
    fn unpinned(&mut self, chunks: &[ChunkId], zero: &Unpinned) {
        if self.external {
            for (i, &c) in chunks.iter().enumerate() {
                self.mirror_ref(c);
                if zero.get(i) {
                    self.policy.mark_evictable(c);
                }
            }
        } else {
            // A built-in policy: no ref counts to mirror, only the evictable chunks to tell.
            let policy = &mut self.policy;
            zero.each_place(|i| policy.mark_evictable(chunks[i]));
        }
    }

    /// Forward a touch to the policy (absent keys included: ARC learns from ghosts).
    pub fn touch(&mut self, keys: &[&[u8]]) {
        self.touch_hinted(keys, Hints::NONE);
    }

    /// [`touch`](Self::touch) given a guess of each key's chunk ([`Hints`]), as
    /// [`complete_load_hinted`](Self::complete_load_hinted) takes them: a key found at its
    /// guess is neither hashed nor looked up (its hash is the slot's).
    pub fn touch_hinted(&mut self, keys: &[&[u8]], hints: Hints<'_>) {
        self.apply_releases();
        let hashes: Scratch<u64>;
        let found = if hints.chunks.len() == keys.len() {
            let found = self.resolve_hinted(keys, hints);
            hashes = keys
                .iter()
                .zip(&found)
                .map(|(k, c)| c.map_or_else(|| hash_key(k), |c| self.slots.hash(c)))
                .collect();
            found
        } else {
            hashes = self.slots.hash_batch(keys);
            self.resolve(keys, &hashes)
        };
        let access: Scratch<Access<'_>> = keys
            .iter()
            .zip(&hashes)
            .zip(&found)
            .map(|((&key, &hash), &chunk)| Access {
                key,
                hash,
                chunk,
                position: None,
            })
            .collect();
        self.policy.touch(&access, &self.slots);
    }

    // --- stores ---

    /// Offer keys for storing. `Ok(None)`: the candidates cannot be placed (the side effects of
    /// counting and recording the offer still happened, as in vLLM).
    pub fn prepare_store(
        &mut self,
        keys: &[&[u8]],
        positions: Option<&[Option<i64>]>,
        req: &mut RequestState,
    ) -> Result<Option<StoreOutcome>> {
        self.apply_releases();
        check_positions(keys, positions)?;
        check_key_lengths(keys.iter().map(|k| k.len()))?;
        req.reserve_fetched(keys.len());
        let hashes: Scratch<u64> = self.slots.hash_batch(keys);
        check_distinct(keys, &hashes)?;
        let found = self.resolve(keys, &hashes);
        let sketch_hashes: Scratch<u64> = match &self.sketch {
            Some(_) => keys.iter().map(|k| sketch_hash(k)).collect(),
            None => Vec::new().into(),
        };
        // One pass sorts the keys: the keys the call records (admitted absent or readable), the
        // candidates (admitted absent), the readable ones and the number of absent ones. Each
        // key's chunk (pending or readable) is `found`'s.
        let n = keys.len();
        let mut recorded: Scratch<usize> = Scratch::with_capacity(n);
        let mut candidates: Scratch<usize> = Scratch::with_capacity(n);
        let mut readable: Scratch<usize> = Vec::new().into();
        let mut absent = 0;
        let tracked = self.tracked(keys, &hashes);
        for (i, &c) in found.iter().enumerate() {
            match c {
                None => {
                    absent += 1;
                    let entry = tracked.get(i).copied().flatten();
                    if self.would_admit(entry, sketch_hashes.get(i).copied(), req) {
                        recorded.push(i);
                        candidates.push(i);
                    }
                }
                Some(c) if self.slots.state(c) == ChunkState::Pending => {}
                Some(_) => {
                    recorded.push(i);
                    readable.push(i);
                }
            }
        }
        // Distinct keys: checked above. Which of them the request reported before is read
        // only for a policy that takes store misses; for any other, the keys are resolved as
        // they are recorded (one probe each), not looked up first.
        let reports = self.policy.reads_store_misses();
        let mut call = if reports {
            Call::new(keys, &hashes, positions, req, true)
        } else {
            Call::lazy(keys, &hashes, positions, req, true)
        };
        call.check_may_record(req, recorded.iter().copied())?;

        // 1-3: the candidates are the absent keys the threshold admits (above).
        // 4: report misses this request has not reported yet.
        let new_misses = if reports {
            self.report_store_misses(&call, req, &candidates)?
        } else {
            Vec::new().into()
        };
        // 5: record the access (the flags are set once nothing can fail any more).
        let mark = req.seen.len();
        if !self.record_new::<false>(req, &mut call, recorded.iter().copied(), |i| found[i]) {
            req.truncate(mark);
            return Err(policy_error("on_request_access"));
        }
        // 8-9: make room, evict, allocate, insert.
        let placed = if candidates.is_empty() {
            None
        } else {
            match self.make_room_and_place(&call, &candidates, &found, req) {
                Ok(placed) => placed,
                Err(e) => {
                    req.truncate(mark);
                    return Err(e);
                }
            }
        };
        // The call stands: count the offer and set the request's flags.
        self.count_offer(
            keys,
            &hashes,
            &tracked,
            &sketch_hashes,
            req,
            absent - candidates.len(),
        );
        mark_reused(req, &call, readable.iter().copied());
        set_flag(req, &call, &new_misses, REPORTED);
        // 6-7.
        if candidates.is_empty() {
            return Ok(Some(StoreOutcome::default()));
        }
        self.allocation_sizes.push(candidates.len() as u64);
        let Some((victims, evicted, chunks)) = placed else {
            return Ok(None);
        };
        // The candidates were inserted, at these chunks.
        for (&i, &c) in candidates.iter().zip(&chunks) {
            if let Some(j) = call.slots[i] {
                let s = &mut req.seen[j as usize];
                s.flags |= INSERTED;
                s.chunk = c;
            }
        }
        Ok(Some(StoreOutcome {
            to_store: candidates.into_vec(),
            chunks,
            evicted,
            evicted_chunks: victims,
        }))
    }

    /// Report to the policy the candidates (`keys[i]`, `i` in `candidates`) that the request
    /// has not reported yet; returns them (their flags are the caller's to set).
    fn report_store_misses(
        &mut self,
        call: &Call<'_>,
        req: &RequestState,
        candidates: &[usize],
    ) -> Result<Scratch<usize>> {
        let new_misses: Scratch<usize> = candidates
            .iter()
            .copied()
            .filter(|&i| call.slots[i].is_none_or(|j| req.seen[j as usize].flags & REPORTED == 0))
            .collect();
        if !new_misses.is_empty() {
            let misses: Scratch<Access<'_>> =
                new_misses.iter().map(|&i| call.access(i, None)).collect();
            self.policy.on_store_miss(&misses);
            if self.policy_failed() {
                return Err(policy_error("on_store_miss"));
            }
        }
        Ok(new_misses)
    }

    /// Finish stores: pending keys become ready (`success`) or are dropped (failure). Other keys
    /// are ignored. At most one event is queued. Returns the chunks freed (failure only), in a
    /// vector from [`recycle::take`] that a caller done with it may hand back.
    pub fn complete_store(&mut self, keys: &[&[u8]], success: bool) -> Vec<ChunkId> {
        self.complete_store_hinted(keys, Hints::NONE, success)
    }

    /// [`complete_store`](Self::complete_store) given a guess of each key's chunk
    /// ([`Hints`]): the result is the same.
    pub fn complete_store_hinted(
        &mut self,
        keys: &[&[u8]],
        hints: Hints<'_>,
        success: bool,
    ) -> Vec<ChunkId> {
        self.apply_releases();
        // A failure frees each key's chunk: room for all of them at once, from a kept buffer.
        let mut freed = if success {
            Vec::new()
        } else {
            recycle::take(keys.len())
        };
        let mut done: Vec<KeyBuf> = Vec::new();
        let keep = self.events.is_some() && self.event_keys == EventKeys::Copies;
        let found = self.resolve_hinted(keys, hints);
        // Apart from the loop below, which an event's two more lists measurably slowed.
        let named = (self.events.is_some() && self.event_keys == EventKeys::Chunks)
            .then(|| self.pending_among(&found));
        for (k, &c) in keys.iter().zip(&found) {
            let Some(c) = c else { continue };
            if self.slots.state(c) != ChunkState::Pending {
                continue;
            }
            if success {
                self.slots.complete_store(c);
                self.mirror_ref(c);
                self.policy.mark_evictable(c);
                if keep {
                    done.push(KeyBuf::from_slice(k));
                }
            } else {
                let key = self.slots.remove(c);
                self.policy.remove(c);
                if keep {
                    done.push(key);
                }
                self.pool.free(c);
                freed.push(c);
            }
        }
        if self.events.is_some() {
            self.queue_completion(done, named, success);
        }
        freed
    }

    /// Queue the event of a completion: the keys it copied (`done`), or the chunks and places
    /// it named (`named`); none when it completed nothing. (Out of line, as is the naming:
    /// inlined, they cost every completion, events on or off.)
    #[inline(never)]
    fn queue_completion(
        &mut self,
        done: Vec<KeyBuf>,
        named: Option<(Vec<ChunkId>, Vec<u32>)>,
        success: bool,
    ) {
        let (keys, chunks, positions) = match named {
            Some((chunks, positions)) if chunks.is_empty() => {
                recycle::give(chunks);
                recycle::give(positions);
                return;
            }
            Some((chunks, positions)) => (Vec::new(), chunks, positions),
            None if done.is_empty() => return,
            None => (done, Vec::new(), Vec::new()),
        };
        if let Some(events) = &mut self.events {
            events.push(Event {
                keys,
                chunks,
                positions,
                removed: !success,
                metadata_only: !success,
            });
        }
    }

    /// The pending chunks among `found` (each once, in order) and their places in it: the
    /// keys a completion finds pending, for its event.
    #[inline(never)]
    fn pending_among(&mut self, found: &[Option<ChunkId>]) -> (Vec<ChunkId>, Vec<u32>) {
        let mut chunks = recycle::take(found.len());
        let mut positions = recycle::take(found.len());
        for (i, &c) in found.iter().enumerate() {
            if let Some(c) = c {
                // A key named twice is completed once.
                if self.slots.state(c) == ChunkState::Pending && mark(&mut self.marks, c) {
                    chunks.push(c);
                    positions.push(i as u32);
                }
            }
        }
        clear_marks(&mut self.marks, chunks.iter().copied());
        (chunks, positions)
    }

    // --- requests ---

    /// Finish a request: hand its keys, head to tail, to the policy. `positions` lines up with
    /// `state.seen_keys()`; `i64::MIN` is refused, as in the recording calls. Stale or finished
    /// state: nothing happens.
    pub fn on_request_finished(
        &mut self,
        req: &mut RequestState,
        positions: &[Option<i64>],
    ) -> Result<()> {
        self.on_request_finished_vouched(req, positions, |_, _| false)
    }

    /// [`on_request_finished`](Self::on_request_finished) with the caller's word for some of
    /// the chunks the request last saw its keys at: `vouched(i, c)` says that whenever slot `c`
    /// holds a key, that key is the request's seen key `i` (as [`Hints::vouched`] does for a
    /// whole call), so a resident `c` is taken without comparing its key. A wrong vouch can
    /// make the policy move the wrong chunk: only a caller that knows may give one.
    pub fn on_request_finished_vouched(
        &mut self,
        req: &mut RequestState,
        positions: &[Option<i64>],
        vouched: impl Fn(usize, ChunkId) -> bool,
    ) -> Result<()> {
        self.apply_releases();
        if !self.is_current(req) || req.finished {
            return Ok(());
        }
        if positions.len() != req.seen.len() {
            return Err(CoreError::InvalidArgument(format!(
                "expected {} positions, got {}",
                req.seen.len(),
                positions.len()
            )));
        }
        check_position_range(positions)?;
        req.finished = true;
        let order = head_to_tail(req, positions);
        for s in &req.seen {
            self.slots.prefetch(s.chunk);
        }
        let finished: recycle::Recycled<FinishedKey<'_>> = order
            .iter()
            .map(|&i| {
                let (s, key) = (&req.seen[i], req.key(i));
                // The chunk the request last saw the key at, if it still holds the key; else a
                // lookup with the kept hash (no rehashing).
                let chunk = Some(s.chunk)
                    .filter(|&c| self.at_guess(c, key, vouched(i, c)))
                    .or_else(|| self.find(key, s.hash));
                FinishedKey {
                    key,
                    chunk,
                    inserted_only: s.flags & INSERTED != 0 && s.flags & REUSED == 0,
                    reused: s.flags & REUSED != 0,
                }
            })
            .collect();
        self.policy.on_request_finished(&finished);
        drop(finished);
        recycle::give(order);
        Ok(())
    }

    // --- whole-cache operations ---

    /// Drop every chunk and the policy state; request state of earlier generations goes stale.
    /// Undrained events, tracker counts, histogram samples and the skipped count are kept.
    pub fn reset_cache(&mut self) {
        self.apply_releases();
        self.policy.clear();
        self.generation += 1;
        self.slots.clear();
        self.pool.reset();
        self.liveness.clear();
    }

    /// Detach the queued events (empty when events are disabled).
    pub fn take_events(&mut self) -> Vec<Event> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Take the queued events out one by one, oldest first, leaving the queue its buffer. The
    /// `chunks` and `positions` of an event come from [`recycle::take`]: a caller done with
    /// them may hand them back ([`recycle::give`]).
    pub fn drain_events(&mut self) -> impl Iterator<Item = Event> + '_ {
        self.events.iter_mut().flat_map(|events| events.drain(..))
    }

    /// Whether events are queued at all.
    #[must_use]
    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// Counters for `get_stats`; the histogram samples and skipped count restart. The samples
    /// leave in their buffer and a kept one ([`recycle::take`]) takes its place: a caller done
    /// with them may hand theirs back, and then a stream of steps allocates nothing for them.
    pub fn take_stats(&mut self) -> RawStats {
        self.apply_releases();
        RawStats {
            num_chunks: self.pool.num_chunks(),
            num_used: self.pool.num_used() - self.slots.num_evictable(),
            num_pending: self.slots.num_pending(),
            allocation_sizes: std::mem::replace(&mut self.allocation_sizes, recycle::take(0)),
            stores_skipped: (self.tracker.is_some() || self.sketch.is_some())
                .then(|| std::mem::take(&mut self.stores_skipped)),
        }
    }

    // --- introspection ---

    /// `(key, chunk, ref count)` of every resident key, by chunk id.
    #[must_use]
    pub fn resident(&self) -> Vec<(KeyBuf, ChunkId, i32)> {
        (0..self.slots.used() as ChunkId)
            .filter(|&c| self.slots.resident(c))
            .map(|c| (self.slots.key(c), c, self.slots.raw(c)))
            .collect()
    }

    /// The key held by chunk `c`, if any.
    #[must_use]
    pub fn key_of(&self, c: ChunkId) -> Option<KeyBuf> {
        ((c as usize) < self.slots.capacity() && self.slots.resident(c)).then(|| self.slots.key(c))
    }

    /// The table lock-free readers and releasers share with this manager.
    #[must_use]
    pub fn shared_table(&self) -> Arc<ChunkTable> {
        self.slots.shared()
    }

    /// Apply the releases that lock-free completions ([`ChunkTable::release`]) queued, in their
    /// order, telling the policy. Every call that changes or reports state does this first, so
    /// one thread calling sees exactly what an immediate `complete_load` would have done; a
    /// binding runs it whenever it takes its lock, before introspection too.
    pub fn apply_releases(&mut self) {
        let policy = &mut self.policy;
        self.slots.drain_releases(|c| policy.mark_evictable(c));
    }

    /// Whether the calls that pin or unpin (`prepare_load`, `complete_load`) ask the table
    /// for pins without compare-and-swap for their duration; lock-free releases
    /// ([`ChunkTable::release`]) back off while it is granted. See [`Slots::set_exclusive`];
    /// off by default. Other calls are unaffected.
    pub fn set_exclusive(&mut self, on: bool) {
        self.exclusive_pins = on;
    }

    /// Run pinning work `f` with exclusive pins asked for when [`set_exclusive`] is on.
    ///
    /// [`set_exclusive`]: Self::set_exclusive
    fn pinning<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        if !self.exclusive_pins {
            return f(self);
        }
        self.slots.set_exclusive(true);
        let out = f(self);
        self.slots.set_exclusive(false);
        out
    }

    /// Snapshot of the policy's order.
    #[must_use]
    pub fn policy_state(&self) -> PolicyState {
        self.policy.state()
    }

    /// The admission tracker, when `store_threshold >= 2`.
    #[must_use]
    pub fn tracker(&self) -> Option<&AdmissionTracker> {
        self.tracker.as_ref()
    }

    /// `(never-used ids handed out, free list with the next-popped id last)`.
    #[must_use]
    pub fn pool_state(&self) -> (u32, &[ChunkId]) {
        self.pool.state()
    }

    /// Set ARC's target size (tests); `false` for other policies.
    pub fn set_arc_target(&mut self, target: f64) -> bool {
        self.policy.set_target(target)
    }

    /// Check every invariant across the pool, ref counts, index, tracker and policy.
    pub fn validate(&self) -> Result<()> {
        self.pool.validate()?;
        self.slots.validate()?;
        if let Some(t) = &self.tracker {
            t.validate()?;
        }
        if let Some(s) = &self.sketch {
            s.validate()?;
        }
        let (fresh, free) = self.pool.state();
        // Slots past the ids handed out hold keys never (after an undone allocation, they are
        // empty again).
        ensure!(
            (fresh as usize..self.slots.used()).all(|i| !self.slots.resident(i as ChunkId)),
            "manager: a key in a slot the pool has not handed out"
        );
        let mut n = 0;
        for c in 0..self.slots.used() as ChunkId {
            if self.slots.resident(c) {
                n += 1;
                ensure!(
                    !free.contains(&c),
                    "manager: resident chunk {c} is on the free list"
                );
            }
        }
        ensure!(
            self.pool.num_used() == n,
            "manager: pool lends {} chunks, {n} resident",
            self.pool.num_used()
        );
        self.liveness.validate(&self.slots)?;
        ensure!(
            self.marks.iter().all(|&w| w == 0),
            "manager: scratch marks left set between calls"
        );
        let resident: Vec<bool> = (0..self.slots.used() as ChunkId)
            .map(|c| self.slots.resident(c))
            .collect();
        self.policy.validate(&resident, &self.slots)
    }

    // --- internals ---

    /// Each key's entry in the tracker, if one counts offers (else empty): read once, for the
    /// threshold and for counting the offer.
    fn tracked(&self, keys: &[&[u8]], hashes: &[u64]) -> Scratch<Option<u32>> {
        match &self.tracker {
            Some(t) => keys
                .iter()
                .zip(hashes)
                .map(|(k, &h)| t.find(k, h))
                .collect(),
            None => Vec::new().into(),
        }
    }

    /// Whether the threshold admits an absent key in the coming offer (`tracked`: its tracker
    /// entry, when the tracker counts offers; `sketch_hash`: its sketch hash, when a sketch
    /// does).
    fn would_admit(
        &self,
        tracked: Option<u32>,
        sketch_hash: Option<u64>,
        req: &RequestState,
    ) -> bool {
        match (&self.tracker, &self.sketch, sketch_hash) {
            (Some(t), _, _) => t.admits(tracked),
            (None, Some(s), Some(h)) => s.would_admit_next(h, !req.counted.contains(&h)),
            _ => true,
        }
    }

    /// Count an offer: the tracker counts every offer; the sketch counts each key once per
    /// request, after a reset that is due. `skipped`: absent keys the threshold dropped.
    fn count_offer(
        &mut self,
        keys: &[&[u8]],
        hashes: &[u64],
        tracked: &[Option<u32>],
        sketch_hashes: &[u64],
        req: &mut RequestState,
        skipped: usize,
    ) {
        if self.tracker.is_some() || self.sketch.is_some() {
            self.stores_skipped += skipped as u64;
        }
        if let Some(t) = &mut self.tracker {
            // The keys are distinct, and their entries read above.
            t.record_distinct(keys, hashes, tracked);
        }
        if let Some(s) = &mut self.sketch {
            s.age_if_due();
            for &h in sketch_hashes {
                if req.counted.insert(h) {
                    s.increment(h);
                }
            }
        }
    }

    /// Evict for and place the candidates: `(victims, their keys, the candidates' chunks)`, or
    /// `None` when no room can be made. `Err`: an external policy failed (evictions it made
    /// before an `insert` failed stand).
    fn make_room_and_place(
        &mut self,
        call: &Call<'_>,
        candidates: &[usize],
        resident: &[Option<ChunkId>],
        req: &mut RequestState,
    ) -> Result<Option<Placed>> {
        let Some(victims) = self.make_room(candidates.len(), resident)? else {
            return Ok(None);
        };
        let evicted = self.evict_chunks(&victims);
        let chunks = self
            .place(call, candidates, req)
            .ok_or_else(|| policy_error("insert"))?;
        Ok(Some((victims, evicted, chunks)))
    }

    /// Evict enough chunks (never one of the offer's: `resident`, their chunks) for `n`
    /// candidates; `None` if impossible. `Err`: an external policy failed or chose victims it
    /// may not.
    fn make_room(
        &mut self,
        n: usize,
        resident: &[Option<ChunkId>],
    ) -> Result<Option<Vec<ChunkId>>> {
        let Some(shortfall) = n.checked_sub(self.pool.num_free()).filter(|&s| s > 0) else {
            return Ok(Some(Vec::new()));
        };
        let mut victims = recycle::take(shortfall);
        if shortfall > self.slots.num_evictable() {
            return Ok(None);
        }
        let mut protected_ready = 0;
        for &c in resident.iter().flatten() {
            mark(&mut self.marks, c);
            protected_ready += usize::from(self.slots.raw(c) == 0);
        }
        let evicted = self.evict_unprotected(shortfall, protected_ready, &mut victims);
        clear_marks(&mut self.marks, resident.iter().flatten().copied());
        Ok(evicted?.then_some(victims))
    }

    /// Have the policy choose `n` victims into `victims`, sparing the chunks marked in
    /// `marks` (of which `protected_ready` are evictable); `false` if it cannot.
    fn evict_unprotected(
        &mut self,
        n: usize,
        protected_ready: usize,
        victims: &mut Vec<ChunkId>,
    ) -> Result<bool> {
        // Fewer ready, unprotected chunks than needed: no policy could evict enough. (Offered
        // keys are distinct, so each protected chunk is counted once.) A plug-in is asked all
        // the same, as vLLM asks it, and must answer None.
        if !self.external && !self.slots.can_evict(n, protected_ready) {
            return Ok(false);
        }
        let marks = &self.marks;
        let evicted = self
            .policy
            .evict(n, &|c| is_marked(marks, c), &self.slots, victims);
        if self.policy_failed() {
            return Err(policy_error("evict"));
        }
        if !evicted {
            return Ok(false);
        }
        if self.external {
            self.check_victims(n, victims)?;
        }
        Ok(true)
    }

    /// An external policy's victims must be exactly `n` distinct, resident, ready and
    /// unprotected chunks.
    fn check_victims(&self, n: usize, victims: &[ChunkId]) -> Result<()> {
        let broken = |why: String| {
            Err(CoreError::Policy(format!(
                "the policy's evict({n}) broke its contract: {why}; nothing was evicted"
            )))
        };
        if victims.len() != n {
            return broken(format!("it returned {} chunks", victims.len()));
        }
        for (i, &c) in victims.iter().enumerate() {
            let resident = (c as usize) < self.slots.capacity() && self.slots.resident(c);
            if !resident {
                return broken(format!("chunk {c} holds no key"));
            }
            let key = show_key(&self.slots.key(c));
            if victims[..i].contains(&c) {
                return broken(format!("it returned {key} twice"));
            }
            if is_marked(&self.marks, c) {
                return broken(format!("{key} is protected (offered in this call)"));
            }
            if self.slots.raw(c) != 0 {
                return broken(format!(
                    "{key} is not evictable (ref count {})",
                    self.slots.raw(c)
                ));
            }
        }
        Ok(())
    }

    /// Drop chosen victims, free their chunks (in order) and queue one removal event.
    fn evict_chunks(&mut self, victims: &[ChunkId]) -> Vec<KeyBuf> {
        let key_events = self.events.is_some() && self.event_keys == EventKeys::Copies;
        let keep = self.evicted_keys || key_events;
        let mut evicted = recycle::take(if keep { victims.len() } else { 0 });
        // The victims' keys, then their index buckets: the misses overlap.
        for &c in victims {
            self.slots.prefetch(c);
        }
        for &c in victims {
            self.slots.prefetch_bucket(self.slots.hash(c));
        }
        for &c in victims {
            if keep {
                evicted.push(self.slots.remove(c));
            } else {
                self.slots.discard(c);
            }
            self.pool.free(c);
            if self.external {
                self.policy.forget(c);
            }
        }
        if let (Some(events), false) = (&mut self.events, victims.is_empty()) {
            let (keys, chunks) = if self.event_keys == EventKeys::Chunks {
                let mut chunks = recycle::take(victims.len());
                chunks.extend_from_slice(victims);
                (Vec::new(), chunks)
            } else {
                (evicted.clone(), Vec::new())
            };
            events.push(Event {
                keys,
                chunks,
                positions: Vec::new(),
                removed: true,
                metadata_only: false,
            });
        }
        evicted
    }

    /// Allocate chunks for the candidates and insert them, pending, into the policy. `None`:
    /// an external policy failed an insert, and the candidates were taken out again.
    fn place(
        &mut self,
        call: &Call<'_>,
        candidates: &[usize],
        req: &mut RequestState,
    ) -> Option<Vec<ChunkId>> {
        let mut chunks = recycle::take(candidates.len());
        let (fresh_before, _) = self.pool.state();
        let placed = self.pool.allocate(candidates.len(), &mut chunks);
        debug_assert!(placed, "room was made for every candidate");
        let (used, _) = self.pool.state();
        self.grow(used as usize);
        for (n, (&i, &c)) in candidates.iter().zip(&chunks).enumerate() {
            self.slots.insert(c, call.keys[i], call.hashes[i]);
            self.policy.insert(c, call.access(i, None), &mut req.rank);
            if self.policy_failed() {
                // The failed insert is taken not to have happened; the earlier ones are undone.
                for (m, &c) in chunks[..=n].iter().enumerate().rev() {
                    if m < n {
                        self.policy.remove(c);
                    }
                    self.slots.remove(c);
                }
                self.policy.failed();
                self.pool.undo_allocate(&chunks, fresh_before);
                return None;
            }
        }
        self.liveness.started(&chunks, &self.slots);
        Some(chunks)
    }

    fn grow(&mut self, n: usize) {
        // The table's high-water mark is the pool's (reset with it).
        if n > self.slots.used() {
            self.marks.resize(self.marks.len().max(n.div_ceil(64)), 0);
            self.slots.grow(n);
            self.policy.grow(n);
        }
    }

    /// Record a request's access to `keys[i]` for `i` in `which` (call order): keys new to the
    /// request are added to its state and go to `on_request_access`. `resident(i)` is the chunk
    /// of `keys[i]` at this moment. `false`: an external policy failed (the caller truncates
    /// the request's state). The caller reserved room for the keys at the call's start
    /// ([`RequestState::reserve_fetched`]).
    ///
    /// `REUSE` (a load): under a built-in policy, whose recording cannot fail, the keys
    /// recorded are also marked reused here, as [`mark_reused`] would mark them after; an
    /// external policy's caller marks them itself once recording succeeded.
    // Out of line: inlined into its two callers, it measured more instructions (callgrind).
    #[inline(never)]
    fn record_new<const REUSE: bool>(
        &mut self,
        req: &mut RequestState,
        call: &mut Call<'_>,
        which: impl ExactSizeIterator<Item = usize>,
        resident: impl Fn(usize) -> Option<ChunkId>,
    ) -> bool {
        debug_assert!(req.has_room(which.len()));
        req.added.clear();
        req.added.reserve(which.len());
        // The keys go to the policy only if it reads them (LRU without positions, ARC: not);
        // otherwise the list stays empty and takes no buffer.
        let listed = self.policy.reads_access_keys(call.positions.is_some());
        let mut new: Scratch<Access<'_>> = if listed {
            Scratch::with_capacity(which.len())
        } else {
            Vec::new().into()
        };
        // Under a built-in policy a load's keys are marked reused as they are recorded (a key
        // it adds was not inserted); an external policy's caller marks them after.
        let mark_now = REUSE && !self.external;
        let flags = if mark_now { REUSED } else { 0 };
        for i in which {
            let j = if let Some(j) = call.slots[i] {
                j
            } else {
                // Unseen, or not looked up yet; a key repeated within the call is added by its
                // first occurrence and found by the others.
                let (k, h, c) = (call.keys[i], call.hashes[i], resident(i));
                let (j, added) = if call.fresh {
                    (req.add(k, h, c, flags), true)
                } else {
                    req.find_or_add(k, h, c, flags)
                };
                call.slots[i] = Some(j as u32);
                if added {
                    req.added.push(i as u32);
                    if listed {
                        new.push(call.access(i, c));
                    }
                    continue;
                }
                j as u32
            };
            if mark_now {
                mark_reused_flag(&mut req.seen[j as usize].flags);
            }
        }
        if !req.added.is_empty() {
            self.policy.on_request_access(&new, &mut req.rank);
        }
        !self.policy_failed()
    }
}

/// Keys `keys[i]` for `i` in `reused`, already recorded, become reused unless the request
/// inserted them.
fn mark_reused(req: &mut RequestState, call: &Call<'_>, reused: impl Iterator<Item = usize>) {
    for i in reused {
        if let Some(j) = call.slots[i] {
            mark_reused_flag(&mut req.seen[j as usize].flags);
        }
    }
}

/// A recorded key's flags after a reuse: reused, unless the request inserted it.
#[inline]
fn mark_reused_flag(flags: &mut u8) {
    if *flags & INSERTED == 0 {
        *flags |= REUSED;
    }
}

/// Set `flag` on the request's entries of `keys[i]` for `i` in `which` (already recorded).
fn set_flag(req: &mut RequestState, call: &Call<'_>, which: &[usize], flag: u8) {
    for &i in which {
        if let Some(j) = call.slots[i] {
            req.seen[j as usize].flags |= flag;
        }
    }
}

/// Set bit `c` of `bits`; `false` if it was set already or lies past the end.
#[inline]
fn mark(bits: &mut [u64], c: ChunkId) -> bool {
    let Some(w) = bits.get_mut((c >> 6) as usize) else {
        return false;
    };
    let bit = 1u64 << (c & 63);
    let fresh = *w & bit == 0;
    *w |= bit;
    fresh
}

/// Whether bit `c` of `bits` is set (`false` past the end).
#[inline]
fn is_marked(bits: &[u64], c: ChunkId) -> bool {
    bits.get((c >> 6) as usize)
        .is_some_and(|&w| (w >> (c & 63)) & 1 != 0)
}

/// Clear the words holding the bits of `chunks` (every other bit of them being clear).
#[inline]
fn clear_marks(bits: &mut [u64], chunks: impl Iterator<Item = ChunkId>) {
    for c in chunks {
        if let Some(w) = bits.get_mut((c >> 6) as usize) {
            *w = 0;
        }
    }
}

/// The error of a manager call whose external policy failed in `method`.
fn policy_error(method: &str) -> CoreError {
    CoreError::Policy(format!(
        "the cache policy's {method} failed; the call was undone"
    ))
}

/// One recording call's keys, resolved once: hashes, positions and each key's entry in the
/// request's state (`None` until the request has seen the key).
struct Call<'k> {
    keys: &'k [&'k [u8]],
    hashes: &'k [u64],
    positions: Option<&'k [Option<i64>]>,
    /// Each key's index among the request's seen keys: `None` while unseen, or unresolved.
    slots: Scratch<Option<u32>>,
    /// The slots were looked up and no key occurs twice: a `None` slot is a key to add.
    fresh: bool,
}

impl<'k> Call<'k> {
    fn new(
        keys: &'k [&'k [u8]],
        hashes: &'k [u64],
        positions: Option<&'k [Option<i64>]>,
        req: &RequestState,
        distinct: bool,
    ) -> Self {
        let slots = if req.seen.is_empty() {
            std::iter::repeat_n(None, keys.len()).collect()
        } else {
            keys.iter()
                .zip(hashes)
                .map(|(k, &h)| req.find(k, h).map(|j| j as u32))
                .collect()
        };
        Self {
            keys,
            hashes,
            positions,
            slots,
            fresh: distinct,
        }
    }

    /// [`new`](Self::new) where looking the keys up now is needed or free: for a finished
    /// request (which may record only keys it has seen, checked before anything changes) or
    /// one that has seen no key. Otherwise the keys are left unresolved and recording finds or
    /// adds each with one probe (see [`Manager::record_new`]).
    fn lazy(
        keys: &'k [&'k [u8]],
        hashes: &'k [u64],
        positions: Option<&'k [Option<i64>]>,
        req: &RequestState,
        distinct: bool,
    ) -> Self {
        if req.finished || req.seen.is_empty() {
            return Self::new(keys, hashes, positions, req, distinct);
        }
        Self {
            keys,
            hashes,
            positions,
            slots: std::iter::repeat_n(None, keys.len()).collect(),
            fresh: false,
        }
    }

    fn position(&self, i: usize) -> Option<i64> {
        self.positions.and_then(|p| p[i])
    }

    /// Key `i` as the policy sees it, with its chunk (if resident).
    fn access(&self, i: usize, chunk: Option<ChunkId>) -> Access<'k> {
        Access {
            key: self.keys[i],
            hash: self.hashes[i],
            chunk,
            position: self.position(i),
        }
    }

    /// A finished request may only record keys it has already seen.
    fn check_may_record(
        &self,
        req: &RequestState,
        mut which: impl Iterator<Item = usize>,
    ) -> Result<()> {
        if !req.finished {
            return Ok(());
        }
        match which.find(|&i| self.slots[i].is_none()) {
            Some(i) => Err(CoreError::RequestFinished(format!(
                "request already finished; it cannot record the new key {}",
                show_key(self.keys[i])
            ))),
            None => Ok(()),
        }
    }
}

/// Positions must line up with the keys, and `-position` must be representable.
fn check_positions(keys: &[&[u8]], positions: Option<&[Option<i64>]>) -> Result<()> {
    let Some(p) = positions else { return Ok(()) };
    if p.len() != keys.len() {
        return Err(CoreError::InvalidArgument(format!(
            "expected {} positions, got {}",
            keys.len(),
            p.len()
        )));
    }
    check_position_range(p)
}

/// Refuse `i64::MIN`, whose negation (an LRU rank's) is not an `i64`.
fn check_position_range(p: &[Option<i64>]) -> Result<()> {
    if p.contains(&Some(i64::MIN)) {
        return Err(CoreError::InvalidArgument(
            "a token position is out of range".into(),
        ));
    }
    Ok(())
}

/// Reject an offer with a key longer than a slot can hold ([`MAX_KEY_LEN`]; `lens`: the keys'
/// lengths, in order).
fn check_key_lengths(mut lens: impl Iterator<Item = usize>) -> Result<()> {
    match lens.position(|n| !storable_len(n)) {
        Some(i) => Err(CoreError::InvalidArgument(format!(
            "key {i} is too long to store ({MAX_KEY_LEN} bytes at most)"
        ))),
        None => Ok(()),
    }
}

/// Reject an offer that names a key twice.
fn check_distinct(keys: &[&[u8]], hashes: &[u64]) -> Result<()> {
    match first_repeat(hashes, |a, b| keys[a] == keys[b]) {
        Some(i) => Err(CoreError::DuplicateKey(format!(
            "key {} appears more than once in one prepare_store",
            show_key(keys[i])
        ))),
        None => Ok(()),
    }
}

/// The index of the first item equal (by `same`) to an earlier one, found through an
/// open-addressing table of item indexes keyed by `hashes` (on the stack for a normal batch).
fn first_repeat(hashes: &[u64], same: impl Fn(usize, usize) -> bool) -> Option<usize> {
    const EMPTY: u32 = u32::MAX;
    let n = hashes.len();
    if n < 2 {
        return None;
    }
    // At most half full; a batch of up to 32 items at most an eighth, so that an item's first
    // place is almost always free (at half full, whether it was free was close to a coin toss,
    // a mispredicted branch every other item).
    let size = (2 * n)
        .next_power_of_two()
        .max((8 * n).next_power_of_two().min(256));
    let mask = size - 1;
    let mut table: SmallVec<[u32; 256]> = smallvec::smallvec![EMPTY; size];
    for (i, &h) in hashes.iter().enumerate() {
        let mut j = (h as usize) & mask;
        loop {
            let t = table[j];
            if t == EMPTY {
                table[j] = i as u32;
                break;
            }
            if hashes[t as usize] == h && same(t as usize, i) {
                return Some(i);
            }
            j = (j + 1) & mask;
        }
    }
    None
}

/// `(chunk, occurrences)` for each distinct chunk of `chunks`.
fn multiplicities(chunks: &[ChunkId]) -> Scratch<(ChunkId, u32)> {
    let spread: Scratch<u64> = chunks
        .iter()
        .map(|&c| u64::from(c).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32)
        .collect();
    if first_repeat(&spread, |a, b| chunks[a] == chunks[b]).is_none() {
        return chunks.iter().map(|&c| (c, 1)).collect();
    }
    let mut sorted: Scratch<ChunkId> = chunks.iter().copied().collect();
    sorted.sort_unstable();
    let mut out: Scratch<(ChunkId, u32)> = Scratch::with_capacity(0);
    for &c in &sorted {
        match out.last_mut() {
            Some((last, n)) if *last == c => *n += 1,
            _ => out.push((c, 1)),
        }
    }
    out
}

/// A finishing request's keys, head to tail: by KV group (ascending), each group in first-seen
/// order, re-sorted by position when all its keys have one; then, when every key has a position,
/// the whole list re-sorted (stably) by position.
fn head_to_tail(req: &RequestState, positions: &[Option<i64>]) -> Vec<usize> {
    let groups: recycle::Recycled<u32> = req.seen_keys().map(group_of).collect();
    order_head_to_tail(&groups, positions)
}

/// [`head_to_tail`] of keys in KV groups `groups` (first-seen order) at `positions`. The sorts
/// are stable, so a list already in order is left as it is: each is skipped when a scan finds
/// nothing to move (a request's keys usually arrive head first, in one group).
fn order_head_to_tail(groups: &[u32], positions: &[Option<i64>]) -> Vec<usize> {
    let n = groups.len();
    let mut order = recycle::take(n);
    order.extend(0..n);
    if positions.iter().all(Option::is_some) {
        // By position, ties by group, then first seen: what sorting each group by position and
        // then the whole list (stably) by position gives.
        let key = |i: usize| (positions[i], groups[i]);
        if !(1..n).all(|i| key(i - 1) <= key(i)) {
            order.sort_by_key(|&i| key(i));
        }
        return order;
    }
    if !groups.is_sorted() {
        order.sort_by_key(|&i| groups[i]);
    }
    let mut start = 0;
    while start < n {
        let g = groups[order[start]];
        let end = start
            + order[start..]
                .iter()
                .take_while(|&&i| groups[i] == g)
                .count();
        let run = &mut order[start..end];
        if run.iter().all(|&i| positions[i].is_some()) && !run.is_sorted_by_key(|&i| positions[i]) {
            run.sort_by_key(|&i| positions[i]);
        }
        start = end;
    }
    order
}

// --- liveness of pending writes ---

/// The age of pending writes, and their optional expiry (see [`PendingWrites`]). Times are
/// seconds on a monotonic clock (the caller's readings, or the clock source); a reading earlier
/// than the latest one counts as the latest one.
impl Manager {
    /// Move the clock to `now`: writes placed from here on start at it.
    pub fn set_clock(&mut self, now: f64) {
        self.liveness.set_now(now);
    }

    /// Read `source` whenever writes are placed (`None`: only [`set_clock`](Self::set_clock)
    /// and the `now` arguments below move the clock).
    pub fn set_clock_source(&mut self, source: Option<fn() -> f64>) {
        self.liveness.set_source(source);
    }

    /// The age at `now` of the oldest pending write, `None` when no write is pending.
    pub fn oldest_pending_write(&mut self, now: f64) -> Option<f64> {
        self.liveness.set_now(now);
        let clock = self.liveness.now();
        self.liveness
            .oldest(&self.slots)
            .map(|(start, _)| clock - start)
    }

    /// Writes pending now (ref count -1).
    #[must_use]
    pub fn num_pending_writes(&self) -> usize {
        self.slots.num_pending()
    }

    /// End every write older than `timeout` at `now` (`now - start > timeout`) exactly as
    /// `complete_store(keys, false)` would: chunks freed, one metadata-only removal event.
    /// Returns `(chunk, key)` of each, oldest first.
    pub fn expire_pending_writes(&mut self, now: f64, timeout: f64) -> Vec<(ChunkId, KeyBuf)> {
        self.apply_releases();
        self.liveness.set_now(now);
        let chunks = self.liveness.take_overdue(timeout, &self.slots);
        if chunks.is_empty() {
            return Vec::new();
        }
        let keys: Vec<KeyBuf> = chunks.iter().map(|&c| self.slots.key(c)).collect();
        let slices: Vec<&[u8]> = keys.iter().map(KeyBuf::as_slice).collect();
        let freed = self.complete_store(&slices, false);
        debug_assert_eq!(freed, chunks, "every overdue write was pending");
        chunks.into_iter().zip(keys).collect()
    }

    /// Writes expired since the last call; the count restarts.
    pub fn take_expired_writes(&mut self) -> u64 {
        self.liveness.take_expired()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The head-to-tail order as SPEC.md states it, step by step: by group, each group by
    /// position when all its keys have one, then all by position when every key has one.
    fn head_to_tail_by_the_rules(groups: &[u32], positions: &[Option<i64>]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..groups.len()).collect();
        order.sort_by_key(|&i| groups[i]);
        for g in groups
            .iter()
            .copied()
            .collect::<std::collections::BTreeSet<u32>>()
        {
            let members: Vec<usize> = order.iter().copied().filter(|&i| groups[i] == g).collect();
            if members.iter().all(|&i| positions[i].is_some()) {
                let at = order.iter().position(|&i| groups[i] == g).unwrap_or(0);
                let mut run = members;
                run.sort_by_key(|&i| positions[i]);
                order.splice(at..at + run.len(), run);
            }
        }
        if positions.iter().all(Option::is_some) {
            order.sort_by_key(|&i| positions[i]);
        }
        order
    }

    /// A manager of `num_chunks` chunks under `policy`: events off, no admission threshold.
    fn manager(num_chunks: u32, policy: PolicyKind) -> Manager {
        manager_with_events(num_chunks, policy, false)
    }

    /// [`manager`], events on when `events`.
    fn manager_with_events(num_chunks: u32, policy: PolicyKind, events: bool) -> Manager {
        Manager::new(&ManagerConfig {
            num_chunks,
            policy,
            enable_events: events,
            store_threshold: 1,
            max_tracker_size: 8,
            admission: Admission::default(),
        })
        .unwrap()
    }

    /// A manager of 8 chunks under `policy` holding four ready keys (chunks 0-3), one of
    /// them (chunk 1) pinned by a load.
    fn corruptible(policy: PolicyKind) -> Manager {
        let mut m = manager(8, policy);
        let keys: Vec<[u8; 4]> = (0..4u32).map(u32::to_le_bytes).collect();
        let refs: Vec<&[u8]> = keys.iter().map(<[u8; 4]>::as_slice).collect();
        let mut req = m.new_request_state();
        m.prepare_store(&refs, None, &mut req).unwrap().unwrap();
        m.complete_store(&refs, true);
        m.prepare_load(&refs[1..2], None, &mut req).unwrap();
        m.validate().unwrap();
        m
    }

    #[test]
    fn validate_finds_each_broken_invariant() {
        type Corrupt = fn(&mut Manager);
        let cases: [(&str, Corrupt, Option<&str>); 5] = [
            ("a resident chunk freed", |m| m.pool.free(0), None),
            (
                "a key dropped from its slot",
                |m| {
                    m.slots.remove(2);
                },
                None,
            ),
            (
                "scratch marks left set",
                |m| {
                    let need = m.marks.len().max(1);
                    m.marks.resize(need, 0);
                    m.marks[0] = 1;
                },
                Some("scratch marks"),
            ),
            (
                "a chunk dropped by the policy",
                |m| m.policy.remove(3),
                None,
            ),
            (
                "a pinned chunk's policy entry made evictable",
                |m| m.policy.mark_evictable(1),
                None,
            ),
        ];
        for (_, kind) in PolicyKind::ALL {
            for (what, corrupt, says) in cases {
                let mut m = corruptible(kind);
                corrupt(&mut m);
                let Err(e) = m.validate() else {
                    panic!("{kind:?}: validate missed {what}");
                };
                if let Some(says) = says {
                    assert!(e.to_string().contains(says), "{kind:?}, {what}: {e}");
                }
            }
        }
    }

    #[test]
    fn a_load_naming_a_key_twice_pins_it_twice_and_records_it_once() {
        // Checked: it fails when `prepare_load` misses the repeat.
        let mut m = manager(200, PolicyKind::Lru);
        let keys: Vec<[u8; 4]> = (0..150u32).map(u32::to_le_bytes).collect();
        let refs: Vec<&[u8]> = keys.iter().map(<[u8; 4]>::as_slice).collect();
        let mut req = m.new_request_state();
        m.prepare_store(&refs, None, &mut req).unwrap().unwrap();
        m.complete_store(&refs, true);
        // Chunks far apart (different mark words) and next to each other, repeated or not.
        for load in [vec![3, 140, 3], vec![7, 8, 9], vec![130, 64, 65, 130, 130]] {
            let mut req = m.new_request_state();
            let batch: Vec<&[u8]> = load.iter().map(|&i| refs[i]).collect();
            let chunks = m.prepare_load(&batch, None, &mut req).unwrap();
            let mut once: Vec<&[u8]> = Vec::new();
            for k in &batch {
                if !once.contains(k) {
                    once.push(k);
                }
            }
            assert_eq!(req.seen_keys().collect::<Vec<_>>(), once);
            for (&k, &c) in batch.iter().zip(&chunks) {
                let times = batch.iter().filter(|&&b| b == k).count() as u32;
                assert_eq!(m.slots.state(c), ChunkState::Ready(times));
            }
            m.validate().unwrap();
            m.complete_load(&batch).unwrap();
            m.validate().unwrap();
        }
    }

    #[test]
    fn a_finish_refuses_the_least_position_and_changes_nothing() {
        let mut m = manager(4, PolicyKind::Arc);
        let keys: [&[u8]; 2] = [b"a", b"b"];
        let mut req = m.new_request_state();
        m.prepare_store(&keys, None, &mut req).unwrap().unwrap();
        m.complete_store(&keys, true);
        let bad = [Some(16), Some(i64::MIN)];
        assert!(matches!(
            m.on_request_finished(&mut req, &bad),
            Err(CoreError::InvalidArgument(_))
        ));
        assert!(!req.is_finished());
        m.on_request_finished(&mut req, &[Some(16), Some(i64::MIN + 1)])
            .unwrap();
        assert!(req.is_finished());
        m.validate().unwrap();
    }

    #[test]
    fn a_fresh_state_takes_up_its_managers_rank_and_no_other() {
        let mut m = manager(8, PolicyKind::Lru);
        let other = manager(8, PolicyKind::Lru);
        let mut req = m.new_request_state();
        assert_eq!(req.rank_tag(), None);
        let keys: [&[u8]; 1] = [b"a"];
        m.prepare_store(&keys, Some(&[Some(16)]), &mut req)
            .unwrap()
            .unwrap();
        let tag = req
            .rank_tag()
            .expect("a positioned store draws the request's rank");
        // Another manager's state, or a disowned one, does not take it up.
        assert!(!other.new_request_state().adopt_rank(tag));
        let mut gone = m.new_request_state();
        gone.disown();
        assert!(!gone.adopt_rank(tag));
        // Nor does a disowned state take up a disowned state's rank (both are no manager's).
        let mut dropped = req.clone();
        dropped.disown();
        let orphan = dropped.rank_tag().expect("a disowned state keeps its rank");
        assert!(!gone.adopt_rank(orphan));
        // A fresh state of the same manager does, and records with it: no new rank is drawn.
        let mut again = m.new_request_state();
        assert!(again.adopt_rank(tag));
        assert!(!again.adopt_rank(tag), "a state keeps the rank it has");
        let drawn = |m: &Manager| match m.policy_state() {
            PolicyState::Lru { next_rank, .. } => next_rank,
            _ => unreachable!(),
        };
        let before = drawn(&m);
        let more: [&[u8]; 1] = [b"b"];
        m.prepare_store(&more, Some(&[Some(32)]), &mut again)
            .unwrap()
            .unwrap();
        assert_eq!(drawn(&m), before);
        assert_eq!(again.rank_tag(), Some(tag));
        // After a reset, the tag is of an old generation.
        m.reset_cache();
        assert!(!m.new_request_state().adopt_rank(tag));
        m.validate().unwrap();
    }

    #[test]
    fn a_disowned_state_is_no_managers() {
        let m = manager(4, PolicyKind::Lru);
        let mut req = m.new_request_state();
        assert!(m.is_current(&req));
        req.disown();
        assert!(!m.is_current(&req));
    }

    #[test]
    fn evictions_copy_keys_only_when_asked_or_for_events() {
        for (asked, events) in [(true, false), (false, false), (false, true)] {
            let mut m = manager_with_events(2, PolicyKind::Lru, events);
            m.set_evicted_keys(asked);
            let long = [7u8; crate::table::INLINE_KEY + 5]; // kept apart from its slot: removed too
            let keys: [&[u8]; 4] = [b"a", &long, b"c", b"d"];
            let mut req = m.new_request_state();
            m.prepare_store(&keys[..2], None, &mut req)
                .unwrap()
                .unwrap();
            m.complete_store(&keys[..2], true);
            let out = m
                .prepare_store(&keys[2..], None, &mut req)
                .unwrap()
                .unwrap();
            assert_eq!(out.evicted_chunks, vec![0, 1]);
            let want: Vec<KeyBuf> = if asked || events {
                vec![KeyBuf::from_slice(b"a"), KeyBuf::from_slice(&long)]
            } else {
                Vec::new()
            };
            assert_eq!(out.evicted, want);
            assert!(!m.is_resident(&long) && m.is_resident(b"c"));
            m.validate().unwrap();
            if events {
                let removed: Vec<Vec<KeyBuf>> = m
                    .take_events()
                    .into_iter()
                    .filter(|e| e.removed)
                    .map(|e| e.keys)
                    .collect();
                assert_eq!(removed, vec![want]);
            }
        }
    }

    #[test]
    fn events_name_chunks_and_places_instead_of_keys_when_asked() {
        let mut m = manager_with_events(2, PolicyKind::Lru, true);
        m.set_evicted_keys(false);
        m.set_event_chunks(true);
        let keys: [&[u8]; 4] = [b"a", b"b", b"c", b"d"];
        let mut req = m.new_request_state();
        m.prepare_store(&keys[..2], None, &mut req)
            .unwrap()
            .unwrap();
        // "x" is not pending: it takes no place in the event.
        m.complete_store(&[b"x", keys[1], keys[0]], true);
        let out = m
            .prepare_store(&keys[2..], None, &mut req)
            .unwrap()
            .unwrap();
        assert!(out.evicted.is_empty(), "no key copied for the event either");
        m.complete_store(&[keys[3], keys[2]], false);
        let events: Vec<_> = m
            .take_events()
            .into_iter()
            .map(|e| {
                (
                    e.keys.len(),
                    e.chunks,
                    e.positions,
                    e.removed,
                    e.metadata_only,
                )
            })
            .collect();
        assert_eq!(
            events,
            vec![
                (0, vec![1, 0], vec![1, 2], false, false),
                (0, out.evicted_chunks.clone(), Vec::new(), true, false),
                (
                    0,
                    vec![out.chunks[1], out.chunks[0]],
                    vec![0, 1],
                    true,
                    true
                ),
            ]
        );
        // Off again: keys, and no chunks.
        m.set_event_chunks(false);
        m.prepare_store(&keys[..1], None, &mut req)
            .unwrap()
            .unwrap();
        m.complete_store(&keys[..1], true);
        let e = m.take_events().pop().unwrap();
        assert_eq!(
            (e.keys, e.chunks, e.positions),
            (vec![KeyBuf::from_slice(b"a")], vec![], vec![])
        );
        m.validate().unwrap();
    }

    #[test]
    fn a_finish_takes_vouched_chunks_as_they_are_and_looks_the_rest_up() {
        let keys: Vec<[u8; 4]> = (0..4u32).map(u32::to_le_bytes).collect();
        let refs: Vec<&[u8]> = keys.iter().map(<[u8; 4]>::as_slice).collect();
        for (_, kind) in PolicyKind::ALL {
            // Keys 0-2 stored, key 3's store failed (its chunk free again), key 0 loaded once
            // more; then the request finishes with every chunk vouched for, or none.
            let run = |vouch: bool| {
                let mut m = manager(8, kind);
                let mut req = m.new_request_state();
                m.prepare_store(&refs, None, &mut req).unwrap().unwrap();
                m.complete_store(&refs[..3], true);
                m.complete_store(&refs[3..], false);
                m.prepare_load(&refs[..1], None, &mut req).unwrap();
                m.complete_load(&refs[..1]).unwrap();
                let asked = std::cell::RefCell::new(Vec::new());
                m.on_request_finished_vouched(&mut req, &[None; 4], |i, c| {
                    asked.borrow_mut().push((i, c));
                    vouch
                })
                .unwrap();
                m.validate().unwrap();
                (m.policy_state(), m.resident(), asked.into_inner())
            };
            let (vouched, plain) = (run(true), run(false));
            // The same outcome: a vouched chunk holds its key here, and key 3's (free) falls
            // back to the lookup, which finds nothing.
            assert_eq!((&vouched.0, &vouched.1), (&plain.0, &plain.1), "{kind:?}");
            // Asked once a key, head to tail, with the chunk the request last saw it at.
            let mut seen: Vec<usize> = vouched.2.iter().map(|&(i, _)| i).collect();
            seen.sort_unstable();
            assert_eq!(seen, [0, 1, 2, 3], "{kind:?}");
        }
    }

    #[test]
    fn a_read_pins_as_a_load_does_and_records_no_access() {
        let keys: Vec<[u8; 4]> = (0..5u32).map(u32::to_le_bytes).collect();
        let refs: Vec<&[u8]> = keys.iter().map(<[u8; 4]>::as_slice).collect();
        // Keys 0-2 ready, 3 pending, 4 absent; the request that stored them finished.
        let filled = |kind| {
            let mut m = manager(8, kind);
            let mut req = m.new_request_state();
            m.prepare_store(&refs[..4], None, &mut req)
                .unwrap()
                .unwrap();
            m.complete_store(&refs[..3], true);
            m.on_request_finished(&mut req, &[None; 4]).unwrap();
            m
        };
        for (_, kind) in PolicyKind::ALL {
            let mut m = filled(kind);
            let (resident, order) = (m.resident(), m.policy_state());
            // An absent key, a pending one: refused, nothing changed.
            for bad in [refs[4], refs[3]] {
                let err = m.prepare_read(&[refs[0], bad]).unwrap_err();
                assert!(matches!(err, CoreError::KeyState(_)), "{kind:?}: {err}");
                assert_eq!(m.resident(), resident, "{kind:?}");
            }
            // A repeated key is pinned twice, as by a load, at the chunks a load would name.
            let chunks = m.prepare_read(&[refs[2], refs[0], refs[2]]).unwrap();
            let mut other = m.new_request_state();
            let loaded = m.prepare_load(&[refs[2], refs[0], refs[2]], None, &mut other);
            assert_eq!(loaded.unwrap(), chunks, "{kind:?}");
            let pins = |m: &Manager, k: &[u8]| {
                m.resident()
                    .into_iter()
                    .find(|(key, ..)| key.as_slice() == k)
                    .unwrap()
                    .2
            };
            assert_eq!((pins(&m, refs[2]), pins(&m, refs[0])), (4, 2), "{kind:?}");
            m.complete_load(&[refs[2], refs[0], refs[2]]).unwrap();
            m.complete_load(&[refs[2], refs[0], refs[2]]).unwrap();
            m.validate().unwrap();
            // The load recorded its keys for `other`; the read recorded nothing anywhere, so a
            // manager that only read is back where it started.
            assert_eq!(m.resident(), resident, "{kind:?}");
            let mut only_read = filled(kind);
            only_read.prepare_read(&[refs[2], refs[0]]).unwrap();
            only_read.complete_load(&[refs[2], refs[0]]).unwrap();
            assert_eq!(only_read.policy_state(), order, "{kind:?}");
        }
    }

    #[test]
    fn a_load_past_the_pin_limit_fails_only_after_every_key_is_found_loadable() {
        let mut m = manager(8, PolicyKind::Lru);
        let keys: Vec<[u8; 4]> = (0..4u32).map(u32::to_le_bytes).collect();
        let refs: Vec<&[u8]> = keys.iter().map(<[u8; 4]>::as_slice).collect();
        let mut req = m.new_request_state();
        m.prepare_store(&refs[..3], None, &mut req)
            .unwrap()
            .unwrap();
        m.complete_store(&refs[..3], true);
        // Key 0 is pinned as far as it can go; key 1 one pin short of that (pinned once by a
        // real load, so every counter and the policy know them pinned, then pinned more).
        let mut req = m.new_request_state();
        let pinned = m.prepare_load(&refs[..2], None, &mut req).unwrap();
        let (full, near) = (pinned[0], pinned[1]);
        m.slots.force_pins(full, i32::MAX as u32);
        m.slots.force_pins(near, i32::MAX as u32 - 1);
        let before = m.resident();
        let load = |m: &mut Manager, batch: &[&[u8]]| {
            let mut req = m.new_request_state();
            m.prepare_load(batch, None, &mut req)
        };
        // An absent key after the full one: the absent key is what the error names.
        let err = load(&mut m, &[refs[0], refs[3]]).unwrap_err();
        assert!(matches!(&err, CoreError::KeyState(msg) if msg.contains("not in the cache")));
        m.validate().unwrap(); // no scratch mark left set by the failed load
        assert!(matches!(
            load(&mut m, &[refs[2], refs[0]]),
            Err(CoreError::Overflow(_))
        ));
        // One more pin fits key 1, two do not (the repeated-key way of checking).
        assert!(matches!(
            load(&mut m, &[refs[1], refs[1]]),
            Err(CoreError::Overflow(_))
        ));
        assert_eq!(m.resident(), before);
        m.validate().unwrap();
        let chunks = load(&mut m, &[refs[1], refs[2]]).unwrap();
        assert_eq!(m.slots.state(chunks[1]), ChunkState::Ready(1));
        assert_eq!(m.slots.state(near), ChunkState::Ready(i32::MAX as u32));
    }

    proptest! {
        /// The order with its sorts skipped when there is nothing to move equals the rules'
        /// (few groups and positions, so ties and sorted runs are common).
        #[test]
        #[cfg_attr(miri, ignore = "too slow under Miri (over 4 minutes)")]
        fn head_to_tail_follows_the_rules(
            keys in proptest::collection::vec((0u32..3, proptest::option::weighted(0.9, -3i64..4)), 0..24),
            sorted in any::<bool>(),
        ) {
            let mut keys = keys;
            if sorted {
                keys.sort_by_key(|&(g, p)| (g, p));
            }
            let groups: Vec<u32> = keys.iter().map(|k| k.0).collect();
            let positions: Vec<Option<i64>> = keys.iter().map(|k| k.1).collect();
            prop_assert_eq!(
                order_head_to_tail(&groups, &positions),
                head_to_tail_by_the_rules(&groups, &positions)
            );
        }
    }

    /// The offer's resident chunks are spared by the eviction it causes, and only by that
    /// one: the marks are cleared after every eviction (made, refused or impossible), so a
    /// chunk protected once is evictable by the next call.
    #[test]
    fn protection_lasts_one_eviction() {
        let mut m = manager(2, PolicyKind::Lru);
        let mut req = m.new_request_state();
        let store = |m: &mut Manager, req: &mut RequestState, keys: &[&[u8]]| {
            let out = m.prepare_store(keys, None, req).unwrap()?;
            let stored: Vec<&[u8]> = out.to_store.iter().map(|&i| keys[i]).collect();
            m.complete_store(&stored, true);
            Some(out.evicted)
        };
        store(&mut m, &mut req, &[b"a", b"b"]).unwrap();
        // "a" is the oldest, but offered again: "b" goes instead.
        let evicted = store(&mut m, &mut req, &[b"a", b"c"]).unwrap();
        assert_eq!(evicted, vec![KeyBuf::from_slice(b"b")]);
        m.validate().unwrap();
        // Two absent keys and no room without the protected ones: refused, marks cleared.
        assert!(store(&mut m, &mut req, &[b"a", b"c", b"d"]).is_none());
        m.validate().unwrap();
        // Not offered now: "a" (the oldest) is evictable again.
        let evicted = store(&mut m, &mut req, &[b"e"]).unwrap();
        assert_eq!(evicted, vec![KeyBuf::from_slice(b"a")]);
        m.validate().unwrap();
    }

    /// Keys of 4 GiB or more cannot be stored (their lengths are kept in 32 bits): the offer
    /// is refused with the first such key's index. (Lengths only: no such key is allocated.)
    #[test]
    #[cfg_attr(miri, ignore = "Miri has no read-only mmap")]
    fn keys_too_long_to_store_are_refused() {
        assert!(check_key_lengths([36, 0, MAX_KEY_LEN].into_iter()).is_ok());
        let err = check_key_lengths([36, MAX_KEY_LEN + 1, 1 << 40].into_iter()).unwrap_err();
        assert!(matches!(err, CoreError::InvalidArgument(ref m) if m.starts_with("key 1 ")));
        // Through `prepare_store`, with a real key of 4 GiB + 1 bytes: a mapping that is never
        // written (and, as the check comes first, never read), so it costs no memory.
        let len = MAX_KEY_LEN + 1;
        // SAFETY: a fresh private anonymous read-only mapping of `len` bytes (not reserved
        // against swap); it is only lent out as the slice below and unmapped after its last use.
        let huge: &[u8] = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            );
            assert!(p != libc::MAP_FAILED, "cannot map {len} bytes");
            std::slice::from_raw_parts(p.cast::<u8>(), len)
        };
        let mut m = manager(4, PolicyKind::Arc);
        let mut req = m.new_request_state();
        let keys: [&[u8]; 2] = [b"a", huge];
        let err = m.prepare_store(&keys, None, &mut req).unwrap_err();
        assert!(matches!(err, CoreError::InvalidArgument(ref m) if m.starts_with("key 1 ")));
        assert!(req.seen_keys().len() == 0 && m.resident().is_empty());
        m.validate().unwrap();
        // SAFETY: the mapping made above, no longer borrowed (`keys` and `huge` are dead).
        unsafe { libc::munmap(huge.as_ptr().cast_mut().cast(), len) };
    }
}
