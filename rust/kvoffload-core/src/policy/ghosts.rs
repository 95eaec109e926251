//! `GhostLists`: ARC's two ghost lists (B1 and B2, keys only) in one arena with one index.
//!
//! Each ghost is one 64-byte [`Entry`] of a slab: its key's first [`INLINE_KEY`] bytes inline,
//! the key's length, its full hash, which list holds it, and the links of that list's recency
//! order (oldest at the head). Vacant entries form a free list threaded through `next`, so the
//! slab grows only while the lists do: each list is bounded by the cache's capacity, and once
//! both have filled, pushes reuse the entries that pops free and allocate nothing. Keys longer
//! than [`INLINE_KEY`] bytes keep their full bytes in a side map (the cold path: vLLM's keys
//! are 36 bytes).
//!
//! One open-addressing index over both lists finds a key's entry, so one probe tells whether a
//! key is in B1, in B2 or in neither. An index word is `(hash >> 32) << 32 | (entry + 1)`, 0
//! when empty; a key's home word is the top `bits` of its hash, which its tag holds, so the
//! index grows (doubling, at half full) and deletes (shifting the rest of a probe run back,
//! no tombstones) from its own words, without reading an entry or hashing a key again. It never
//! rehashes in the steady state: it grows only when the number of ghosts reaches a new high.

use crate::error::{ensure, Result};
use crate::key::KeyBuf;
use hashbrown::HashMap;
use std::fmt;

/// Key bytes an entry holds inline (vLLM's keys, a 32-byte hash and a 4-byte group, fit).
pub(crate) const INLINE_KEY: usize = 40;

/// No entry (the end of a list or of the free list).
const NIL: u32 = u32::MAX;

/// The `list` of a vacant entry.
const FREE: u8 = 2;

/// Index words of a fresh structure (a power of two).
const MIN_INDEX: usize = 8;

/// Entries (64 bytes each: 2 MiB) from which the lists are [`large`](GhostLists::large): likely
/// out of the CPU's nearer caches, so that reading them ahead pays for the reading.
const LARGE: usize = 32_768;

/// Which ghost list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GhostList {
    /// Keys evicted from T1.
    B1 = 0,
    /// Keys evicted from T2.
    B2 = 1,
}

impl GhostList {
    fn from_tag(tag: u8) -> Self {
        debug_assert!(tag < FREE);
        if tag == 0 {
            Self::B1
        } else {
            Self::B2
        }
    }
}

/// One ghost, or a vacant slab entry. Exactly one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Entry {
    /// `hash_key(key)`, as the caller passed it.
    hash: u64,
    /// The key's first `min(len, INLINE_KEY)` bytes; the rest of the array is unused.
    key: [u8; INLINE_KEY],
    /// The key's length in bytes (the full key of a longer one is in `GhostLists::long`).
    len: u32,
    /// The next older entry of the list, or `NIL` at the head.
    prev: u32,
    /// The next newer entry of the list, or `NIL` at the tail. When the entry is vacant, the
    /// next vacant entry.
    next: u32,
    /// `GhostList as u8`, or `FREE` when vacant.
    list: u8,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 64);
// A slot's inline key buffer fits an entry's as it is (`push_inline`).
const _: () = assert!(INLINE_KEY == crate::table::INLINE_KEY);

/// The ends and length of one list.
#[derive(Debug, Clone, Copy)]
struct Ends {
    /// The oldest entry, or `NIL`.
    head: u32,
    /// The newest entry, or `NIL`.
    tail: u32,
    len: usize,
}

const EMPTY_LIST: Ends = Ends {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// B1 and B2 over one slab of entries and one index; see the module docs.
#[derive(Clone)]
pub(crate) struct GhostLists {
    entries: Vec<Entry>,
    /// The first vacant entry, or `NIL`.
    free: u32,
    /// B1 and B2, by `GhostList as usize`.
    lists: [Ends; 2],
    /// Open addressing with linear probing, a power of two long, at most half full.
    index: Vec<u64>,
    /// `64 - log2(index.len())`: a word's home is `word >> shift` (and a hash's `hash >> shift`).
    shift: u32,
    /// The full bytes of keys longer than `INLINE_KEY`, by entry.
    long: HashMap<u32, Box<[u8]>>,
}

impl fmt::Debug for GhostLists {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GhostLists")
            .field("b1", &self.keys(GhostList::B1).collect::<Vec<_>>())
            .field("b2", &self.keys(GhostList::B2).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl GhostLists {
    /// Two empty lists (the slab allocates on the first push).
    pub(crate) fn new() -> Self {
        Self {
            entries: Vec::new(),
            free: NIL,
            lists: [EMPTY_LIST; 2],
            index: vec![0; MIN_INDEX],
            shift: 64 - MIN_INDEX.trailing_zeros(),
            long: HashMap::new(),
        }
    }

    /// The number of ghosts in `list`.
    pub(crate) fn len(&self, list: GhostList) -> usize {
        self.lists[list as usize].len
    }

    /// Start loading the index word where a probe for `hash` begins; changes nothing.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        if let Some(w) = self.index.get((hash >> self.shift) as usize) {
            crate::mem::prefetch(w);
        }
    }

    /// Whether the lists are large enough ([`LARGE`] entries) that their reads miss the nearer
    /// caches: then batches of them are better started early (see `trim`).
    #[inline]
    pub(crate) fn large(&self) -> bool {
        self.entries.len() >= LARGE
    }

    /// Start loading the entry a probe for `hash` compares first (the first word of the probe
    /// run with `hash`'s tag), reading the index words up to it: best after
    /// [`prefetch`](Self::prefetch) of a batch's hashes, so that these reads wait together.
    /// Changes nothing. (`probe`'s walk, stopping at the tag instead of comparing the entry;
    /// sharing one walk through a closure cost `probe` 1.4% more instructions in ARC's store.)
    #[inline]
    pub(crate) fn prefetch_entry(&self, hash: u64) {
        let mask = self.index.len().wrapping_sub(1);
        let tag = hash >> 32;
        let mut at = (hash >> self.shift) as usize;
        while let Some(&word) = self.index.get(at) {
            let e = word as u32;
            if e == 0 {
                return;
            }
            if word >> 32 == tag {
                if let Some(x) = self.entries.get(e as usize - 1) {
                    crate::mem::prefetch(x);
                }
                return;
            }
            at = (at + 1) & mask;
        }
    }

    /// Start loading the oldest entry of `list` (the next `pop_front`'s); changes nothing.
    #[inline]
    pub(crate) fn prefetch_oldest(&self, list: GhostList) {
        if let Some(x) = self.entries.get(self.lists[list as usize].head as usize) {
            crate::mem::prefetch(x);
        }
    }

    /// Which list holds `key` (`hash` is `hash_key(key)`), if any.
    pub(crate) fn find(&self, key: &[u8], hash: u64) -> Option<GhostList> {
        let (_, e) = self.probe(key, hash).ok()?;
        Some(GhostList::from_tag(self.entries[e as usize].list))
    }

    /// Move `key` to the newest end of its list; which list that is, if any.
    // Inlined into ARC's loops over a call's keys, most of which are no ghosts: the probe
    // inline, the move out of line.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn move_to_back(&mut self, key: &[u8], hash: u64) -> Option<GhostList> {
        let (_, e) = self.probe(key, hash).ok()?;
        Some(self.entry_to_back(e))
    }

    /// Move live entry `e` to the newest end of its list; which list that is.
    #[inline(never)]
    fn entry_to_back(&mut self, e: u32) -> GhostList {
        let list = GhostList::from_tag(self.entries[e as usize].list);
        if self.lists[list as usize].tail != e {
            self.unlink(e);
            self.link_back(e, list);
        }
        list
    }

    /// Drop `key` from its list; which list that was, if any.
    // Inlined into ARC's insert, whose keys are mostly no ghosts: the probe inline, the
    // removal out of line.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn remove(&mut self, key: &[u8], hash: u64) -> Option<GhostList> {
        let (at, e) = self.probe(key, hash).ok()?;
        Some(self.remove_entry(at, e))
    }

    /// Drop live entry `e`, indexed at word `at`; which list held it.
    #[inline(never)]
    fn remove_entry(&mut self, at: usize, e: u32) -> GhostList {
        let list = GhostList::from_tag(self.entries[e as usize].list);
        self.unindex(at);
        self.unlink(e);
        self.release(e);
        list
    }

    /// Add `key` at the newest end of `list`. A key already in `list` stays where it is (ARC
    /// never pushes one: resident keys are no ghosts); a key in the other list, which ARC never
    /// pushes either, moves to `list`, so that no key is in both.
    pub(crate) fn push(&mut self, list: GhostList, key: &[u8], hash: u64) {
        self.push_with(list, key, hash, |g| g.allocate(key, hash));
    }

    /// [`push`](Self::push) of a key of at most [`INLINE_KEY`] bytes given as a whole inline
    /// buffer (its first `len` bytes; the rest zero), as a slot keeps it: the entry takes the
    /// buffer in one fixed-size copy.
    pub(crate) fn push_inline(
        &mut self,
        list: GhostList,
        buf: &[u8; INLINE_KEY],
        len: usize,
        hash: u64,
    ) {
        debug_assert!(len <= INLINE_KEY && buf[len..].iter().all(|&b| b == 0));
        self.push_with(list, &buf[..len], hash, |g| {
            g.place(Entry {
                hash,
                key: *buf,
                len: len as u32,
                prev: NIL,
                next: NIL,
                list: FREE,
            })
        });
    }

    /// When the lists are [`large`](Self::large) and more than one ghost of `list` is to go,
    /// start loading the index words of its `count` oldest ghosts (walking them), so that the
    /// misses of the drops overlap the walk's own; changes nothing.
    #[inline]
    pub(crate) fn prefetch_oldest_words(&self, list: GhostList, count: usize) {
        if count > 1 && self.large() {
            let mut e = self.lists[list as usize].head;
            for _ in 0..count {
                let Some(x) = self.entries.get(e as usize) else {
                    break;
                };
                self.prefetch(x.hash);
                e = x.next;
            }
        }
    }

    /// How many ghosts of `list` `pushes` new keys pushed onto it then trimmed to `keep` would
    /// drop (the oldest ones), ARC's trim after an eviction's pushes: for
    /// [`prefetch_oldest_words`](Self::prefetch_oldest_words) before the pushes.
    pub(crate) fn to_drop(&self, list: GhostList, pushes: usize, keep: usize) -> usize {
        (self.lists[list as usize].len + pushes).saturating_sub(keep)
    }

    /// Grow the index as `more` pushes of new keys would before any pop: a batch of pushes
    /// made with [`push_within`](Self::push_within), which keeps the number of
    /// ghosts down as it goes, leaves the index as long as pushes and then trims would.
    pub(crate) fn reserve(&mut self, more: usize) {
        let live = self.lists[0].len + self.lists[1].len;
        while 2 * (live + more) > self.index.len() {
            self.grow_index();
        }
    }

    /// A push of a new key onto `list` when it holds `keep` ghosts or more already, then the
    /// drop of its oldest ghost: what [`push_inline`](Self::push_inline) and then a
    /// [`trim`](Self::trim) to `keep` would do to the lists, in one step (ARC's every eviction
    /// once B1 has filled). The oldest ghost's entry takes the new key, so the free list and
    /// the lists' lengths stay as they were; the index holds the words it would, some perhaps
    /// at other places of their probe runs. `key` gives the key's inline bytes (zero past its
    /// end) and length, or `None` for a key longer than [`INLINE_KEY`].
    ///
    /// Returns `false`, having changed nothing (and maybe not called `key`), when the list
    /// holds fewer than `keep` ghosts or none, when the key is longer, or when an index word
    /// of the key's probe run has its tag (it may be that key: [`push`](Self::push) decides).
    // Inlined into ARC's eviction loop.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn push_within(
        &mut self,
        list: GhostList,
        hash: u64,
        keep: usize,
        key: impl FnOnce() -> Option<([u8; INLINE_KEY], usize)>,
    ) -> bool {
        let ends = self.lists[list as usize];
        let e = ends.head;
        if ends.len < keep || e == NIL {
            return false;
        }
        // Below 64 always (`64 - log2` of the index's length): masked, the shifts need no check.
        let shift = self.shift & 63;
        let index = &mut self.index[..];
        let mask = index.len() - 1;
        let tag = hash >> 32;
        let mut at = (hash >> shift) as usize;
        loop {
            let word = index[at];
            if word == 0 {
                break;
            }
            if word >> 32 == tag {
                return false;
            }
            at = (at + 1) & mask;
        }
        let entries = &mut self.entries[..];
        let Entry {
            hash: old_hash,
            len: old_len,
            next,
            ..
        } = entries[e as usize];
        let Some((buf, len)) = key() else {
            return false;
        };
        // The new key into the head's entry (its links and list below).
        let x = &mut entries[e as usize];
        x.hash = hash;
        x.key = buf;
        x.len = len as u32;
        // The new key's word in (the index stays at most half full with one word more: see
        // `reserve`), then the head's old word out. Their tags differ (the walk above met no
        // word with the new key's tag, and the old word is in its probe run if their homes are
        // one), so the search finds the old word.
        index[at] = index_word(hash, e);
        let w = word_place(index, shift, index_word(old_hash, e));
        unindex_in(index, shift, w);
        if old_len as usize > INLINE_KEY {
            self.long.remove(&e);
        }
        // Out at the head, in at the tail: the list's length is unchanged.
        let ends = &mut self.lists[list as usize];
        let tail = if next == NIL {
            // `e` was the only entry, and stays so.
            NIL
        } else {
            entries[next as usize].prev = NIL;
            let tail = ends.tail;
            entries[tail as usize].next = e;
            ends.head = next;
            tail
        };
        ends.tail = e;
        let x = &mut entries[e as usize];
        x.prev = tail;
        x.next = NIL;
        x.list = list as u8;
        true
    }

    /// `push`, with `allocate` making the new entry when `key` is in neither list.
    fn push_with(
        &mut self,
        list: GhostList,
        key: &[u8],
        hash: u64,
        allocate: impl FnOnce(&mut Self) -> u32,
    ) {
        let live = self.lists[0].len + self.lists[1].len;
        if 2 * (live + 1) > self.index.len() {
            self.grow_index();
        }
        match self.probe(key, hash) {
            Ok((_, e)) => {
                let was = GhostList::from_tag(self.entries[e as usize].list);
                debug_assert_eq!(was, list, "ghosts: a key pushed onto both lists");
                if was != list {
                    self.unlink(e);
                    self.link_back(e, list);
                }
            }
            Err(at) => {
                let e = allocate(self);
                self.index[at] = index_word(hash, e);
                self.link_back(e, list);
            }
        }
    }

    /// Drop the oldest ghosts of `list` until at most `keep` remain. When the lists are
    /// [`large`](Self::large), a walk over those ghosts first starts loading each one's index
    /// word, so that those misses overlap the walk's own.
    // The check inline (after ARC's pushes, which keep the lists within bounds, there is
    // mostly nothing to drop), the drops out of line.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn trim(&mut self, list: GhostList, keep: usize) {
        if self.lists[list as usize].len > keep {
            self.trim_over(list, keep);
        }
    }

    /// [`trim`](Self::trim) of a list longer than `keep`.
    #[inline(never)]
    fn trim_over(&mut self, list: GhostList, keep: usize) {
        let excess = self.lists[list as usize].len.saturating_sub(keep);
        self.prefetch_oldest_words(list, excess);
        for _ in 0..excess {
            self.pop_head(list);
        }
    }

    /// Drop the oldest ghost of `list`; `false` if it is empty. Its key is not hashed again.
    pub(crate) fn pop_front(&mut self, list: GhostList) -> bool {
        self.pop_head(list)
    }

    /// [`pop_front`](Self::pop_front), inlined into `trim`'s loop (a store's eviction pops
    /// one ghost per victim once B1 is full).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn pop_head(&mut self, list: GhostList) -> bool {
        let e = self.lists[list as usize].head;
        if e == NIL {
            return false;
        }
        let word = index_word(self.entries[e as usize].hash, e);
        let at = word_place(&self.index, self.shift, word);
        self.unindex(at);
        // `e` is the head: the unlinking and the release of `unlink` and `release`, inline,
        // with what is known of a head (no older entry, `list`'s own).
        let Entry { next, len, .. } = self.entries[e as usize];
        let ends = &mut self.lists[list as usize];
        ends.len -= 1;
        ends.head = next;
        if next == NIL {
            ends.tail = NIL;
        } else {
            self.entries[next as usize].prev = NIL;
        }
        if len as usize > INLINE_KEY {
            self.long.remove(&e);
        }
        let x = &mut self.entries[e as usize];
        x.list = FREE;
        x.next = self.free;
        self.free = e;
        true
    }

    /// The keys of `list`, oldest first.
    pub(crate) fn keys(&self, list: GhostList) -> impl Iterator<Item = &[u8]> + '_ {
        let mut e = self.lists[list as usize].head;
        std::iter::from_fn(move || {
            if e == NIL {
                return None;
            }
            let key = self.key(e);
            e = self.entries[e as usize].next;
            Some(key)
        })
    }

    /// The keys of `list`, oldest first, as owned buffers.
    pub(crate) fn key_bufs(&self, list: GhostList) -> Vec<KeyBuf> {
        self.keys(list).map(KeyBuf::from_slice).collect()
    }

    /// Drop every ghost, keeping the slab's and the index's memory.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.free = NIL;
        self.lists = [EMPTY_LIST; 2];
        self.index.fill(0);
        self.long.clear();
    }

    /// Check the lists' links and lengths, the free list, the index against the lists, the
    /// side map of long keys, that no key is in both lists, and that each entry's hash is
    /// `hash(key)`.
    pub(crate) fn validate(&self, hash: impl Fn(&[u8]) -> u64) -> Result<()> {
        let n = self.entries.len();
        let mut seen = vec![false; n];
        for list in [GhostList::B1, GhostList::B2] {
            let ends = self.lists[list as usize];
            let (mut e, mut prev, mut count) = (ends.head, NIL, 0);
            while e != NIL {
                ensure!(
                    (e as usize) < n && !seen[e as usize],
                    "ghosts: {list:?} links entry {e} twice or out of the slab"
                );
                seen[e as usize] = true;
                let x = &self.entries[e as usize];
                ensure!(
                    x.list == list as u8 && x.prev == prev,
                    "ghosts: entry {e} of {list:?} has a stale list tag or back link"
                );
                let key = self.key(e);
                ensure!(
                    x.hash == hash(key),
                    "ghosts: entry {e} holds a hash other than its key's"
                );
                ensure!(
                    self.probe(key, x.hash).ok().map(|(_, f)| f) == Some(e),
                    "ghosts: entry {e}'s key does not lead to it (unindexed, or a key in both lists)"
                );
                (prev, e, count) = (e, x.next, count + 1);
            }
            ensure!(
                ends.tail == prev && ends.len == count,
                "ghosts: {list:?}'s tail or length drifted"
            );
        }
        let mut e = self.free;
        while e != NIL {
            ensure!(
                (e as usize) < n && !seen[e as usize] && self.entries[e as usize].list == FREE,
                "ghosts: the free list holds entry {e} twice, out of the slab, or in use"
            );
            seen[e as usize] = true;
            e = self.entries[e as usize].next;
        }
        ensure!(
            seen.iter().all(|&s| s),
            "ghosts: an entry in neither a list nor the free list"
        );
        let live = self.lists[0].len + self.lists[1].len;
        let words = self.index.iter().filter(|&&w| w != 0).count();
        ensure!(
            words == live && 2 * live <= self.index.len() && self.index.len().is_power_of_two(),
            "ghosts: the index holds {words} words for {live} ghosts in {} slots",
            self.index.len()
        );
        ensure!(
            self.shift == 64 - self.index.len().trailing_zeros(),
            "ghosts: the index's shift does not match its length"
        );
        let long = self
            .entries
            .iter()
            .filter(|x| x.list != FREE && x.len as usize > INLINE_KEY)
            .count();
        ensure!(
            long == self.long.len()
                && self.long.iter().all(|(&e, k)| {
                    let x = &self.entries[e as usize];
                    x.list != FREE && x.len as usize == k.len() && k[..INLINE_KEY] == x.key
                }),
            "ghosts: the long-key map differs from the long keys in the lists"
        );
        Ok(())
    }

    /// The entry of `key`, as `Ok((index word position, entry))`, or `Err(the empty word where
    /// it would go)`.
    // Up to four calls a key of an ARC store, which the compiler kept out of line: inlined,
    // the store takes ~100 fewer instructions a key (callgrind).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn probe(&self, key: &[u8], hash: u64) -> std::result::Result<(usize, u32), usize> {
        let mask = self.index.len() - 1;
        let tag = hash >> 32;
        let mut at = (hash >> self.shift) as usize;
        loop {
            let word = self.index[at];
            let e = word as u32;
            if e == 0 {
                return Err(at);
            }
            if word >> 32 == tag && self.matches(e - 1, key, hash) {
                return Ok((at, e - 1));
            }
            at = (at + 1) & mask;
        }
    }

    /// Whether entry `e` holds `key`.
    #[inline]
    fn matches(&self, e: u32, key: &[u8], hash: u64) -> bool {
        let x = &self.entries[e as usize];
        let inline = key.len().min(INLINE_KEY);
        x.hash == hash
            && x.len as usize == key.len()
            && x.key[..inline] == key[..inline]
            && (key.len() <= INLINE_KEY || self.long.get(&e).is_some_and(|k| **k == *key))
    }

    /// The key of live entry `e`.
    fn key(&self, e: u32) -> &[u8] {
        let x = &self.entries[e as usize];
        if x.len as usize > INLINE_KEY {
            &self.long[&e]
        } else {
            &x.key[..x.len as usize]
        }
    }

    /// A vacant entry holding `key`, unlinked.
    fn allocate(&mut self, key: &[u8], hash: u64) -> u32 {
        let mut x = Entry {
            hash,
            key: [0; INLINE_KEY],
            len: u32::try_from(key.len()).expect("ghosts: a key of 4 GiB or more"),
            prev: NIL,
            next: NIL,
            list: FREE,
        };
        let inline = key.len().min(INLINE_KEY);
        x.key[..inline].copy_from_slice(&key[..inline]);
        let e = self.place(x);
        if key.len() > INLINE_KEY {
            self.long.insert(e, key.into());
        }
        e
    }

    /// Store `x` in a vacant entry (or a new one); its number.
    // Inlined into the pushes: out of line, a store measured 1.4% more instructions.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn place(&mut self, x: Entry) -> u32 {
        if self.free == NIL {
            let e = u32::try_from(self.entries.len())
                .ok()
                .filter(|&e| e < NIL - 1)
                .expect("ghosts: more than 2^32 - 2 ghosts");
            if self.entries.len() == self.entries.capacity() {
                self.grow_slab();
            }
            self.entries.push(x);
            e
        } else {
            let e = self.free;
            self.free = self.entries[e as usize].next;
            self.entries[e as usize] = x;
            e
        }
    }

    /// Make room for more entries. The slab is read at random (ghost hits, pops): on huge
    /// pages once it is large. Out of line: the pushes inline `place`, and growth is rare.
    #[cold]
    #[inline(never)]
    fn grow_slab(&mut self) {
        crate::mem::reserve_huge(&mut self.entries, 1);
    }

    /// Put unlinked entry `e` on the free list.
    fn release(&mut self, e: u32) {
        let x = &mut self.entries[e as usize];
        if x.len as usize > INLINE_KEY {
            self.long.remove(&e);
        }
        x.list = FREE;
        x.prev = NIL;
        x.next = self.free;
        self.free = e;
    }

    /// Take entry `e` out of its list's order (its list tag stays).
    fn unlink(&mut self, e: u32) {
        let Entry {
            prev, next, list, ..
        } = self.entries[e as usize];
        let ends = &mut self.lists[list as usize];
        ends.len -= 1;
        if prev == NIL {
            ends.head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NIL {
            ends.tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
    }

    /// Link unlinked entry `e` at the newest end of `list`.
    fn link_back(&mut self, e: u32, list: GhostList) {
        let ends = &mut self.lists[list as usize];
        let tail = ends.tail;
        ends.tail = e;
        ends.len += 1;
        if tail == NIL {
            ends.head = e;
        } else {
            self.entries[tail as usize].next = e;
        }
        let x = &mut self.entries[e as usize];
        x.prev = tail;
        x.next = NIL;
        x.list = list as u8;
    }

    /// Empty index word `at`, moving later words of its probe run back so that every word
    /// stays reachable from its home without passing an empty word.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn unindex(&mut self, at: usize) {
        unindex_in(&mut self.index, self.shift, at);
    }

    /// Double the index, placing each word from its own hash bits.
    fn grow_index(&mut self) {
        let len = self.index.len() * 2;
        assert!(len <= 1 << 32, "ghosts: an index of more than 2^32 words");
        let mut grown = Vec::new();
        crate::mem::resize_huge(&mut grown, len, 0);
        let old = std::mem::replace(&mut self.index, grown);
        self.shift -= 1;
        let mask = len - 1;
        for word in old.into_iter().filter(|&w| w != 0) {
            let mut at = (word >> self.shift) as usize;
            while self.index[at] != 0 {
                at = (at + 1) & mask;
            }
            self.index[at] = word;
        }
    }
}

/// The index word of entry `e` whose key hashes to `hash`: the hash's top 32 bits (the tag)
/// over `e + 1` (so that no word is zero).
#[allow(clippy::inline_always)]
#[inline(always)]
fn index_word(hash: u64, e: u32) -> u64 {
    (hash >> 32 << 32) | u64::from(e + 1)
}

/// Where `word`, which `index` holds, lies: the search from its home (its top `64 - shift`
/// bits).
#[allow(clippy::inline_always)]
#[inline(always)]
fn word_place(index: &[u64], shift: u32, word: u64) -> usize {
    let mask = index.len() - 1;
    let mut at = (word >> shift) as usize;
    while index[at] != word {
        debug_assert!(index[at] != 0, "ghosts: an entry missing from the index");
        at = (at + 1) & mask;
    }
    at
}

/// [`GhostLists::unindex`] of `index`, whose words' homes are their top `64 - shift` bits.
#[allow(clippy::inline_always)]
#[inline(always)]
fn unindex_in(index: &mut [u64], shift: u32, mut at: usize) {
    let mask = index.len() - 1;
    let mut next = at;
    loop {
        next = (next + 1) & mask;
        let word = index[next];
        if word == 0 {
            index[at] = 0;
            return;
        }
        // `word` may fill the hole unless its home lies cyclically in (at, next].
        let home = (word >> shift) as usize;
        if (next.wrapping_sub(home) & mask) >= (next.wrapping_sub(at) & mask) {
            index[at] = word;
            at = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GhostList::{B1, B2};
    use super::*;
    use crate::key::hash_key;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// A hash with only a few distinct values, so keys collide in the index (and share tags).
    fn weak_hash(key: &[u8]) -> u64 {
        (hash_key(key) & 0xC000_0000_0000_0003) | 0x0000_0001_0000_0000
    }

    fn key(i: usize) -> Vec<u8> {
        format!("key{i}").into_bytes()
    }

    /// A key longer than `INLINE_KEY`, whose first `INLINE_KEY` bytes are all the same.
    fn long_key(i: usize) -> Vec<u8> {
        let mut k = vec![b'x'; INLINE_KEY];
        k.extend_from_slice(format!("long{i}").as_bytes());
        k
    }

    /// `key`'s inline bytes and length as `push_within` takes them (`None`: longer).
    fn inline(key: &[u8]) -> Option<([u8; INLINE_KEY], usize)> {
        let mut buf = [0; INLINE_KEY];
        crate::key::copy_inline(&mut buf, key).then_some((buf, key.len()))
    }

    fn keys_of(g: &GhostLists, list: GhostList) -> Vec<Vec<u8>> {
        g.keys(list).map(<[u8]>::to_vec).collect()
    }

    #[test]
    fn inline_pushes_match_slice_pushes() {
        let (mut a, mut b) = (GhostLists::new(), GhostLists::new());
        let keys: Vec<Vec<u8>> = (0..40)
            .map(key)
            .chain([vec![], vec![7; INLINE_KEY]])
            .collect();
        for (i, k) in keys.iter().enumerate() {
            let list = if i % 3 == 0 { B2 } else { B1 };
            let mut buf = [0u8; INLINE_KEY];
            buf[..k.len()].copy_from_slice(k);
            a.push(list, k, hash_key(k));
            b.push_inline(list, &buf, k.len(), hash_key(k));
        }
        b.push_inline(B1, &[0; INLINE_KEY], 0, hash_key(&[])); // present already: stays
        for list in [B1, B2] {
            assert_eq!(keys_of(&a, list), keys_of(&b, list));
        }
        for k in &keys {
            assert_eq!(b.find(k, hash_key(k)), a.find(k, hash_key(k)));
        }
        b.validate(hash_key).unwrap();
    }

    #[test]
    fn push_pop_to_back_remove() {
        let mut g = GhostLists::new();
        for i in 0..4 {
            g.push(B1, &key(i), hash_key(&key(i)));
        }
        g.push(B2, &key(9), hash_key(&key(9)));
        g.validate(hash_key).unwrap();
        assert_eq!((g.len(B1), g.len(B2)), (4, 1));
        assert_eq!(g.find(&key(2), hash_key(&key(2))), Some(B1));
        assert_eq!(g.find(&key(9), hash_key(&key(9))), Some(B2));
        assert_eq!(g.find(&key(5), hash_key(&key(5))), None);
        assert_eq!(g.move_to_back(&key(1), hash_key(&key(1))), Some(B1));
        assert_eq!(keys_of(&g, B1), vec![key(0), key(2), key(3), key(1)]);
        assert_eq!(g.remove(&key(2), hash_key(&key(2))), Some(B1));
        assert_eq!(g.remove(&key(2), hash_key(&key(2))), None);
        assert!(g.pop_front(B1));
        assert_eq!(keys_of(&g, B1), vec![key(3), key(1)]);
        assert_eq!(g.move_to_back(&key(9), hash_key(&key(9))), Some(B2));
        assert!(g.pop_front(B2));
        assert!(!g.pop_front(B2));
        assert_eq!(g.len(B2), 0);
        g.validate(hash_key).unwrap();
        g.clear();
        assert_eq!(g.len(B1), 0);
        g.validate(hash_key).unwrap();
    }

    #[test]
    fn trim_drops_the_oldest_small_and_large() {
        // Under LARGE entries trim pops one by one; from LARGE on it walks the ghosts first.
        for n in [50, LARGE + 300] {
            let mut g = GhostLists::new();
            for i in 0..n {
                g.push(B1, &key(i), hash_key(&key(i)));
            }
            g.push(B2, &key(n), hash_key(&key(n)));
            assert_eq!(g.large(), n >= LARGE);
            // Moved to the back and removed from the middle: the walk follows the list.
            g.move_to_back(&key(7), hash_key(&key(7)));
            g.remove(&key(9), hash_key(&key(9)));
            for a in [key(3), key(7), key(n + 1)] {
                g.prefetch_entry(hash_key(&a));
            }
            g.trim(B1, n + 10);
            assert_eq!(g.len(B1), n - 1);
            g.trim(B1, 20);
            let mut want: Vec<_> = (0..n).filter(|&i| i != 7 && i != 9).map(key).collect();
            want.push(key(7));
            assert_eq!(keys_of(&g, B1), want[want.len() - 20..].to_vec());
            assert_eq!(keys_of(&g, B2), vec![key(n)]);
            g.trim(B2, 0);
            assert_eq!(g.len(B2), 0);
            g.validate(hash_key).unwrap();
        }
    }

    #[test]
    fn push_within_recycles_the_oldest_entry() {
        let mut g = GhostLists::new();
        // Under the bound, or an empty list: declined, nothing changed.
        g.push(B1, &long_key(0), hash_key(&long_key(0)));
        assert!(!g.push_within(B1, hash_key(&key(9)), 2, || inline(&key(9))));
        assert!(!g.push_within(B2, hash_key(&key(9)), 0, || inline(&key(9))));
        for i in 1..4 {
            g.push(B1, &key(i), hash_key(&key(i)));
        }
        g.push(B2, &key(7), hash_key(&key(7)));
        let (slab, free) = (g.entries.len(), g.free);
        // A long key at the head (its side entry goes), then short ones.
        for (i, want) in [
            (4, vec![key(1), key(2), key(3), key(4)]),
            (5, vec![key(2), key(3), key(4), key(5)]),
        ] {
            assert!(g.push_within(B1, hash_key(&key(i)), 4, || inline(&key(i))));
            assert_eq!(keys_of(&g, B1), want);
            g.validate(hash_key).unwrap();
        }
        assert_eq!(g.long.len(), 0);
        // A list of one, over its bound of zero: the entry takes the new key.
        assert!(g.push_within(B2, hash_key(&key(8)), 0, || inline(&key(8))));
        assert_eq!(keys_of(&g, B2), vec![key(8)]);
        // A key too long to hand over inline: declined.
        assert!(!g.push_within(B1, hash_key(&long_key(1)), 4, || None));
        assert_eq!((g.entries.len(), g.free), (slab, free));
        assert_eq!(g.find(&key(1), hash_key(&key(1))), None);
        assert_eq!(g.find(&key(5), hash_key(&key(5))), Some(B1));
        g.validate(hash_key).unwrap();
    }

    #[test]
    fn pushing_a_present_key_keeps_its_place() {
        let mut g = GhostLists::new();
        for i in 0..3 {
            g.push(B2, &key(i), hash_key(&key(i)));
        }
        g.push(B2, &key(0), hash_key(&key(0)));
        assert_eq!(keys_of(&g, B2), vec![key(0), key(1), key(2)]);
        g.validate(hash_key).unwrap();
    }

    #[test]
    fn long_keys_are_kept_whole() {
        let mut g = GhostLists::new();
        for i in 0..3 {
            g.push(B1, &long_key(i), hash_key(&long_key(i)));
        }
        g.push(B2, &key(0), hash_key(&key(0)));
        g.validate(hash_key).unwrap();
        assert_eq!(keys_of(&g, B1), vec![long_key(0), long_key(1), long_key(2)]);
        // Same inline bytes, length and hash, other tail: not the same key.
        let mut other = long_key(1);
        *other.last_mut().unwrap() ^= 1;
        assert_eq!(g.find(&other, hash_key(&long_key(1))), None);
        assert_eq!(g.find(&long_key(1), hash_key(&long_key(1))), Some(B1));
        assert!(g.pop_front(B1));
        assert_eq!(g.remove(&long_key(2), hash_key(&long_key(2))), Some(B1));
        assert_eq!(g.long.len(), 1);
        g.validate(hash_key).unwrap();
    }

    #[test]
    fn freed_entries_are_reused() {
        let mut g = GhostLists::new();
        for i in 0..100 {
            g.push(B1, &key(i), hash_key(&key(i)));
            g.push(B2, &key(1000 + i), hash_key(&key(1000 + i)));
        }
        let (slab, index) = (g.entries.len(), g.index.len());
        for i in 100..10_000 {
            g.pop_front(B1);
            g.push(B1, &key(i), hash_key(&key(i)));
            g.pop_front(B2);
            g.push(B2, &key(1000 + i), hash_key(&key(1000 + i)));
        }
        assert_eq!((g.entries.len(), g.index.len()), (slab, index));
        assert_eq!(g.entries.len(), 200);
        g.validate(hash_key).unwrap();
    }

    #[test]
    fn colliding_hashes_stay_findable_through_deletions() {
        let mut g = GhostLists::new();
        for i in 0..64 {
            let list = if i % 3 == 0 { B2 } else { B1 };
            g.push(list, &key(i), weak_hash(&key(i)));
        }
        g.validate(weak_hash).unwrap();
        for i in (0..64).step_by(2) {
            assert!(g.remove(&key(i), weak_hash(&key(i))).is_some());
            g.validate(weak_hash).unwrap();
        }
        for i in 0..64 {
            assert_eq!(g.find(&key(i), weak_hash(&key(i))).is_some(), i % 2 == 1);
        }
    }

    #[test]
    fn an_index_word_is_a_tag_and_an_entry() {
        let mut g = GhostLists::new();
        let h = 0xDEAD_BEEF_0000_0042;
        g.push(B1, b"k", h);
        let word = g.index.iter().copied().find(|&w| w != 0).unwrap();
        assert_eq!(word, 0xDEAD_BEEF_0000_0001);
        assert_eq!(
            g.index.iter().position(|&w| w != 0),
            Some((h >> 61) as usize)
        );
    }

    /// One operation of the model test: on key `k` of a small pool (every fourth one long).
    #[derive(Debug, Clone)]
    enum Op {
        Push(bool, usize),
        MoveToBack(usize),
        Remove(usize),
        PopFront(bool),
        Find(usize),
        Clear,
        /// `push_within` onto a list with this bound (a plain `push` when it declines).
        PushWithin(bool, usize, usize),
        Trim(bool, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (any::<bool>(), 0..48usize).prop_map(|(b, k)| Op::Push(b, k)),
            2 => (0..48usize).prop_map(Op::MoveToBack),
            2 => (0..48usize).prop_map(Op::Remove),
            3 => any::<bool>().prop_map(Op::PopFront),
            1 => (0..48usize).prop_map(Op::Find),
            1 => Just(Op::Clear),
            6 => (any::<bool>(), 0..48usize, 0..8usize).prop_map(|(b, k, n)| Op::PushWithin(b, k, n)),
            2 => (any::<bool>(), 0..8usize).prop_map(|(b, n)| Op::Trim(b, n)),
        ]
    }

    /// Checks `GhostLists` against two deques, with the real or a colliding hash.
    fn run_model(ops: &[Op], hash: fn(&[u8]) -> u64) {
        let pool: Vec<Vec<u8>> = (0..48)
            .map(|i| if i % 4 == 0 { long_key(i) } else { key(i) })
            .collect();
        let mut g = GhostLists::new();
        let mut model: [VecDeque<usize>; 2] = [VecDeque::new(), VecDeque::new()];
        let which = |model: &[VecDeque<usize>; 2], k: usize| {
            (0..2).find(|&l| model[l].contains(&k)).map(|l| [B1, B2][l])
        };
        for op in ops {
            match *op {
                Op::Push(b2, k) => {
                    // ARC pushes only keys in neither list.
                    if which(&model, k).is_none() {
                        let list = if b2 { B2 } else { B1 };
                        g.push(list, &pool[k], hash(&pool[k]));
                        model[list as usize].push_back(k);
                    }
                }
                Op::MoveToBack(k) => {
                    let w = which(&model, k);
                    if let Some(l) = w {
                        let m = &mut model[l as usize];
                        m.retain(|&x| x != k);
                        m.push_back(k);
                    }
                    assert_eq!(g.move_to_back(&pool[k], hash(&pool[k])), w);
                }
                Op::Remove(k) => {
                    let w = which(&model, k);
                    if let Some(l) = w {
                        model[l as usize].retain(|&x| x != k);
                    }
                    assert_eq!(g.remove(&pool[k], hash(&pool[k])), w);
                }
                Op::PopFront(b2) => {
                    let list = if b2 { B2 } else { B1 };
                    let m = model[list as usize].pop_front();
                    assert_eq!(g.pop_front(list), m.is_some());
                }
                Op::PushWithin(b2, k, keep) => {
                    if which(&model, k).is_none() {
                        let list = if b2 { B2 } else { B1 };
                        let key = &pool[k];
                        let before = model[list as usize].len();
                        if g.push_within(list, hash(key), keep, || inline(key)) {
                            // A push and the drop of the oldest, of a list `keep` long or more.
                            assert!(before >= keep && before > 0);
                            model[list as usize].pop_front();
                        } else {
                            g.push(list, key, hash(key));
                        }
                        model[list as usize].push_back(k);
                    }
                }
                Op::Trim(b2, keep) => {
                    let list = if b2 { B2 } else { B1 };
                    g.trim(list, keep);
                    let m = &mut model[list as usize];
                    while m.len() > keep {
                        m.pop_front();
                    }
                }
                Op::Find(k) => assert_eq!(g.find(&pool[k], hash(&pool[k])), which(&model, k)),
                Op::Clear => {
                    g.clear();
                    model = [VecDeque::new(), VecDeque::new()];
                }
            }
            g.validate(hash).unwrap();
            for list in [B1, B2] {
                let want: Vec<&[u8]> = model[list as usize]
                    .iter()
                    .map(|&k| pool[k].as_slice())
                    .collect();
                assert_eq!(g.keys(list).collect::<Vec<_>>(), want);
                assert_eq!(g.len(list), want.len());
            }
        }
    }

    proptest! {
        #[test]
        fn matches_two_deques(ops in proptest::collection::vec(op(), 0..300)) {
            run_model(&ops, hash_key);
        }

        #[test]
        fn matches_two_deques_with_colliding_hashes(
            ops in proptest::collection::vec(op(), 0..300)
        ) {
            run_model(&ops, weak_hash);
        }
    }
}
