//! `RequestState`: what one request has done to one manager since its cache generation began.
//!
//! The keys the request saw, in first-seen order, each flagged as inserted (the request got a
//! chunk for it), reused (loaded, or offered while readable, when not inserted before) and
//! reported (passed to the policy's `on_store_miss`). Flags only ever get set. The state is
//! owned by the request's context, not by the manager, so it goes away with the request.

use crate::key::{key_buf, KeyBuf};
use crate::policy::RequestRank;
use crate::pool::ChunkId;
use hashbrown::HashSet;

/// The request got a chunk for the key in `prepare_store`.
pub(crate) const INSERTED: u8 = 1;
/// The request loaded the key or offered it while readable (and had not inserted it then).
pub(crate) const REUSED: u8 = 2;
/// The key was reported to the policy's `on_store_miss` for this request (kept only for a
/// policy that reads store misses: for any other, nothing reads it).
pub(crate) const REPORTED: u8 = 4;

/// Keys the index of a request's first recording call makes room for (a few KiB): a request
/// records a batch at a time, and growing from a small table would rehash at every batch.
const FIRST_INDEX: usize = 256;

/// How many more entries a per-request list of `len` entries should make room for when `n`
/// more do not fit: at least `n`, at least as many as it has (it doubles), and at least
/// [`FIRST_INDEX`] in all. The core's seen keys and their index, and the binding's key objects
/// lined up with them, all grow by this rule.
#[must_use]
pub fn room_for(len: usize, n: usize) -> usize {
    n.max(len).max(FIRST_INDEX.saturating_sub(len))
}

/// A key the request saw and how it used it.
#[derive(Debug, Clone)]
pub(crate) struct SeenKey {
    pub(crate) key: KeyBuf,
    /// The key's hash, kept so the table never rehashes a key when it grows (and the manager
    /// finds a finishing request's chunks without hashing its keys again).
    pub(crate) hash: u64,
    /// The chunk the key was last seen at by this request ([`NO_CHUNK`]: none): a guess,
    /// checked against the slot before use, that spares a lookup when the request finishes.
    pub(crate) chunk: ChunkId,
    pub(crate) flags: u8,
}

impl SeenKey {
    /// A key just seen, with no flags, at `chunk` if resident.
    fn new(key: &[u8], hash: u64, chunk: Option<ChunkId>) -> Self {
        Self {
            key: key_buf(key),
            hash,
            chunk: chunk.unwrap_or(NO_CHUNK),
            flags: 0,
        }
    }
}

/// [`SeenKey::chunk`] of a key the request has not seen in a chunk.
pub(crate) const NO_CHUNK: ChunkId = ChunkId::MAX;

/// Per-request state, tagged with the manager and cache generation it belongs to.
#[derive(Debug, Clone)]
pub struct RequestState {
    pub(crate) owner: u64,
    pub(crate) generation: u64,
    pub(crate) finished: bool,
    /// The policy's per-request slot (LRU: the request rank).
    pub(crate) rank: RequestRank,
    /// Index into `seen` by key hash.
    table: SeenIndex,
    /// Sketch hashes of the keys this request has counted in a `TinyLFU` sketch.
    pub(crate) counted: HashSet<u64>,
    pub(crate) seen: Vec<SeenKey>,
    /// For each key the last recording call added to `seen` (in `seen` order): its index among
    /// that call's keys. Lets a caller keep something per seen key (its key object, say).
    pub(crate) added: Vec<u32>,
}

impl RequestState {
    pub(crate) fn new(owner: u64, generation: u64) -> Self {
        Self {
            owner,
            generation,
            finished: false,
            rank: None,
            table: SeenIndex::default(),
            counted: HashSet::new(),
            seen: Vec::new(),
            added: Vec::new(),
        }
    }

    /// Whether `on_request_finished` has run for this state.
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The keys seen, in first-seen order.
    #[must_use]
    pub fn seen_keys(&self) -> impl ExactSizeIterator<Item = &[u8]> {
        self.seen.iter().map(|s| s.key.as_slice())
    }

    /// For each key the last successful recording call (`prepare_load`, `prepare_store`) added
    /// to [`seen_keys`](Self::seen_keys), in that order: its index among the call's keys. Empty
    /// after a call that failed.
    #[must_use]
    pub fn last_added(&self) -> &[u32] {
        &self.added
    }

    /// Index of `key` among [`seen_keys`](Self::seen_keys), if the request saw it.
    #[must_use]
    pub fn index_of(&self, key: &[u8]) -> Option<usize> {
        self.find(key, crate::key::hash_key(key))
    }

    #[inline]
    pub(crate) fn find(&self, key: &[u8], hash: u64) -> Option<usize> {
        self.table
            .probe(hash, |j| self.seen[j].key.as_slice() == key)
            .ok()
    }

    /// Make room for `n` more keys. The key list and its index start at [`FIRST_INDEX`] keys
    /// and at least double when they grow, so a request's keys are moved by few reallocations
    /// and rehashes.
    pub(crate) fn reserve(&mut self, n: usize) {
        let len = self.seen.len();
        let extra = room_for(len, n);
        if self.seen.capacity() - len < n {
            self.seen.reserve_exact(extra);
        }
        self.table.reserve(len + n, len + extra, &self.seen);
    }

    /// Forget the keys added after the first `len` (undoing a call that failed).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.added.clear();
        while self.seen.len() > len {
            let i = self.seen.len() - 1;
            self.table.remove_last(self.seen[i].hash, i);
            self.seen.pop();
        }
    }

    /// Add a key the request has not seen; returns its index. Room for it must be reserved.
    // Inlined into the manager's recording loop (out of line, it measured 5-10% more
    // instructions a recorded key under callgrind).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn add(&mut self, key: &[u8], hash: u64, chunk: Option<ChunkId>) -> usize {
        let i = self.seen.len();
        let at = match self.table.probe(hash, |_| false) {
            Ok(at) | Err(at) => at,
        };
        self.table.put(at, hash, i);
        self.seen.push(SeenKey::new(key, hash, chunk));
        i
    }

    /// The index of `key` among the seen keys, adding it first if the request has not seen
    /// it (`true`: added): one probe of the index either way. Room for it must be reserved.
    // As `add`.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn find_or_add(
        &mut self,
        key: &[u8],
        hash: u64,
        chunk: Option<ChunkId>,
    ) -> (usize, bool) {
        match self
            .table
            .probe(hash, |j| self.seen[j].key.as_slice() == key)
        {
            Ok(j) => (j, false),
            Err(at) => {
                let i = self.seen.len();
                self.table.put(at, hash, i);
                self.seen.push(SeenKey::new(key, hash, chunk));
                (i, true)
            }
        }
    }
}

/// A request's index of its seen keys by hash: open addressing with linear probing, at most
/// half full, each entry the high 32 bits of a key's hash (its tag) above its index in `seen`
/// plus one (0: empty). One probe finds a key or the place to add it, where a general hash
/// table probes again to insert.
///
/// Entries are only ever removed last-added-first ([`RequestState::truncate`]), so a removed
/// entry is simply cleared: every entry added before it that probed past its place would have
/// found the place taken by an entry still present.
#[derive(Debug, Clone, Default)]
struct SeenIndex {
    entries: Vec<u64>,
}

impl SeenIndex {
    fn tag(hash: u64) -> u64 {
        hash >> 32
    }

    fn home(&self, hash: u64) -> usize {
        hash as usize & (self.entries.len() - 1)
    }

    /// `Ok(j)`: the entry of the seen key `j` for which `eq(j)` holds, among those with
    /// `hash`'s tag. `Err(at)`: no such key; `at` is the empty place to add it (`usize::MAX`
    /// while the index has no room at all).
    #[inline]
    fn probe(&self, hash: u64, eq: impl Fn(usize) -> bool) -> Result<usize, usize> {
        if self.entries.is_empty() {
            return Err(usize::MAX);
        }
        let mask = self.entries.len() - 1;
        let tag = Self::tag(hash);
        let mut at = self.home(hash);
        loop {
            let e = self.entries[at];
            if e == 0 {
                return Err(at);
            }
            if e >> 32 == tag {
                let j = (e as u32 - 1) as usize;
                if eq(j) {
                    return Ok(j);
                }
            }
            at = (at + 1) & mask;
        }
    }

    /// Put seen key `j` (hashing to `hash`) at `at`, an empty place [`probe`](Self::probe)
    /// gave for `hash`.
    #[inline]
    fn put(&mut self, at: usize, hash: u64, j: usize) {
        self.entries[at] = (Self::tag(hash) << 32) | (j as u64 + 1);
    }

    /// Clear the entry of seen key `j`, the last one added.
    fn remove_last(&mut self, hash: u64, j: usize) {
        if self.entries.is_empty() {
            return;
        }
        let mask = self.entries.len() - 1;
        let mut at = self.home(hash);
        for _ in 0..self.entries.len() {
            let e = self.entries[at];
            if e == 0 {
                return;
            }
            if e as u32 as usize == j + 1 {
                self.entries[at] = 0;
                return;
            }
            at = (at + 1) & mask;
        }
    }

    /// Make room for `want` keys in all, growing to fit `grow_to` when it must grow; the keys
    /// already indexed are `seen`, re-added in order from their kept hashes.
    fn reserve(&mut self, want: usize, grow_to: usize, seen: &[SeenKey]) {
        if want * 2 <= self.entries.len() {
            return;
        }
        let size = (grow_to.max(want) * 2).next_power_of_two();
        self.entries = vec![0; size];
        for (j, s) in seen.iter().enumerate() {
            if let Err(at) = self.probe(s.hash, |_| false) {
                self.put(at, s.hash, j);
            }
        }
    }
}
