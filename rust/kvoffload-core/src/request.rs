//! `RequestState`: what one request has done to one manager since its cache generation began.
//!
//! The keys the request saw, in first-seen order, each flagged as inserted (the request got a
//! chunk for it), reused (loaded, or offered while readable, when not inserted before) and
//! reported (passed to the policy's `on_store_miss`). Flags only ever get set. The state is
//! owned by the request's context, not by the manager, so it goes away with the request.

use crate::key::{key_buf, KeyBuf};
use crate::policy::RequestRank;
use crate::pool::ChunkId;
use hashbrown::{HashSet, HashTable};

/// The request got a chunk for the key in `prepare_store`.
pub(crate) const INSERTED: u8 = 1;
/// The request loaded the key or offered it while readable (and had not inserted it then).
pub(crate) const REUSED: u8 = 2;
/// The key was reported to the policy's `on_store_miss` for this request.
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
    table: HashTable<u32>,
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
            table: HashTable::new(),
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

    pub(crate) fn find(&self, key: &[u8], hash: u64) -> Option<usize> {
        let seen = &self.seen;
        self.table
            .find(hash, |&i| {
                let s = &seen[i as usize];
                s.hash == hash && s.key.as_slice() == key
            })
            .map(|&i| i as usize)
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
        if self.table.capacity() - self.table.len() < n {
            let seen = &self.seen;
            self.table.reserve(extra, |&j| seen[j as usize].hash);
        }
    }

    /// Forget the keys added after the first `len` (undoing a call that failed).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.added.clear();
        while self.seen.len() > len {
            let i = self.seen.len() - 1;
            let hash = self.seen[i].hash;
            if let Ok(entry) = self.table.find_entry(hash, |&j| j as usize == i) {
                entry.remove();
            }
            self.seen.pop();
        }
    }

    /// Add a key the request has not seen; returns its index. Room for it must be reserved.
    pub(crate) fn add(&mut self, key: &[u8], hash: u64, chunk: Option<ChunkId>) -> usize {
        let i = self.seen.len();
        self.seen.push(SeenKey::new(key, hash, chunk));
        let seen = &self.seen;
        self.table
            .insert_unique(hash, i as u32, |&j| seen[j as usize].hash);
        i
    }

    /// The index of `key` among the seen keys, adding it first if the request has not seen
    /// it (`true`: added): one probe of the index either way. Room for it must be reserved.
    pub(crate) fn find_or_add(
        &mut self,
        key: &[u8],
        hash: u64,
        chunk: Option<ChunkId>,
    ) -> (usize, bool) {
        let seen = &self.seen;
        let entry = self.table.entry(
            hash,
            |&j| {
                let s = &seen[j as usize];
                s.hash == hash && s.key.as_slice() == key
            },
            |&j| seen[j as usize].hash,
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(o) => (*o.get() as usize, false),
            hashbrown::hash_table::Entry::Vacant(v) => {
                let i = self.seen.len();
                self.seen.push(SeenKey::new(key, hash, chunk));
                v.insert(i as u32);
                (i, true)
            }
        }
    }
}
