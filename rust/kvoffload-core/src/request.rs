//! `RequestState`: what one request has done to one manager since its cache generation began.
//!
//! The keys the request saw, in first-seen order, each flagged as inserted (the request got a
//! chunk for it), reused (loaded, or offered while readable, when not inserted before) and
//! reported (passed to the policy's `on_store_miss`). Flags only ever get set. The state is
//! owned by the request's context, not by the manager, so it goes away with the request.
//!
//! Nothing in it needs dropping key by key: a seen key's bytes are inline in its entry, or (a
//! key longer than [`SEEN_INLINE`] bytes) in one byte buffer of the request's. So a request's
//! state goes away in a few frees, without reading its entries again: a finished request's
//! context is dropped on the scheduler's thread, long after its entries left the cache.

use crate::key::{copy_inline, INLINE_BYTES};
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

/// Key bytes a [`SeenKey`] holds inline (vLLM's keys, a 32-byte hash and a 4-byte group, fit).
pub(crate) const SEEN_INLINE: usize = INLINE_BYTES;

/// A key the request saw and how it used it. Plain data: dropping it does nothing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SeenKey {
    /// The key's hash, kept so the table never rehashes a key when it grows (and the manager
    /// finds a finishing request's chunks without hashing its keys again).
    pub(crate) hash: u64,
    /// The key's bytes when it has at most [`SEEN_INLINE`] of them (the rest zero); else its
    /// offset in [`RequestState::long`], in the first eight bytes (little-endian).
    bytes: [u8; SEEN_INLINE],
    /// The key's length in bytes.
    len: u32,
    /// The chunk the key was last seen at by this request ([`NO_CHUNK`]: none): a guess,
    /// checked against the slot before use, that spares a lookup when the request finishes.
    pub(crate) chunk: ChunkId,
    pub(crate) flags: u8,
}

impl SeenKey {
    /// Append to `seen` a key just seen, with `flags`, at `chunk` if resident; a long key's
    /// bytes are appended to `long`. The key's bytes are written into the entry in place (see
    /// [`copy_inline`]), not built beside it and copied in.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn push(
        seen: &mut Vec<SeenKey>,
        key: &[u8],
        hash: u64,
        chunk: Option<ChunkId>,
        flags: u8,
        long: &mut Vec<u8>,
    ) {
        let n = key.len();
        seen.push(Self {
            hash,
            bytes: [0; SEEN_INLINE],
            // The manager records only keys it could look up or store: under 4 GiB.
            len: u32::try_from(n).unwrap_or(u32::MAX),
            chunk: chunk.unwrap_or(NO_CHUNK),
            flags,
        });
        let Some(s) = seen.last_mut() else { return };
        if !copy_inline(&mut s.bytes, key) {
            s.bytes[..8].copy_from_slice(&(long.len() as u64).to_le_bytes());
            long.extend_from_slice(key);
        }
    }

    /// The offset of a long key's bytes in [`RequestState::long`].
    fn long_at(&self) -> usize {
        let mut at = [0u8; 8];
        at.copy_from_slice(&self.bytes[..8]);
        usize::try_from(u64::from_le_bytes(at)).unwrap_or(usize::MAX)
    }

    /// The key's bytes, given the request's long-key bytes.
    #[inline]
    fn key<'a>(&'a self, long: &'a [u8]) -> &'a [u8] {
        let n = self.len as usize;
        if n <= SEEN_INLINE {
            &self.bytes[..n]
        } else {
            let at = self.long_at();
            &long[at..at + n]
        }
    }
}

/// [`SeenKey::chunk`] of a key the request has not seen in a chunk.
pub(crate) const NO_CHUNK: ChunkId = ChunkId::MAX;

/// A request's policy rank with the manager (its id) and cache generation that drew it.
///
/// vLLM's LRU keeps a request's rank on the context apart from its manager's request state, so
/// the rank outlives another manager's replacing of that state; a rank kept by its tag does
/// the same (see [`RequestState::rank_tag`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankTag {
    /// The id of the manager that drew the rank.
    pub owner: u64,
    /// Its cache generation then.
    pub generation: u64,
    /// The rank.
    pub rank: u64,
}

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
    /// The bytes of the seen keys longer than [`SEEN_INLINE`] bytes, one after another in
    /// first-seen order.
    long: Vec<u8>,
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
            long: Vec::new(),
            added: Vec::new(),
        }
    }

    /// Make this state no manager's (no manager has id 0): every manager then takes it for no
    /// state at all, stale as after a reset. For a state handed to a request by a call that
    /// then failed: as if the call had never made it.
    pub fn disown(&mut self) {
        self.owner = 0;
    }

    /// The policy's rank for this request (LRU's, once drawn), tagged with the manager and
    /// cache generation it belongs to. Kept beside the state (on the request context) it lets
    /// a fresh state of the same manager and generation take the rank up again (see
    /// [`adopt_rank`](Self::adopt_rank)).
    #[must_use]
    pub fn rank_tag(&self) -> Option<RankTag> {
        self.rank.map(|rank| RankTag {
            owner: self.owner,
            generation: self.generation,
            rank,
        })
    }

    /// Take up `tag`'s rank if it was drawn by this state's manager in its cache generation
    /// and this state has none yet; whether it did.
    pub fn adopt_rank(&mut self, tag: RankTag) -> bool {
        let fits = self.rank.is_none()
            && self.owner != 0
            && tag.owner == self.owner
            && tag.generation == self.generation;
        if fits {
            self.rank = Some(tag.rank);
        }
        fits
    }

    /// The cache generation this state belongs to. Within one generation the seen keys only
    /// grow (a call that fails takes back only what it added), so a caller that read them once
    /// may trust that prefix while the generation and the state's owner stay the same.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether `on_request_finished` has run for this state.
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The keys seen, in first-seen order.
    #[must_use]
    pub fn seen_keys(&self) -> impl ExactSizeIterator<Item = &[u8]> {
        self.seen.iter().map(|s| s.key(&self.long))
    }

    /// The bytes of seen key `j`.
    #[inline]
    pub(crate) fn key(&self, j: usize) -> &[u8] {
        self.seen[j].key(&self.long)
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
        self.table.probe(hash, |j| self.key(j) == key).ok()
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

    /// [`reserve`](Self::reserve) room for `n` more keys and start loading the lines their
    /// entries will be written to: a fresh request's entries lie in memory nothing has
    /// touched lately, and writing them cold stalls the recording loop.
    pub(crate) fn reserve_fetched(&mut self, n: usize) {
        self.reserve(n);
        let room = self.seen.spare_capacity_mut()[..n].as_ptr_range();
        let (start, end) = (room.start.cast::<u8>(), room.end.cast::<u8>());
        // From the line the first entry starts in, so that the last one's is fetched too.
        let mut p = start.wrapping_sub(start as usize % 64);
        while p < end {
            crate::mem::prefetch_addr(p);
            p = p.wrapping_add(64);
        }
    }

    /// Whether `n` more keys fit without growing (what [`reserve`](Self::reserve) makes sure).
    pub(crate) fn has_room(&self, n: usize) -> bool {
        let want = self.seen.len() + n;
        self.seen.capacity() >= want && self.table.fits(want)
    }

    /// Forget the keys added after the first `len` (undoing a call that failed).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.added.clear();
        while self.seen.len() > len {
            let i = self.seen.len() - 1;
            self.table.remove_last(self.seen[i].hash, i);
            if let Some(s) = self.seen.pop().filter(|s| s.len as usize > SEEN_INLINE) {
                // Long keys' bytes are appended in order: this one's are the last.
                self.long.truncate(s.long_at());
            }
        }
    }

    /// Add a key the request has not seen, with `flags`; returns its index. Room for it must
    /// be reserved.
    // Inlined into the manager's recording loop (out of line, it measured 5-10% more
    // instructions a recorded key under callgrind).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn add(
        &mut self,
        key: &[u8],
        hash: u64,
        chunk: Option<ChunkId>,
        flags: u8,
    ) -> usize {
        let i = self.seen.len();
        let at = match self.table.probe(hash, |_| false) {
            Ok(at) | Err(at) => at,
        };
        self.table.put(at, hash, i);
        SeenKey::push(&mut self.seen, key, hash, chunk, flags, &mut self.long);
        i
    }

    /// The index of `key` among the seen keys, adding it first (with `flags`) if the request
    /// has not seen it (`true`: added): one probe of the index either way. Room for it must
    /// be reserved.
    // As `add`.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn find_or_add(
        &mut self,
        key: &[u8],
        hash: u64,
        chunk: Option<ChunkId>,
        flags: u8,
    ) -> (usize, bool) {
        match self.table.probe(hash, |j| self.key(j) == key) {
            Ok(j) => (j, false),
            Err(at) => {
                let i = self.seen.len();
                self.table.put(at, hash, i);
                SeenKey::push(&mut self.seen, key, hash, chunk, flags, &mut self.long);
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
    // Inlined into the recording loop: out of line, a load measured 3% more instructions
    // (callgrind).
    #[allow(clippy::inline_always)]
    #[inline(always)]
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

    /// Whether `want` keys in all leave the index at most half full.
    fn fits(&self, want: usize) -> bool {
        want * 2 <= self.entries.len()
    }

    /// Make room for `want` keys in all, growing to fit `grow_to` when it must grow; the keys
    /// already indexed are `seen`, re-added in order from their kept hashes.
    fn reserve(&mut self, want: usize, grow_to: usize, seen: &[SeenKey]) {
        if self.fits(want) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::hash_key;

    /// A key of `len` bytes that differs from every other (`i`) in its first and last bytes.
    fn key(i: u8, len: usize) -> Vec<u8> {
        let mut k = vec![i; len];
        if let Some(last) = k.last_mut() {
            *last = i.wrapping_mul(7).wrapping_add(len as u8);
        }
        k
    }

    fn add(req: &mut RequestState, k: &[u8]) -> (usize, bool) {
        req.reserve(1);
        req.find_or_add(k, hash_key(k), None, 0)
    }

    #[test]
    fn keys_of_every_length_come_back_whole_and_are_found() {
        // Inline (0-40 bytes, both copy paths) and long (41+: the request's byte buffer).
        let lens = [0, 1, 8, 31, 32, 33, 36, 39, 40, 41, 64, 100, 1000];
        let keys: Vec<Vec<u8>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| key(i as u8 + 1, n))
            .collect();
        let mut req = RequestState::new(0, 0);
        for (j, k) in keys.iter().enumerate() {
            assert_eq!(add(&mut req, k), (j, true));
        }
        for (j, k) in keys.iter().enumerate() {
            assert_eq!(
                add(&mut req, k),
                (j, false),
                "key {j} found, not added again"
            );
            assert_eq!(req.index_of(k), Some(j));
        }
        let back: Vec<&[u8]> = req.seen_keys().collect();
        assert_eq!(back, keys.iter().map(Vec::as_slice).collect::<Vec<_>>());
        // A key equal to a long one but for its last byte is a different key.
        let mut near = keys[11].clone();
        *near.last_mut().unwrap() ^= 1;
        assert_eq!(req.index_of(&near), None);
    }

    #[test]
    fn truncating_drops_long_keys_bytes_and_later_keys_reuse_them() {
        let mut req = RequestState::new(0, 0);
        let a = key(1, 50);
        let b = key(2, 36);
        let c = key(3, 70);
        for k in [&a, &b, &c] {
            add(&mut req, k);
        }
        assert_eq!(req.long.len(), 120);
        req.truncate(2);
        assert_eq!(req.long.len(), 50, "c's bytes went with it");
        req.truncate(1);
        assert_eq!(req.long.len(), 50, "b was inline");
        assert_eq!(req.index_of(&b), None);
        let d = key(4, 45);
        assert_eq!(add(&mut req, &d), (1, true));
        assert_eq!(req.long.len(), 95);
        let back: Vec<&[u8]> = req.seen_keys().collect();
        assert_eq!(back, vec![a.as_slice(), d.as_slice()]);
        req.truncate(0);
        assert!(req.long.is_empty() && req.seen_keys().len() == 0);
    }

    #[test]
    fn a_seen_key_needs_no_drop() {
        assert!(!std::mem::needs_drop::<SeenKey>());
    }

    #[test]
    fn truncating_undoes_a_recording_call_and_empties_its_added_list() {
        let mut req = RequestState::new(0, 0);
        let keys: Vec<Vec<u8>> = (1..=3).map(|i| key(i, 16)).collect();
        add(&mut req, &keys[0]);
        // A recording call adds two keys (as the manager's `record_new` does), then fails.
        let mark = req.seen.len();
        req.reserve(2);
        req.added.clear();
        for (i, k) in keys[1..].iter().enumerate() {
            assert!(req.find_or_add(k, hash_key(k), None, 0).1);
            req.added.push(i as u32);
        }
        assert_eq!(req.last_added(), &[0, 1]);
        req.truncate(mark);
        assert!(
            req.last_added().is_empty(),
            "empty after a call that failed"
        );
        assert_eq!(
            req.seen_keys().collect::<Vec<_>>(),
            vec![keys[0].as_slice()]
        );
        assert_eq!(req.index_of(&keys[2]), None);
    }

    #[test]
    fn truncating_a_key_of_exactly_the_inline_size_keeps_the_long_bytes() {
        let mut req = RequestState::new(0, 0);
        let a = key(1, 50);
        // Inline (exactly `SEEN_INLINE` bytes), with first bytes that would read as offset 0.
        let mut b = vec![0u8; SEEN_INLINE];
        b[SEEN_INLINE - 1] = 9;
        add(&mut req, &a);
        add(&mut req, &b);
        assert_eq!(req.long.len(), 50);
        req.truncate(1);
        assert_eq!(req.long.len(), 50, "b's bytes were inline: a's stay");
        assert_eq!(req.seen_keys().collect::<Vec<_>>(), vec![a.as_slice()]);
        assert_eq!(req.index_of(&a), Some(0));
    }

    /// The index stays at most half full as keys are added one call at a time, so a probe for
    /// an absent key always ends at an empty place.
    #[test]
    fn the_index_stays_at_most_half_full() {
        let mut req = RequestState::new(0, 0);
        let keys: Vec<Vec<u8>> = (0..600u32).map(|i| i.to_le_bytes().to_vec()).collect();
        for (j, k) in keys.iter().enumerate() {
            assert_eq!(add(&mut req, k), (j, true));
            assert!(
                2 * req.seen.len() <= req.table.entries.len(),
                "{} keys in an index of {}",
                req.seen.len(),
                req.table.entries.len()
            );
        }
        for (j, k) in keys.iter().enumerate() {
            assert_eq!(req.index_of(k), Some(j));
        }
        assert_eq!(req.index_of(b"absent"), None);
    }
}
