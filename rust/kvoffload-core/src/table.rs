//! `ChunkTable` and `Slots`: each chunk slot's key, hash and ref count, and the key -> chunk
//! index, laid out so that lookups and load completions take no lock.
//!
//! # Layout
//! - One 64-byte line per slot: a state word (a 32-bit sequence number above a 32-bit state
//!   code), the key's hash, the link to the next slot of the key's hash chain, the key length
//!   and the key's first [`INLINE_KEY`] bytes (longer keys keep the rest with the writer).
//! - One 32-byte bucket per two slots (a power of two, at least 16): three entries, each the
//!   high 32 bits of a key's hash (its tag) above its slot id, and the head of an overflow
//!   chain with a 32-bit summary of its keys' hashes. A lookup reads the bucket, then only the
//!   slot whose tag matches: two cache misses, both prefetched for a batch; an absent key walks
//!   the chain only if its bit is in the summary. Entries never move; a key that finds its
//!   bucket's entries taken joins the chain, which runs through slot ids (a resident key
//!   occupies exactly one slot, so the chain needs no nodes of its own). A full pool loads a
//!   bucket with 1 to 2 keys, so 2-14% of keys overflow. The index never grows.
//! - A stack of slots whose last pin a lock-free completion released (see below).
//!
//! Arrays are zero-filled anonymous mappings: a pool of 10^7 chunks costs memory only for the
//! slots it uses.
//!
//! # Who may do what
//! [`ChunkTable`] is shared (`Arc`) and all atomics, so no access is ever a data race.
//! - **One writer** at a time, the owner of the [`Slots`] (the manager, under its lock): keys
//!   come and go, chunks are pinned, stores complete, and the queued releases are applied.
//! - **Readers**, any number, any thread, lock-free: [`ChunkTable::probe`] and
//!   [`ChunkTable::lookup_prefix`]. A reader checks the bucket's entries, then walks the
//!   overflow chain, reading each slot between two loads of its sequence number (the seqlock
//!   pattern, with atomic loads); if a writer changed the slot in between, or a chained slot
//!   left the bucket, the reader starts again. A writer changes a
//!   slot's sequence number whenever the slot's key changes (odd while it rewrites the key), so
//!   an answer is always one the table held at some instant during the call.
//! - **Releasers**, any thread, lock-free: [`ChunkTable::release`] drops one pin per key by
//!   compare-and-swap on the state word. The sequence number in the word makes the swap fail if
//!   the slot changed key in between (no ABA). A slot whose last pin goes is left RELEASING:
//!   readable, and still held as far as the policy and the counters know, and is queued on a
//!   Treiber stack. The writer applies the queue ([`Slots::drain_releases`]) before anything
//!   else in its next call, in release order, telling the policy then: one thread calling sees
//!   exactly the state and policy order of an immediate update. A release that cannot complete
//!   (a key not pinned, a long key, a conflict with another release) undoes the pins it took
//!   and answers [`Release::Unsure`]: the caller repeats it under the lock, where the exact
//!   error is made.
//!
//! Sequence numbers are 32 bits: a reader stalled across 2^31 key changes of one slot could be
//! fooled, which no real schedule comes near.

use crate::error::{ensure, Result};
use crate::key::{hash_key, KeyBuf, KeyHasher};
use crate::mem::{backoff, fence, prefetch, AtomicU32, AtomicU64, Ordering, ZeroArray, Zeroable};
use crate::pool::ChunkId;
use hashbrown::HashMap;
use smallvec::SmallVec;
use std::hint::black_box;
use std::sync::Arc;

/// The state of one slot, as the manager and the policy see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkState {
    /// No key lives in the slot.
    Absent,
    /// A store is in flight; the data is not readable.
    Pending,
    /// Readable; `0` means evictable, `n > 0` means pinned by `n` loads.
    Ready(u32),
}

/// Key bytes a slot holds inline; the rest of a longer key stays with the writer's [`Slots`].
pub const INLINE_KEY: usize = 40;
/// Longest key a slot can hold: it keeps the length in 32 bits (so do ARC's ghost entries).
/// The manager refuses longer keys before it changes anything.
pub const MAX_KEY_LEN: usize = u32::MAX as usize;

/// Whether a key of `len` bytes can be stored (at most [`MAX_KEY_LEN`]): the one test of the
/// limit, for the manager's offers and the built-in policies run under vLLM's manager alike.
#[must_use]
#[inline]
pub const fn storable_len(len: usize) -> bool {
    len <= MAX_KEY_LEN
}
const WORDS: usize = INLINE_KEY / 8;

/// State codes (the low 32 bits of a state word).
const ABSENT: u32 = 0;
const PENDING: u32 = 1;
/// The last pin was dropped by a release still in progress (it may yet be undone).
const TENTATIVE: u32 = 2;
/// The last pin was dropped by a finished release that the writer has not yet applied.
const RELEASING: u32 = 3;
/// Ready with no pin; `READY + n` is ready with `n` pins.
const READY: u32 = 4;
/// Most pins a slot can hold (vLLM's ref counts are Python ints; ours stop at 2^31 - 1).
const MAX_PINS: u32 = i32::MAX as u32;

/// Release-stack links: not queued, claimed by a pusher, and the end of the stack.
const UNQUEUED: u32 = 0;
const CLAIMED: u32 = u32::MAX - 1;
const END: u32 = u32::MAX;

fn word(seq: u32, code: u32) -> u64 {
    (u64::from(seq) << 32) | u64::from(code)
}

fn seq_of(w: u64) -> u32 {
    (w >> 32) as u32
}

fn code_of(w: u64) -> u32 {
    w as u32
}

/// Real pins of a code (none for absent, pending, tentative and releasing slots).
fn pins_of(code: u32) -> u32 {
    code.saturating_sub(READY)
}

/// The key's bytes as the words a slot stores (zero past the end).
// Kept out of line by the compiler on the lock-free probe's path (a call per key).
#[allow(clippy::inline_always)]
#[inline(always)]
fn key_words(key: &[u8]) -> [u64; WORDS] {
    let n = key.len();
    if n > INLINE_KEY - 8 && n <= INLINE_KEY {
        // vLLM's keys (36 bytes): four whole words and a partial fifth, without a loop.
        let w = |at: usize| u64::from_le_bytes(key[at..at + 8].try_into().unwrap_or_default());
        return [w(0), w(8), w(16), w(24), w(n - 8) >> (8 * (INLINE_KEY - n))];
    }
    let inline = &key[..n.min(INLINE_KEY)];
    let mut w = [0u64; WORDS];
    for (i, x) in w.iter_mut().enumerate().take(inline.len().div_ceil(8)) {
        *x = word_at(inline, i);
    }
    w
}

/// Word `i` of `inline` (at most [`INLINE_KEY`] bytes, `8 * i < inline.len()`): its bytes
/// little-endian, zero past the end. A partial last word of a key of 8 bytes or more is read
/// as the key's last 8 bytes shifted down, so no word is assembled byte by byte (and no call
/// to `memcpy` is made) on the lookup path.
#[inline]
fn word_at(inline: &[u8], i: usize) -> u64 {
    let (start, n) = (8 * i, inline.len());
    let load = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&inline[at..at + 8]);
        u64::from_le_bytes(b)
    };
    if start + 8 <= n {
        load(start)
    } else if n >= 8 {
        load(n - 8) >> (8 * (start + 8 - n))
    } else {
        inline[start..]
            .iter()
            .rev()
            .fold(0u64, |acc, &byte| (acc << 8) | u64::from(byte))
    }
}

/// One slot: see the module docs.
#[repr(C, align(64))]
pub(crate) struct Slot {
    state: AtomicU64,
    hash: AtomicU64,
    /// The next slot of the chain, plus one (0: the end).
    next: AtomicU32,
    /// The key's length (meaningful while the slot holds a key).
    len: AtomicU32,
    words: [AtomicU64; WORDS],
}

// SAFETY: every field is an atomic integer (or an array of them), valid as zero bytes and
// without drop; under loom `zero()` builds it field by field.
unsafe impl Zeroable for Slot {
    fn zero() -> Self {
        Self {
            state: AtomicU64::zero(),
            hash: AtomicU64::zero(),
            next: AtomicU32::zero(),
            len: AtomicU32::zero(),
            words: std::array::from_fn(|_| AtomicU64::zero()),
        }
    }
}

/// Entries a bucket holds inline (under loom one, so that small models reach the chains).
#[cfg(not(loom))]
const ENTRIES: usize = 3;
#[cfg(loom)]
const ENTRIES: usize = 1;

/// An entry: the high 32 bits of the key's hash (its tag) above the slot id plus one; 0 is
/// empty.
fn entry(hash: u64, c: ChunkId) -> u64 {
    (hash & !0xffff_ffff) | u64::from(c + 1)
}

fn entry_slot(e: u64) -> Option<ChunkId> {
    (e as u32).checked_sub(1)
}

fn entry_tag_matches(e: u64, hash: u64) -> bool {
    e != 0 && (e ^ hash) >> 32 == 0
}

/// A bucket's entries (loaded with `order`) and a mask of those for which `hit` holds (bit
/// `i`: entry `i`), computed without a branch per entry. Which entry holds a key, or is free,
/// is random, so a loop that stopped at it mispredicted its exit about once a search; a walk
/// over the mask's bits (usually one, or none) does not.
#[allow(clippy::inline_always)]
#[inline(always)]
fn entry_hits(
    entries: &[AtomicU64; ENTRIES],
    order: Ordering,
    hit: impl Fn(u64) -> bool,
) -> ([u64; ENTRIES], u32) {
    let values: [u64; ENTRIES] = std::array::from_fn(|i| entries[i].load(order));
    let hits = values
        .iter()
        .enumerate()
        .fold(0u32, |hits, (i, &v)| hits | u32::from(hit(v)) << i);
    (values, hits)
}

/// The first of a bucket's entries for which `hit` holds: its place and value (see
/// [`entry_hits`]).
#[allow(clippy::inline_always)]
#[inline(always)]
fn first_entry(
    entries: &[AtomicU64; ENTRIES],
    order: Ordering,
    hit: impl Fn(u64) -> bool,
) -> Option<(usize, u64)> {
    let (values, hits) = entry_hits(entries, order, hit);
    let i = hits.trailing_zeros() as usize;
    values.get(i).map(|&v| (i, v))
}

/// The entries of a bucket whose tags match `hash`, first to last (see [`entry_hits`]).
#[allow(clippy::inline_always)]
#[inline(always)]
fn tag_matches(
    entries: &[AtomicU64; ENTRIES],
    order: Ordering,
    hash: u64,
) -> impl Iterator<Item = u64> {
    let (values, mut hits) = entry_hits(entries, order, |e| entry_tag_matches(e, hash));
    std::iter::from_fn(move || {
        let i = hits.trailing_zeros() as usize;
        hits &= hits.wrapping_sub(1);
        values.get(i).copied()
    })
}

/// A key's bit in its bucket's chain summary ([`Bucket::chained`]): one of 32, chosen by the
/// hash's top 5 bits (the bucket is chosen by its low bits).
fn chain_bit(hash: u64) -> u32 {
    1 << (hash >> 59)
}

/// Whether `hash`'s [`chain_bit`] is set in the chain summary `summary`.
#[inline]
fn in_summary(summary: u32, hash: u64) -> bool {
    (summary >> (hash >> 59)) & 1 != 0
}

/// One bucket: a few keys' tags and slots inline, readable in one cache access, and the head of
/// a chain through the slots for the rest (see the module docs). Entries never move: a key
/// stays where it was put until it is removed.
#[repr(C, align(32))]
pub(crate) struct Bucket {
    entries: [AtomicU64; ENTRIES],
    /// The first slot of the overflow chain, plus one (0: none).
    head: AtomicU32,
    /// A summary of the chain: at least the [`chain_bit`] of every key in it. An absent key
    /// whose bit is clear skips the walk (about one bucket in seven has a chain, and its slots
    /// are random cache misses). Bits are set before a key is linked; the writer clears the
    /// bits of keys gone when it walks the whole chain anyway.
    chained: AtomicU32,
}

// SAFETY: atomics only, valid as zero bytes and without drop; under loom built by `zero()`.
unsafe impl Zeroable for Bucket {
    fn zero() -> Self {
        Self {
            entries: std::array::from_fn(|_| AtomicU64::zero()),
            head: AtomicU32::zero(),
            chained: AtomicU32::zero(),
        }
    }
}

/// What [`Slots::unpin_all`] answers: for each place of its chunks, whether the pin dropped
/// there left the slot evictable. A bit a place (inline up to 128 places).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unpinned {
    words: SmallVec<[u64; 2]>,
    len: usize,
}

impl Unpinned {
    fn new(len: usize) -> Self {
        let n = len.div_ceil(64);
        // Up to 128 places: two words inline (a spare one stays zero).
        let words = if n <= 2 {
            SmallVec::from_buf([0; 2])
        } else {
            smallvec::smallvec![0; n]
        };
        Self { words, len }
    }

    /// Whether the drop at place `i` left its slot evictable (`false` past the end).
    #[must_use]
    pub fn get(&self, i: usize) -> bool {
        i < self.len && (self.words[i / 64] >> (i % 64)) & 1 != 0
    }

    /// Call `f` with each place whose drop left its slot evictable, in ascending order.
    #[inline]
    pub fn each_place(&self, mut f: impl FnMut(usize)) {
        for (n, &w) in self.words.iter().enumerate() {
            let mut w = w;
            while w != 0 {
                f(n * 64 + w.trailing_zeros() as usize);
                w &= w - 1;
            }
        }
    }

    /// The answer as one flag a place, in order.
    #[must_use]
    pub fn to_vec(&self) -> Vec<bool> {
        (0..self.len).map(|i| self.get(i)).collect()
    }
}

/// Whether a slot's inline key matches `key`, read with relaxed loads (the caller validates).
enum Match {
    No,
    Yes,
    /// The inline part matches a key longer than [`INLINE_KEY`]: only the writer can tell.
    Long,
}

impl Slot {
    /// [`matches`](Self::matches) reading `key`'s words as it goes (the writer's lookups: one
    /// comparison per call, so no word array is built first).
    #[inline]
    fn holds(&self, key: &[u8]) -> Match {
        let n = key.len();
        if self.len.load(Ordering::Relaxed) as usize != n {
            return Match::No;
        }
        if n > INLINE_KEY - 8 && n <= INLINE_KEY {
            // vLLM's keys (36 bytes): four whole words and a partial fifth, compared without
            // a branch per word. The words `key_words` builds, read here in place: comparing
            // against `key_words(key)` measured 5-10 instructions a lookup more (callgrind).
            let w = |at: usize| u64::from_le_bytes(key[at..at + 8].try_into().unwrap_or_default());
            let tail = w(n - 8) >> (8 * (INLINE_KEY - n));
            let s = |i: usize| self.words[i].load(Ordering::Relaxed);
            let diff =
                (s(0) ^ w(0)) | (s(1) ^ w(8)) | (s(2) ^ w(16)) | (s(3) ^ w(24)) | (s(4) ^ tail);
            return if diff == 0 { Match::Yes } else { Match::No };
        }
        if (8..=INLINE_KEY).contains(&n) {
            // Other keys of a word or more: whole words straight from the key,
            // then a partial last word as the key's last 8 bytes shifted down (see `word_at`).
            let whole = key.chunks_exact(8);
            let rest = whole.remainder().len();
            for (w, bytes) in self.words.iter().zip(whole) {
                let want = u64::from_le_bytes(bytes.try_into().unwrap_or_default());
                if w.load(Ordering::Relaxed) != want {
                    return Match::No;
                }
            }
            if rest > 0 {
                let tail: [u8; 8] = key[n - 8..].try_into().unwrap_or_default();
                let want = u64::from_le_bytes(tail) >> (8 * (8 - rest));
                if self.words[n / 8].load(Ordering::Relaxed) != want {
                    return Match::No;
                }
            }
            return Match::Yes;
        }
        let inline = &key[..key.len().min(INLINE_KEY)];
        for (i, w) in self.words.iter().enumerate().take(inline.len().div_ceil(8)) {
            if w.load(Ordering::Relaxed) != word_at(inline, i) {
                return Match::No;
            }
        }
        if key.len() > INLINE_KEY {
            Match::Long
        } else {
            Match::Yes
        }
    }

    fn matches(&self, key: &[u8], want: &[u64; WORDS]) -> Match {
        let len = self.len.load(Ordering::Relaxed) as usize;
        if len != key.len() {
            return Match::No;
        }
        let n = len.min(INLINE_KEY).div_ceil(8);
        if self.words[..n]
            .iter()
            .zip(want)
            .any(|(w, &x)| w.load(Ordering::Relaxed) != x)
        {
            return Match::No;
        }
        if len > INLINE_KEY {
            Match::Long
        } else {
            Match::Yes
        }
    }
}

/// What a lock-free lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Absent.
    Miss,
    /// A store is in flight.
    Pending,
    /// Readable.
    Ready,
    /// A key longer than [`INLINE_KEY`] matched inline: ask the writer (under the lock).
    Unsure,
}

/// What a lock-free release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// One pin per key was dropped.
    Done,
    /// Nothing changed: repeat the call under the lock (a key not pinned, a long key, or a
    /// conflict with another release).
    Unsure,
}

/// A slot found by a reader: its id and the state word read with it.
enum Found {
    Absent,
    At(ChunkId, u64),
    Unsure,
}

/// The shared table; see the module docs.
pub struct ChunkTable {
    slots: ZeroArray<Slot>,
    buckets: ZeroArray<Bucket>,
    mask: usize,
    /// Release-stack link of each slot: [`UNQUEUED`], [`CLAIMED`], [`END`] or the next + 1.
    links: ZeroArray<AtomicU32>,
    /// The top of the release stack, plus one (0: empty).
    top: AtomicU32,
    /// Releases in progress (each counts itself in before it looks at `exclusive`).
    releasers: AtomicU32,
    /// 1 while the writer pins without compare-and-swap ([`Slots::set_exclusive`]): a release
    /// that finds it set backs off ([`Release::Unsure`]) without touching a slot.
    exclusive: AtomicU32,
}

impl ChunkTable {
    fn new(num_chunks: u32) -> Option<Self> {
        let n = num_chunks as usize;
        // Half as many buckets as slots, each holding three keys inline: a full pool loads
        // them to 1..2 keys, and 2-14% of keys overflow into a chain.
        let buckets = (n.next_power_of_two() / 2).max(16);
        Some(Self {
            slots: ZeroArray::new(n)?,
            buckets: ZeroArray::new(buckets)?,
            mask: buckets - 1,
            links: ZeroArray::new(n)?,
            top: AtomicU32::zero(),
            releasers: AtomicU32::zero(),
            exclusive: AtomicU32::zero(),
        })
    }

    /// Number of slots.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn bucket(&self, hash: u64) -> usize {
        (hash as usize) & self.mask
    }

    /// Read slot `c` for `key` between two loads of its sequence number: `None` if a writer
    /// disturbed it (the caller starts again), else whether it holds `key`, the state word read
    /// last, the slot's hash and its chain link.
    fn read_slot(
        &self,
        c: ChunkId,
        key: &[u8],
        want: &[u64; WORDS],
        hash: u64,
    ) -> Option<(Match, u64, u64, u32)> {
        let slot = self.slots.get(c as usize)?;
        let w1 = slot.state.load(Ordering::Acquire);
        if seq_of(w1) & 1 == 1 {
            return None;
        }
        let h = slot.hash.load(Ordering::Relaxed);
        let next = slot.next.load(Ordering::Relaxed);
        let m = if code_of(w1) != ABSENT && h == hash {
            slot.matches(key, want)
        } else {
            Match::No
        };
        fence(Ordering::Acquire);
        let w2 = slot.state.load(Ordering::Relaxed);
        (seq_of(w2) == seq_of(w1)).then_some((m, w2, h, next))
    }

    /// The slot holding `key` and its state word; lock-free (see the module docs).
    #[inline]
    fn find_word(&self, key: &[u8], hash: u64) -> Found {
        let want = key_words(key);
        let b = self.bucket(hash);
        let bucket = &self.buckets[b];
        'restart: loop {
            for entry in tag_matches(&bucket.entries, Ordering::Acquire, hash) {
                let Some(c) = entry_slot(entry) else { continue };
                let Some((m, w, _, _)) = self.read_slot(c, key, &want, hash) else {
                    backoff();
                    continue 'restart;
                };
                match m {
                    Match::Yes => return Found::At(c, w),
                    Match::Long => return Found::Unsure,
                    Match::No => {}
                }
            }
            let mut link = bucket.head.load(Ordering::Acquire);
            // Read after the head: the summary then covers every key the walk from this head
            // could reach, unless the writer has since cleared the bit of a key that left
            // (absent at that moment, so "absent" is an answer the table held). `black_box`
            // keeps the bit's computation here: hoisted to the top, it cost every lookup 4
            // instructions (callgrind), most of them hits that never reach the chain.
            if link != 0 && !in_summary(bucket.chained.load(Ordering::Acquire), black_box(hash)) {
                return Found::Absent;
            }
            // A chain never holds more slots than the table: more steps mean a concurrent
            // writer moved slots under this reader.
            let mut steps = 0usize;
            while link != 0 {
                steps += 1;
                let c = link - 1;
                let read = self.read_slot(c, key, &want, hash);
                // A chained slot that left the bucket leads into another chain.
                let Some((m, w, _, next)) =
                    read.filter(|&(_, _, h, _)| self.bucket(h) == b && steps <= self.slots.len())
                else {
                    backoff();
                    continue 'restart;
                };
                match m {
                    Match::Yes => return Found::At(c, w),
                    Match::Long => return Found::Unsure,
                    Match::No => link = next,
                }
            }
            return Found::Absent;
        }
    }

    /// The state of `key`, lock-free.
    #[inline]
    #[must_use]
    pub fn probe(&self, key: &[u8], hash: u64) -> Probe {
        match self.find_word(key, hash) {
            Found::Absent => Probe::Miss,
            Found::Unsure => Probe::Unsure,
            Found::At(_, w) if code_of(w) == PENDING => Probe::Pending,
            Found::At(_, w) if code_of(w) == ABSENT => Probe::Miss,
            Found::At(..) => Probe::Ready,
        }
    }

    /// The number of leading keys that are readable, lock-free; `None`: a long key needs the
    /// writer.
    #[must_use]
    pub fn lookup_prefix(&self, keys: &[&[u8]]) -> Option<usize> {
        let mut hits = 0;
        // Batches of 32: every bucket of a batch is requested before the first is read.
        for batch in keys.chunks(32) {
            let hashes: SmallVec<[u64; 32]> = self.hash_batch(batch);
            self.prefetch_slots(&hashes);
            for (k, &h) in batch.iter().zip(&hashes) {
                match self.probe(k, h) {
                    Probe::Ready => hits += 1,
                    Probe::Unsure => return None,
                    Probe::Miss | Probe::Pending => return Some(hits),
                }
            }
        }
        Some(hits)
    }

    /// The hashes of a batch of keys, each key's bucket requested as soon as its hash is
    /// known (for a batch of two or more): the buckets' cache misses overlap with each other
    /// and with the hashing of the keys after them (at 10^6 chunks, load measured 3-6% faster
    /// than with every key hashed before the first bucket was requested).
    pub(crate) fn hash_batch<C: FromIterator<u64>>(&self, keys: &[&[u8]]) -> C {
        keys.iter()
            .map(|k| {
                let h = hash_key(k);
                if keys.len() > 1 {
                    prefetch(&self.buckets[self.bucket(h)]);
                }
                h
            })
            .collect()
    }

    /// Start loading the first slot of each key of a batch whose buckets were requested
    /// ([`hash_batch`](Self::hash_batch)): the cache misses of the batch overlap instead of
    /// queueing.
    fn prefetch_slots(&self, hashes: &[u64]) {
        if hashes.len() < 2 {
            return;
        }
        for &h in hashes {
            if let Some(slot) = self.candidate(h).and_then(|c| self.slots.get(c as usize)) {
                prefetch(slot);
            }
        }
    }

    /// The slot of the first entry whose tag matches `hash`, else the first of the overflow
    /// chain if `hash`'s bit is in its summary, without comparing keys: a guess to prefetch.
    /// `None`: no key of that hash is in the table.
    fn candidate(&self, hash: u64) -> Option<ChunkId> {
        let bucket = &self.buckets[self.bucket(hash)];
        first_entry(&bucket.entries, Ordering::Relaxed, |e| {
            entry_tag_matches(e, hash)
        })
        .and_then(|(_, e)| entry_slot(e))
        .or_else(|| {
            // Both tests at once (each alone is close to a coin toss per key).
            let head = bucket.head.load(Ordering::Relaxed);
            let summary = bucket.chained.load(Ordering::Relaxed);
            ((head != 0) & in_summary(summary, hash)).then(|| head - 1)
        })
    }

    /// Drop one pin per key (a key listed twice drops two), lock-free; see the module docs.
    /// Either every pin is dropped ([`Release::Done`]) or none ([`Release::Unsure`]): none
    /// also while the writer pins without compare-and-swap ([`Slots::set_exclusive`]).
    pub fn release(&self, keys: &[&[u8]]) -> Release {
        // Counted in first, then the writer's flag read, a full fence between (as between the
        // writer's flag store and its read of the count): either this release sees the flag
        // and backs off, or the writer sees the count and keeps its compare-and-swap.
        self.releasers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let done = if self.exclusive.load(Ordering::SeqCst) == 0 {
            self.release_counted(keys)
        } else {
            Release::Unsure
        };
        self.releasers.fetch_sub(1, Ordering::SeqCst);
        done
    }

    /// [`release`](Self::release) once counted in and clear of an exclusive writer.
    fn release_counted(&self, keys: &[&[u8]]) -> Release {
        let mut taken: SmallVec<[(ChunkId, bool); 32]> = SmallVec::with_capacity(keys.len());
        let hashes: SmallVec<[u64; 32]> = self.hash_batch(keys);
        self.prefetch_slots(&hashes);
        for (k, &hash) in keys.iter().zip(&hashes) {
            let Found::At(c, mut w) = self.find_word(k, hash) else {
                self.undo_releases(&taken);
                return Release::Unsure;
            };
            let slot = &self.slots[c as usize];
            let seq = seq_of(w);
            loop {
                let n = pins_of(code_of(w));
                if n == 0 || seq_of(w) != seq {
                    self.undo_releases(&taken);
                    return Release::Unsure;
                }
                let code = if n == 1 { TENTATIVE } else { READY + n - 1 };
                match slot.state.compare_exchange(
                    w,
                    word(seq, code),
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(_) => {
                        taken.push((c, n == 1));
                        break;
                    }
                    Err(now) => w = now,
                }
            }
        }
        for &(c, last) in &taken {
            if last {
                self.finish_release(c);
            }
        }
        Release::Done
    }

    /// Give back the pins a failed release took (they are held, so their slots kept their keys).
    fn undo_releases(&self, taken: &[(ChunkId, bool)]) {
        for &(c, _) in taken.iter().rev() {
            let slot = &self.slots[c as usize];
            let mut w = slot.state.load(Ordering::SeqCst);
            loop {
                let code = match code_of(w) {
                    TENTATIVE => READY + 1,
                    code => code + 1,
                };
                debug_assert!(code_of(w) == TENTATIVE || code_of(w) >= READY);
                match slot.state.compare_exchange(
                    w,
                    word(seq_of(w), code),
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(_) => break,
                    Err(now) => w = now,
                }
            }
        }
    }

    /// Turn a tentative slot into a releasing one and queue it for the writer (unless the
    /// writer pinned it again meanwhile, or another release already turned it).
    fn finish_release(&self, c: ChunkId) {
        let slot = &self.slots[c as usize];
        let mut w = slot.state.load(Ordering::SeqCst);
        while code_of(w) == TENTATIVE {
            match slot.state.compare_exchange(
                w,
                word(seq_of(w), RELEASING),
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => {
                    self.push_release(c);
                    return;
                }
                Err(now) => w = now,
            }
        }
    }

    /// Queue slot `c` on the release stack, unless it is queued already.
    fn push_release(&self, c: ChunkId) {
        let link = &self.links[c as usize];
        if link
            .compare_exchange(UNQUEUED, CLAIMED, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return;
        }
        let mut top = self.top.load(Ordering::SeqCst);
        loop {
            link.store(if top == 0 { END } else { top }, Ordering::SeqCst);
            match self
                .top
                .compare_exchange(top, c + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return,
                Err(now) => top = now,
            }
        }
    }
}

/// The writer's side of a [`ChunkTable`]: the only code that changes keys, the counters of
/// pending and evictable slots, and the tails of long keys. See the module docs.
pub struct Slots {
    table: Arc<ChunkTable>,
    /// Slots `0..used` may hold keys (the pool's high-water mark).
    used: usize,
    /// Resident keys.
    len: usize,
    num_pending: usize,
    num_evictable: usize,
    /// Whole keys longer than [`INLINE_KEY`], by slot.
    long: HashMap<ChunkId, Box<[u8]>, KeyHasher>,
    /// Granted by [`set_exclusive`](Self::set_exclusive): no release runs meanwhile, so pins
    /// change by plain stores, not compare-and-swap.
    exclusive: bool,
}

impl Slots {
    /// `num_chunks` empty slots; `None` if the memory cannot be mapped.
    #[must_use]
    pub fn new(num_chunks: u32) -> Option<Self> {
        Some(Self {
            table: Arc::new(ChunkTable::new(num_chunks)?),
            used: 0,
            len: 0,
            num_pending: 0,
            num_evictable: 0,
            long: HashMap::default(),
            exclusive: false,
        })
    }

    /// Ask (`true`) for pins without compare-and-swap until `set_exclusive(false)`: while
    /// granted, [`pin`](Self::pin) and [`unpin_all`](Self::unpin_all) change a slot's state
    /// word by a load and a store (a locked instruction costs about a tenth of a load in wall
    /// time), and every [`ChunkTable::release`] backs off with [`Release::Unsure`] (its caller
    /// then repeats it under the lock, which waits for this call). Granted unless a release is
    /// in progress at the moment of asking (then the call keeps the compare-and-swap). Readers
    /// are unaffected: they only load. Worth asking when releases rarely overlap the writer's
    /// calls (an interpreter with a GIL); off by default.
    pub fn set_exclusive(&mut self, on: bool) {
        let t = &*self.table;
        if on {
            // The flag first, then the count (see `ChunkTable::release`): a release already
            // counted in may be changing pins, so this call keeps the compare-and-swap.
            t.exclusive.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            self.exclusive = t.releasers.load(Ordering::SeqCst) == 0;
            if !self.exclusive {
                t.exclusive.store(0, Ordering::SeqCst);
            }
        } else if self.exclusive {
            // Only a granted request leaves the flag set.
            self.exclusive = false;
            t.exclusive.store(0, Ordering::SeqCst);
        }
    }

    /// The shared table, for lock-free readers and releasers.
    #[must_use]
    pub fn shared(&self) -> Arc<ChunkTable> {
        Arc::clone(&self.table)
    }

    /// Number of slots.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.table.capacity()
    }

    /// Slots `0..n` may now hold keys (`n` at most the capacity).
    pub fn grow(&mut self, n: usize) {
        debug_assert!(n <= self.capacity());
        self.used = self.used.max(n.min(self.capacity()));
    }

    /// The high-water mark: slots `0..used()` may hold keys.
    #[must_use]
    pub fn used(&self) -> usize {
        self.used
    }

    /// Resident keys.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no key is resident.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn slot(&self, c: ChunkId) -> &Slot {
        &self.table.slots[c as usize]
    }

    /// The sequence number of pending slot `c` (`None`: not pending). A slot's number changes
    /// whenever its key does (by 2 per insertion and per removal) and never otherwise, so a
    /// pending slot's number names the write in flight there: the one its insertion started.
    #[inline]
    #[must_use]
    pub fn pending_seq(&self, c: ChunkId) -> Option<u32> {
        let w = self
            .table
            .slots
            .get(c as usize)?
            .state
            .load(Ordering::Acquire);
        (code_of(w) == PENDING).then_some(seq_of(w))
    }

    fn code(&self, c: ChunkId) -> u32 {
        self.table
            .slots
            .get(c as usize)
            .map_or(ABSENT, |s| code_of(s.state.load(Ordering::Acquire)))
    }

    // --- keys ---

    /// The slot holding `key` (hashing to `hash`).
    #[inline]
    #[must_use]
    pub fn find(&self, key: &[u8], hash: u64) -> Option<ChunkId> {
        let t = &*self.table;
        let bucket = &t.buckets[t.bucket(hash)];
        for e in tag_matches(&bucket.entries, Ordering::Relaxed, hash) {
            if let Some(c) = entry_slot(e).filter(|&c| self.holds(c, key, hash)) {
                return Some(c);
            }
        }
        let mut link = bucket.head.load(Ordering::Relaxed);
        let summary = bucket.chained.load(Ordering::Relaxed);
        if link == 0 || !in_summary(summary, hash) {
            return None;
        }
        // The whole chain is walked for an absent key: its summary is made exact on the way.
        let mut bits = 0;
        while link != 0 {
            let c = link - 1;
            if self.holds(c, key, hash) {
                return Some(c);
            }
            let slot = self.slot(c);
            bits |= chain_bit(slot.hash.load(Ordering::Relaxed));
            link = slot.next.load(Ordering::Relaxed);
        }
        if bits != summary {
            bucket.chained.store(bits, Ordering::Release);
        }
        None
    }

    /// [`find`](Self::find) given `candidate`, what [`candidate`](Self::candidate) answered for
    /// `hash` since the table last changed: that slot is compared first, and no candidate means
    /// no key of that hash is in the table (no entry's tag matches, and the chain is empty or
    /// its summary lacks the hash's bit).
    #[inline]
    #[must_use]
    pub fn find_from(&self, key: &[u8], hash: u64, candidate: Option<ChunkId>) -> Option<ChunkId> {
        let c = candidate?;
        if self.holds(c, key, hash) {
            Some(c)
        } else {
            self.find(key, hash)
        }
    }

    /// Whether slot `c` holds `key` (hashing to `hash`); keys are compared only on a hash match
    /// (almost always the key itself).
    #[inline]
    fn holds(&self, c: ChunkId, key: &[u8], hash: u64) -> bool {
        let slot = self.slot(c);
        slot.hash.load(Ordering::Relaxed) == hash
            && match slot.holds(key) {
                Match::Yes => true,
                Match::Long => self.long.get(&c).is_some_and(|k| **k == *key),
                Match::No => false,
            }
    }

    /// Whether slot `c` (any id) holds `key`: checked without hashing `key` or probing the
    /// index, for a caller that has a good guess of the slot.
    #[inline]
    #[must_use]
    pub fn holds_at(&self, c: ChunkId, key: &[u8]) -> bool {
        self.code(c) != ABSENT && self.holds(c, key, self.hash(c))
    }

    /// See [`ChunkTable::candidate`].
    #[inline]
    #[must_use]
    pub fn candidate(&self, hash: u64) -> Option<ChunkId> {
        self.table.candidate(hash)
    }

    /// See [`ChunkTable::hash_batch`].
    #[inline]
    pub(crate) fn hash_batch<C: FromIterator<u64>>(&self, keys: &[&[u8]]) -> C {
        self.table.hash_batch(keys)
    }

    /// Start loading the bucket of `hash`; changes nothing.
    #[inline]
    pub fn prefetch_bucket(&self, hash: u64) {
        let t = &*self.table;
        prefetch(&t.buckets[t.bucket(hash)]);
    }

    /// Start loading slot `c`; changes nothing (any id).
    #[inline]
    pub fn prefetch(&self, c: ChunkId) {
        if let Some(s) = self.table.slots.get(c as usize) {
            prefetch(s);
        }
    }

    /// Whether slot `c` holds a key.
    #[must_use]
    pub fn resident(&self, c: ChunkId) -> bool {
        self.code(c) != ABSENT
    }

    /// The hash of slot `c`'s key (meaningful while resident).
    #[must_use]
    pub fn hash(&self, c: ChunkId) -> u64 {
        self.slot(c).hash.load(Ordering::Relaxed)
    }

    /// A copy of slot `c`'s key (meaningful while resident).
    #[must_use]
    pub fn key(&self, c: ChunkId) -> KeyBuf {
        match self.inline_key(c) {
            // `KeyBuf`'s inline buffer is exactly `INLINE_KEY` bytes: no copy beyond this one.
            Some((bytes, len)) => KeyBuf::from_buf_and_len(bytes, len),
            None => self.long.get(&c).map_or_else(
                || KeyBuf::from_buf_and_len(self.inline_bytes(c), INLINE_KEY),
                |k| KeyBuf::from_slice(k),
            ),
        }
    }

    /// Slot `c`'s key as its inline bytes (zero past its end) and its length, or `None` for a
    /// key longer than [`INLINE_KEY`]: a fixed-size copy, for a caller that keeps keys in
    /// fixed-size fields (ARC's ghosts).
    #[must_use]
    pub fn inline_key(&self, c: ChunkId) -> Option<([u8; INLINE_KEY], usize)> {
        let len = self.slot(c).len.load(Ordering::Relaxed) as usize;
        (len <= INLINE_KEY).then(|| (self.inline_bytes(c), len))
    }

    /// Every inline word of slot `c`, whatever the key's length (words past its end hold
    /// zeros): a fixed trip count that compiles to straight-line loads and stores.
    fn inline_bytes(&self, c: ChunkId) -> [u8; INLINE_KEY] {
        let mut bytes = [0u8; INLINE_KEY];
        for (dst, w) in bytes.chunks_exact_mut(8).zip(&self.slot(c).words) {
            dst.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        bytes
    }

    /// Give absent slot `c` the key `key`, pending.
    pub fn insert(&mut self, c: ChunkId, key: &[u8], hash: u64) {
        debug_assert!(!self.resident(c));
        self.grow(c as usize + 1);
        let t = &*self.table;
        let slot = &t.slots[c as usize];
        let seq = seq_of(slot.state.load(Ordering::Relaxed));
        // Odd while the key is rewritten: readers passing by start again.
        slot.state.store(word(seq | 1, ABSENT), Ordering::Relaxed);
        fence(Ordering::Release);
        slot.hash.store(hash, Ordering::Relaxed);
        debug_assert!(key.len() <= MAX_KEY_LEN, "a key too long for a slot");
        slot.len.store(key.len() as u32, Ordering::Relaxed);
        for (w, x) in slot.words.iter().zip(key_words(key)) {
            w.store(x, Ordering::Relaxed);
        }
        let bucket = &t.buckets[t.bucket(hash)];
        let free = first_entry(&bucket.entries, Ordering::Relaxed, |e| e == 0)
            .map(|(i, _)| &bucket.entries[i]);
        let head = &bucket.head;
        slot.next.store(
            if free.is_some() {
                0
            } else {
                // The key's bit goes into the summary before the key is linked (see
                // `ChunkTable::find_word`).
                let bits = bucket.chained.load(Ordering::Relaxed);
                bucket
                    .chained
                    .store(bits | chain_bit(hash), Ordering::Relaxed);
                head.load(Ordering::Relaxed)
            },
            Ordering::Relaxed,
        );
        slot.state
            .store(word((seq | 1).wrapping_add(1), PENDING), Ordering::Release);
        match free {
            Some(e) => e.store(entry(hash, c), Ordering::Release),
            None => head.store(c + 1, Ordering::Release),
        }
        if key.len() > INLINE_KEY {
            self.long.insert(c, key.into());
        }
        self.len += 1;
        self.num_pending += 1;
    }

    /// Make pending or evictable slot `c` absent; returns its key.
    pub fn remove(&mut self, c: ChunkId) -> KeyBuf {
        let key = self.key(c);
        self.discard(c);
        key
    }

    /// [`remove`](Self::remove) without a copy of the key.
    pub fn discard(&mut self, c: ChunkId) {
        let t = &*self.table;
        let slot = &t.slots[c as usize];
        let w = slot.state.load(Ordering::Acquire);
        match code_of(w) {
            PENDING => self.num_pending -= 1,
            READY => self.num_evictable -= 1,
            code => debug_assert!(false, "removing slot {c} in state {code}"),
        }
        slot.state
            .store(word(seq_of(w).wrapping_add(2), ABSENT), Ordering::Release);
        // Unlink: the slot keeps its own link, so a reader standing on it still reaches the
        // rest of the chain.
        let next = slot.next.load(Ordering::Relaxed);
        let bucket = &t.buckets[t.bucket(slot.hash.load(Ordering::Relaxed))];
        // (An entry's low half is its slot plus one.)
        let inline = first_entry(&bucket.entries, Ordering::Relaxed, |e| {
            e as u32 == c.wrapping_add(1)
        })
        .map(|(i, _)| &bucket.entries[i]);
        let mut link = &bucket.head;
        if let Some(e) = inline {
            e.store(0, Ordering::Release);
        } else {
            // The bits of the slots before `c`: the whole chain's once `c`, its last, is gone.
            let mut bits = 0;
            loop {
                let l = link.load(Ordering::Relaxed);
                if l == 0 {
                    debug_assert!(false, "slot {c} is not in its chain");
                    break;
                }
                if l == c + 1 {
                    link.store(next, Ordering::Release);
                    if next == 0 {
                        bucket.chained.store(bits, Ordering::Release);
                    }
                    break;
                }
                let before = &t.slots[l as usize - 1];
                bits |= chain_bit(before.hash.load(Ordering::Relaxed));
                link = &before.next;
            }
        }
        if slot.len.load(Ordering::Relaxed) as usize > INLINE_KEY {
            self.long.remove(&c);
        }
        self.len -= 1;
    }

    /// Make every slot absent (releases still queued are dropped when drained).
    pub fn clear(&mut self) {
        let t = &*self.table;
        for slot in &t.slots[..self.used] {
            let w = slot.state.load(Ordering::Acquire);
            if code_of(w) != ABSENT {
                slot.state
                    .store(word(seq_of(w).wrapping_add(2), ABSENT), Ordering::Release);
            }
        }
        for b in t.buckets.iter() {
            for e in &b.entries {
                if e.load(Ordering::Relaxed) != 0 {
                    e.store(0, Ordering::Release);
                }
            }
            if b.head.load(Ordering::Relaxed) != 0 {
                b.head.store(0, Ordering::Release);
                b.chained.store(0, Ordering::Release);
            }
        }
        self.long.clear();
        self.used = 0;
        self.len = 0;
        self.num_pending = 0;
        self.num_evictable = 0;
    }

    // --- ref counts ---

    /// The state of slot `c` as the policy sees it: a slot whose last pin a lock-free release
    /// dropped counts as pinned once until [`drain_releases`](Self::drain_releases).
    #[inline]
    #[must_use]
    pub fn state(&self, c: ChunkId) -> ChunkState {
        match self.code(c) {
            ABSENT => ChunkState::Absent,
            PENDING => ChunkState::Pending,
            TENTATIVE | RELEASING => ChunkState::Ready(1),
            code => ChunkState::Ready(code - READY),
        }
    }

    /// The ref count of slot `c` as the policy sees it (`-1` pending, `n >= 0` ready,
    /// `i32::MIN` absent); see [`state`](Self::state).
    #[inline]
    #[must_use]
    pub fn raw(&self, c: ChunkId) -> i32 {
        match self.state(c) {
            ChunkState::Absent => i32::MIN,
            ChunkState::Pending => -1,
            ChunkState::Ready(n) => n as i32,
        }
    }

    /// Pending slots.
    #[must_use]
    pub fn num_pending(&self) -> usize {
        self.num_pending
    }

    /// Ready slots with no pin (and no release waiting to be applied).
    #[must_use]
    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }

    /// Whether `n` evictions can succeed when `protected_ready` of the evictable slots are
    /// protected: policies are asked only for evictions that can (they assume it).
    #[must_use]
    pub fn can_evict(&self, n: usize, protected_ready: usize) -> bool {
        n <= self.num_evictable.saturating_sub(protected_ready)
    }

    /// pending -> ready with no pin. `false` (and nothing changes) if `c` is not pending.
    pub fn complete_store(&mut self, c: ChunkId) -> bool {
        let slot = self.slot(c);
        let w = slot.state.load(Ordering::Acquire);
        if code_of(w) != PENDING {
            return false;
        }
        slot.state.store(word(seq_of(w), READY), Ordering::Release);
        self.num_pending -= 1;
        self.num_evictable += 1;
        true
    }

    /// Whether slot `c` is pending (its [`state`](Self::state) `Pending`), and whether one
    /// more pin of it is legal ([`check_pin`](Self::check_pin) of 1 is `Ok`): one read of
    /// its state for both.
    #[inline]
    #[must_use]
    pub fn pending_and_pinnable(&self, c: ChunkId) -> (bool, bool) {
        let code = self.code(c);
        (
            code == PENDING,
            code >= TENTATIVE && pins_of(code) < MAX_PINS,
        )
    }

    /// Check that `extra` more pins of slot `c` are legal.
    pub fn check_pin(&self, c: ChunkId, extra: u32) -> Result<()> {
        let code = self.code(c);
        if code < TENTATIVE {
            return Err(crate::CoreError::KeyState(format!(
                "chunk {c} is not readable"
            )));
        }
        if pins_of(code)
            .checked_add(extra)
            .is_none_or(|n| n > MAX_PINS)
        {
            return Err(crate::CoreError::Overflow(format!(
                "chunk {c} would be pinned by over 2^31 loads"
            )));
        }
        Ok(())
    }

    /// Give pinned slot `c` exactly `pins` pins (at least one), bypassing every check: tests
    /// of the pin limit, which no test could reach by pinning.
    #[cfg(test)]
    pub(crate) fn force_pins(&mut self, c: ChunkId, pins: u32) {
        let slot = &self.table.slots[c as usize];
        let w = slot.state.load(Ordering::Acquire);
        slot.state
            .store(word(seq_of(w), READY + pins), Ordering::Release);
    }

    /// One more pin of readable slot `c` (checked by [`check_pin`](Self::check_pin)). `true`
    /// when the slot stops being evictable (a slot with a release waiting was not evictable).
    pub fn pin(&mut self, c: ChunkId) -> bool {
        let slot = &self.table.slots[c as usize];
        let mut w = slot.state.load(Ordering::Acquire);
        loop {
            let code = match code_of(w) {
                TENTATIVE | RELEASING => READY + 1,
                code => code + 1,
            };
            debug_assert!(code_of(w) >= TENTATIVE);
            if self.exclusive {
                // No releaser can change the word between the load and this store.
                slot.state.store(word(seq_of(w), code), Ordering::Release);
                break;
            }
            match slot.state.compare_exchange(
                w,
                word(seq_of(w), code),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => w = now,
            }
        }
        let was_evictable = code_of(w) == READY;
        if was_evictable {
            self.num_evictable -= 1;
        }
        was_evictable
    }

    /// Drop one pin of each slot in order (a slot listed twice drops two), all or none:
    /// `Err(i)` if `chunks[i]` had no pin left (another thread released it) or names no slot,
    /// after giving back the pins already dropped. `Ok` tells, for each place of `chunks`,
    /// whether its drop left the slot evictable (the counters count it so; the caller tells
    /// the policy).
    pub fn unpin_all(&mut self, chunks: &[ChunkId]) -> std::result::Result<Unpinned, usize> {
        let t = &*self.table;
        let give_back = |i: usize| {
            let taken: SmallVec<[(ChunkId, bool); 32]> =
                chunks[..i].iter().map(|&c| (c, false)).collect();
            t.undo_releases(&taken);
            i
        };
        let slots: &[Slot] = &t.slots;
        let mut zero = Unpinned::new(chunks.len());
        let bits = zero.words.as_mut_slice();
        let mut freed = 0;
        for (i, &c) in chunks.iter().enumerate() {
            // A chunk past the slots (only a wrong guess names one) holds no pin either.
            let Some(slot) = slots.get(c as usize) else {
                return Err(give_back(i));
            };
            let mut w = slot.state.load(Ordering::Acquire);
            loop {
                if pins_of(code_of(w)) == 0 {
                    return Err(give_back(i));
                }
                if self.exclusive {
                    // As in `pin`: nothing else writes the word meanwhile.
                    slot.state
                        .store(word(seq_of(w), code_of(w) - 1), Ordering::Release);
                    break;
                }
                match slot.state.compare_exchange(
                    w,
                    word(seq_of(w), code_of(w) - 1),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => break,
                    Err(now) => w = now,
                }
            }
            let z = code_of(w) == READY + 1;
            bits[i / 64] |= u64::from(z) << (i % 64);
            freed += usize::from(z);
        }
        self.num_evictable += freed;
        Ok(zero)
    }

    /// Apply the releases queued by lock-free completions, in release order: each slot still
    /// releasing becomes evictable and goes to `evictable` (for the policy).
    pub fn drain_releases(&mut self, mut evictable: impl FnMut(ChunkId)) {
        let t = &*self.table;
        if t.top.load(Ordering::SeqCst) == 0 {
            return;
        }
        let top = t.top.swap(0, Ordering::SeqCst);
        let mut order: SmallVec<[ChunkId; 32]> = SmallVec::new();
        let mut link = top;
        while link != 0 && link != END {
            let c = link - 1;
            order.push(c);
            link = t.links[c as usize].load(Ordering::SeqCst);
        }
        for &c in order.iter().rev() {
            t.links[c as usize].store(UNQUEUED, Ordering::SeqCst);
            let slot = &t.slots[c as usize];
            let w = slot.state.load(Ordering::SeqCst);
            if code_of(w) == RELEASING
                && slot
                    .state
                    .compare_exchange(
                        w,
                        word(seq_of(w), READY),
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_ok()
            {
                self.num_evictable += 1;
                evictable(c);
            }
        }
    }

    /// Check the counters, the chains and the long keys against the slots.
    pub fn validate(&self) -> Result<()> {
        let t = &*self.table;
        let (mut pending, mut evictable, mut resident) = (0, 0, 0);
        for (i, slot) in t.slots[..self.used].iter().enumerate() {
            let w = slot.state.load(Ordering::Acquire);
            ensure!(seq_of(w) & 1 == 0, "table: slot {i} left mid-write");
            match code_of(w) {
                ABSENT => continue,
                PENDING => pending += 1,
                READY => evictable += 1,
                _ => {}
            }
            resident += 1;
            let c = i as ChunkId;
            let key = self.key(c);
            ensure!(
                slot.hash.load(Ordering::Relaxed) == hash_key(&key),
                "table: stale hash for slot {i}"
            );
            ensure!(
                self.find(&key, hash_key(&key)) == Some(c),
                "table: the index does not map slot {i}'s key to it"
            );
            ensure!(
                (key.len() > INLINE_KEY) == self.long.contains_key(&c),
                "table: long-key tail of slot {i} out of step"
            );
        }
        for slot in &t.slots[self.used..] {
            ensure!(
                code_of(slot.state.load(Ordering::Acquire)) == ABSENT,
                "table: a key past the high-water mark"
            );
        }
        ensure!(
            (pending, evictable, resident) == (self.num_pending, self.num_evictable, self.len),
            "table: {pending} pending, {evictable} evictable, {resident} resident; counters say \
             {}, {}, {}",
            self.num_pending,
            self.num_evictable,
            self.len
        );
        self.validate_index()?;
        ensure!(
            self.long.len() <= self.len,
            "table: long keys of absent slots kept"
        );
        Ok(())
    }

    /// Check that the buckets' entries and chains name every resident slot once, in its own
    /// bucket, and that each chain's summary covers its keys.
    fn validate_index(&self) -> Result<()> {
        let t = &*self.table;
        let mut chained = 0;
        for (b, bucket) in t.buckets.iter().enumerate() {
            for e in &bucket.entries {
                let Some(c) = entry_slot(e.load(Ordering::Acquire)) else {
                    continue;
                };
                ensure!(
                    (c as usize) < self.used,
                    "table: bucket {b} names slot {c} past the slots"
                );
                ensure!(
                    self.resident(c),
                    "table: absent slot {c} still in bucket {b}"
                );
                ensure!(
                    t.bucket(self.hash(c)) == b
                        && entry_tag_matches(e.load(Ordering::Acquire), self.hash(c)),
                    "table: slot {c} in the wrong bucket or under a wrong tag"
                );
                chained += 1;
            }
            let mut link = bucket.head.load(Ordering::Acquire);
            let summary = bucket.chained.load(Ordering::Acquire);
            ensure!(
                link != 0 || summary == 0,
                "table: bucket {b} has no chain but a summary"
            );
            while link != 0 {
                let c = link - 1;
                ensure!(
                    (c as usize) < self.used,
                    "table: chain of bucket {b} leaves the slots"
                );
                ensure!(
                    in_summary(summary, self.hash(c)),
                    "table: slot {c} chained in bucket {b} but missing from its summary"
                );
                ensure!(self.resident(c), "table: absent slot {c} still chained");
                ensure!(
                    t.bucket(self.hash(c)) == b,
                    "table: slot {c} chained in the wrong bucket"
                );
                chained += 1;
                ensure!(
                    chained <= self.len,
                    "table: a chain loops or repeats a slot"
                );
                link = t.slots[c as usize].next.load(Ordering::Relaxed);
            }
        }
        ensure!(
            chained == self.len,
            "table: {chained} slots chained for {} resident",
            self.len
        );
        Ok(())
    }
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots")
            .field("capacity", &self.capacity())
            .field("len", &self.len)
            .field("num_pending", &self.num_pending)
            .field("num_evictable", &self.num_evictable)
            .finish_non_exhaustive()
    }
}

/// `n` distinct keys whose hashes fall in bucket `b` of any table of up to 64 buckets, so they
/// share one chain: for the unit tests below and the loom models (`tests/loom.rs`).
#[cfg(any(test, loom))]
#[doc(hidden)]
#[must_use]
pub fn colliding_keys(b: u64, n: usize) -> Vec<Vec<u8>> {
    (0u32..)
        .map(|i| format!("key{i}").into_bytes())
        .filter(|k| hash_key(k) % 64 == b)
        .take(n)
        .collect()
}

/// Whether two keys share a bit of their bucket's chain summary: for the loom models.
#[cfg(any(test, loom))]
#[doc(hidden)]
#[must_use]
pub fn same_chain_bit(a: &[u8], b: &[u8]) -> bool {
    chain_bit(hash_key(a)) == chain_bit(hash_key(b))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn table(n: u32) -> Slots {
        Slots::new(n).unwrap()
    }

    /// Insert `key` into slot `c`, ready.
    fn put(t: &mut Slots, c: ChunkId, key: &[u8]) {
        t.insert(c, key, hash_key(key));
        assert!(t.complete_store(c));
    }

    #[test]
    fn key_words_are_the_bytes_little_endian_zero_padded() {
        let bytes: Vec<u8> = (1..=48u8).map(|b| b.wrapping_mul(37)).collect();
        for n in 0..=bytes.len() {
            let key = &bytes[..n];
            let mut want = [0u64; WORDS];
            for (j, &b) in key.iter().take(INLINE_KEY).enumerate() {
                want[j / 8] |= u64::from(b) << (8 * (j % 8));
            }
            assert_eq!(key_words(key), want, "key of {n} bytes");
            // A slot holding the key matches it, and no key one byte shorter or different.
            let mut t = table(2);
            put(&mut t, 0, key);
            assert_eq!(t.find(key, hash_key(key)), Some(0), "key of {n} bytes");
            if n > 0 {
                // Any byte the slot holds inline, flipped, or one byte fewer: no match.
                for at in 0..n.min(INLINE_KEY) {
                    let mut other = key.to_vec();
                    other[at] ^= 1;
                    assert!(matches!(t.slot(0).holds(&other), Match::No), "{n}: {at}");
                    assert!(t.find(&other, hash_key(&other)).is_none(), "{n}: {at}");
                }
                assert!(matches!(t.slot(0).holds(&key[..n - 1]), Match::No));
            }
        }
    }

    #[test]
    fn colliding_keys_chain_and_unlink_anywhere() {
        let mut t = table(4);
        let ks = colliding_keys(7, 5);
        for (c, k) in ks[..4].iter().enumerate() {
            put(&mut t, c as ChunkId, k);
        }
        t.validate().unwrap();
        let shared = t.shared();
        let h = |k: &[u8]| hash_key(k);
        for (c, k) in ks[..4].iter().enumerate() {
            assert_eq!(t.find(k, h(k)), Some(c as ChunkId));
            assert_eq!(shared.probe(k, h(k)), Probe::Ready);
        }
        // Middle, head and tail of the chain (3 -> 2 -> 1 -> 0).
        assert_eq!(t.remove(2).as_slice(), ks[2].as_slice());
        assert_eq!(t.remove(3).as_slice(), ks[3].as_slice());
        assert_eq!(t.remove(0).as_slice(), ks[0].as_slice());
        t.validate().unwrap();
        assert_eq!(shared.probe(&ks[2], h(&ks[2])), Probe::Miss);
        assert_eq!(shared.probe(&ks[1], h(&ks[1])), Probe::Ready);
        assert_eq!((t.len(), t.num_evictable()), (1, 1));
        t.insert(0, &ks[4], h(&ks[4]));
        assert_eq!(shared.probe(&ks[4], h(&ks[4])), Probe::Pending);
        t.validate().unwrap();
    }

    /// The chain summary: an absent key whose bit is clear is answered without a walk (and
    /// gets no candidate); a key that leaves the middle of the chain keeps its bit until the
    /// writer walks the whole chain for an absent key, or leaves the tail; an empty chain has an
    /// empty summary.
    #[test]
    fn the_chain_summary_covers_the_chain_and_is_made_exact_by_walks() {
        let mut t = table(16);
        let b = 5;
        let bit = |k: &[u8]| chain_bit(hash_key(k));
        // Keys of one bucket: three for the entries, then three chained with distinct bits.
        let all = colliding_keys(b, 400);
        let mut chain: Vec<&Vec<u8>> = Vec::new();
        for k in &all[ENTRIES..] {
            if chain.iter().all(|c| bit(c) != bit(k)) {
                chain.push(k);
            }
        }
        let (chain, spare) = chain.split_at(3);
        let keys: Vec<&[u8]> = all[..ENTRIES]
            .iter()
            .map(Vec::as_slice)
            .chain(chain.iter().map(|k| k.as_slice()))
            .collect();
        // A key of the bucket, never stored, under the bit of `than`.
        let other = |than: &[u8]| {
            all.iter()
                .find(|k| bit(k) == bit(than) && !keys.contains(&k.as_slice()))
                .unwrap()
        };
        for (c, k) in keys.iter().enumerate() {
            put(&mut t, c as ChunkId, k);
        }
        t.validate().unwrap();
        let summary = |t: &Slots| t.table.buckets[b as usize].chained.load(Ordering::Relaxed);
        let want: u32 = chain.iter().map(|k| bit(k)).fold(0, |a, x| a | x);
        assert_eq!(summary(&t), want);
        let shared = t.shared();
        let h = |k: &[u8]| hash_key(k);
        // An absent key of the bucket whose bit no chained key has.
        let outside = spare[0];
        assert_eq!(t.find(outside, h(outside)), None);
        assert_eq!(t.candidate(h(outside)), None);
        assert_eq!(shared.probe(outside, h(outside)), Probe::Miss);
        // One that shares a chained key's bit walks the chain and is still absent.
        let twin = other(chain[1]);
        assert_eq!(t.find(twin, h(twin)), None);
        assert_eq!(shared.probe(twin, h(twin)), Probe::Miss);
        // The chain runs newest first: chain[2] -> chain[1] -> chain[0]. The middle leaves,
        // keeping its bit, until a walk for an absent key makes the summary exact.
        let c1 = (ENTRIES + 1) as ChunkId;
        assert_eq!(t.remove(c1).as_slice(), chain[1].as_slice());
        assert_eq!(summary(&t), want);
        t.validate().unwrap();
        assert!(t.candidate(h(twin)).is_some());
        assert_eq!(t.find(twin, h(twin)), None);
        assert_eq!(summary(&t), want & !bit(chain[1]));
        assert_eq!(t.candidate(h(twin)), None);
        assert_eq!(shared.probe(chain[1], h(chain[1])), Probe::Miss);
        // The tail leaves: exact at once.
        let c0 = ENTRIES as ChunkId;
        t.remove(c0);
        assert_eq!(summary(&t), bit(chain[2]));
        assert_eq!(shared.probe(chain[2], h(chain[2])), Probe::Ready);
        t.validate().unwrap();
        // The last one leaves: empty.
        t.remove(c0 + 2);
        assert_eq!(summary(&t), 0);
        t.validate().unwrap();
        // Chained again, then cleared.
        put(&mut t, c0, chain[0]);
        assert_eq!(summary(&t), bit(chain[0]));
        t.clear();
        assert_eq!(summary(&t), 0);
        t.validate().unwrap();
    }

    /// `find_from` answers as `find` whatever the candidate it is given: the one `candidate`
    /// reads (an entry whose tag matches, or the chain's head), any other slot (used or not),
    /// or none for a key whose bucket is empty.
    #[test]
    fn find_from_answers_as_find_whatever_the_candidate() {
        let mut t = table(8);
        let ks = colliding_keys(11, 8);
        // Six in one bucket: its three entries and a chain of three; two more absent.
        for (c, k) in ks[..6].iter().enumerate() {
            put(&mut t, c as ChunkId, k);
        }
        t.validate().unwrap();
        for (i, k) in ks.iter().enumerate() {
            let h = hash_key(k);
            let want = t.find(k, h);
            assert_eq!(want, (i < 6).then_some(i as ChunkId));
            assert_eq!(t.find_from(k, h, t.candidate(h)), want);
            for other in 0..8 {
                assert_eq!(
                    t.find_from(k, h, Some(other)),
                    want,
                    "key {i}, slot {other}"
                );
            }
        }
        let lone = &colliding_keys(12, 1)[0];
        assert_eq!(t.candidate(hash_key(lone)), None);
        assert_eq!(t.find_from(lone, hash_key(lone), None), None);
    }

    #[test]
    fn keys_of_every_length_round_trip_and_long_ones_ask_the_writer() {
        let mut t = table(64);
        let keys: Vec<Vec<u8>> = (0..64u8).map(|n| (0..n).map(|i| i ^ n).collect()).collect();
        for (c, k) in keys.iter().enumerate() {
            put(&mut t, c as ChunkId, k);
        }
        t.validate().unwrap();
        let shared = t.shared();
        for (c, k) in keys.iter().enumerate() {
            assert_eq!(t.key(c as ChunkId).as_slice(), k.as_slice());
            assert_eq!(t.find(k, hash_key(k)), Some(c as ChunkId));
            let want = if k.len() > INLINE_KEY {
                Probe::Unsure
            } else {
                Probe::Ready
            };
            assert_eq!(shared.probe(k, hash_key(k)), want);
        }
        // A long key differing only past the inline bytes is another key.
        let mut other = keys[50].clone();
        *other.last_mut().unwrap() ^= 1;
        assert_eq!(t.find(&other, hash_key(&keys[50])), None);
        assert_eq!(shared.lookup_prefix(&[&keys[0], &keys[1], b"zz"]), Some(2));
        assert_eq!(shared.lookup_prefix(&[&keys[0], &keys[60]]), None);
    }

    #[test]
    fn a_key_differing_in_any_one_byte_is_another_key() {
        let mut t = table(48);
        let keys: Vec<Vec<u8>> = (1..=48u8)
            .map(|n| (0..n).map(|i| i.wrapping_mul(7).wrapping_add(n)).collect())
            .collect();
        for (c, k) in keys.iter().enumerate() {
            put(&mut t, c as ChunkId, k);
        }
        for (c, k) in keys.iter().enumerate() {
            let c = c as ChunkId;
            assert!(t.holds_at(c, k));
            for at in 0..k.len() {
                for bit in [0x01u8, 0x80] {
                    let mut other = k.clone();
                    other[at] ^= bit;
                    assert!(!t.holds_at(c, &other), "len {} byte {at}", k.len());
                    // Found under the slot's own hash too: the bytes decide.
                    assert_eq!(t.find(&other, hash_key(k)), None);
                }
            }
            // One byte shorter or longer (the same leading bytes) is another key too.
            assert!(!t.holds_at(c, &k[..k.len() - 1]));
            let mut longer = k.clone();
            longer.push(0);
            assert!(!t.holds_at(c, &longer));
        }
    }

    #[test]
    fn releases_apply_on_drain_in_release_order() {
        let mut t = table(3);
        for c in 0..3 {
            put(&mut t, c, &[c as u8]);
            t.check_pin(c, 1).unwrap();
            assert!(t.pin(c));
        }
        t.pin(1);
        let shared = t.shared();
        let k = |c: u8| [c];
        assert_eq!(shared.release(&[&k(2), &k(0), &k(1)]), Release::Done);
        // 2 and 0 wait for the writer (still held as far as it knows); 1 keeps one pin.
        assert_eq!(
            (t.state(2), t.state(1), t.num_evictable()),
            (ChunkState::Ready(1), ChunkState::Ready(1), 0)
        );
        assert_eq!(shared.probe(&k(2), hash_key(&k(2))), Probe::Ready);
        let mut order = Vec::new();
        t.drain_releases(|c| order.push(c));
        assert_eq!(order, vec![2, 0]);
        assert_eq!((t.state(2), t.num_evictable()), (ChunkState::Ready(0), 2));
        t.validate().unwrap();
        // Nothing pinned: refused, nothing changed; a key listed twice needs two pins.
        assert_eq!(shared.release(&[&k(1), &k(0)]), Release::Unsure);
        assert_eq!(t.state(1), ChunkState::Ready(1));
        assert_eq!(shared.release(&[&k(1), &k(1)]), Release::Unsure);
        assert_eq!(t.state(1), ChunkState::Ready(1));
        assert_eq!(shared.release(&[b"absent"]), Release::Unsure);
        t.validate().unwrap();
    }

    #[test]
    fn a_pin_taken_back_before_the_drain_cancels_the_release() {
        let mut t = table(1);
        put(&mut t, 0, b"k");
        assert!(t.pin(0));
        let shared = t.shared();
        assert_eq!(shared.release(&[b"k"]), Release::Done);
        // The writer pins it again before applying: it was never evictable in between.
        assert!(!t.pin(0));
        let mut order = Vec::new();
        t.drain_releases(|c| order.push(c));
        assert!(order.is_empty());
        assert_eq!((t.state(0), t.num_evictable()), (ChunkState::Ready(1), 0));
        // Released and queued again while the first queue entry is gone: applied once.
        assert_eq!(shared.release(&[b"k"]), Release::Done);
        t.drain_releases(|c| order.push(c));
        assert_eq!(order, vec![0]);
        t.validate().unwrap();
    }

    #[test]
    fn unpin_all_is_all_or_nothing() {
        let mut t = table(2);
        put(&mut t, 0, b"a");
        put(&mut t, 1, b"b");
        t.pin(0);
        assert_eq!(t.unpin_all(&[0, 1]), Err(1));
        assert_eq!((t.state(0), t.num_evictable()), (ChunkState::Ready(1), 1));
        assert_eq!(t.unpin_all(&[0]).unwrap().to_vec(), [true]);
        assert_eq!(t.num_evictable(), 2);
        // A chunk past the slots holds no pin: refused, the pins before it given back.
        t.pin(0);
        assert_eq!(t.unpin_all(&[0, 7]), Err(1));
        assert_eq!(t.state(0), ChunkState::Ready(1));
        t.validate().unwrap();
    }

    #[test]
    fn unpin_all_answers_each_place_across_words() {
        // 150 places over 75 slots (each listed twice, two pins each, the second drop frees
        // a slot): places past 64 and past 128 (the answer's heap words) are told apart.
        let n = 75u32;
        let mut t = table(n);
        for c in 0..n {
            put(&mut t, c, &c.to_le_bytes());
            t.pin(c);
            t.pin(c);
        }
        let chunks: Vec<ChunkId> = (0..n).flat_map(|c| [c, c]).collect();
        let zero = t.unpin_all(&chunks).unwrap();
        let expected: Vec<bool> = (0..chunks.len()).map(|i| i % 2 == 1).collect();
        assert_eq!(zero.to_vec(), expected);
        let mut places = Vec::new();
        zero.each_place(|i| places.push(i));
        assert_eq!(
            places,
            (0..chunks.len()).filter(|i| i % 2 == 1).collect::<Vec<_>>()
        );
        assert!(!zero.get(chunks.len()));
        assert_eq!(t.num_evictable(), n as usize);
        t.validate().unwrap();
    }

    #[test]
    fn exclusive_pins_and_unpins_match_compare_and_swap() {
        // Two tables take the same pins, unpins and releases; one pins without
        // compare-and-swap whenever no release is due (as its owner would ask). Every
        // answer, state word and counter must agree (checked: it fails when an exclusive unpin
        // drops the sequence number).
        let (mut a, mut b) = (table(6), table(6));
        for c in 0..6 {
            put(&mut a, c, &[c as u8]);
            put(&mut b, c, &[c as u8]);
        }
        let (sa, sb) = (a.shared(), b.shared());
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n) as ChunkId
        };
        for step in 0..4_000 {
            let c = next(6);
            match next(4) {
                0 | 1 => {
                    b.set_exclusive(true);
                    if a.check_pin(c, 1).is_ok() {
                        assert_eq!(a.pin(c), b.pin(c), "pin {c} at step {step}");
                    }
                }
                2 => {
                    b.set_exclusive(true);
                    let chunks = [c, next(6)];
                    assert_eq!(a.unpin_all(&chunks), b.unpin_all(&chunks), "step {step}");
                }
                _ => {
                    // A release while nothing is asked, then the owner's drain.
                    b.set_exclusive(false);
                    let k = [c as u8];
                    assert_eq!(sa.release(&[&k]), sb.release(&[&k]), "step {step}");
                    let (mut da, mut db) = (Vec::new(), Vec::new());
                    a.drain_releases(|c| da.push(c));
                    b.drain_releases(|c| db.push(c));
                    assert_eq!(da, db);
                }
            }
            for c in 0..6 {
                assert_eq!(
                    a.table.slots[c].state.load(Ordering::Relaxed),
                    b.table.slots[c].state.load(Ordering::Relaxed),
                    "slot {c} at step {step}"
                );
            }
            assert_eq!(a.num_evictable(), b.num_evictable());
        }
        a.validate().unwrap();
        b.validate().unwrap();
        // While exclusive, a release backs off and changes nothing; after, it goes through.
        b.set_exclusive(false);
        let pinned = (0..6).find(|&c| b.check_pin(c, 1).is_ok()).unwrap();
        b.pin(pinned);
        let before = b.state(pinned);
        b.set_exclusive(true);
        let k = [pinned as u8];
        assert_eq!(sb.release(&[&k]), Release::Unsure);
        assert_eq!(b.state(pinned), before);
        b.set_exclusive(false);
        assert_eq!(sb.release(&[&k]), Release::Done);
    }

    #[test]
    fn clear_and_validate() {
        let mut t = table(8);
        for c in 0..8 {
            put(&mut t, c, &[c as u8; 3]);
        }
        let shared = t.shared();
        t.clear();
        assert!(t.is_empty());
        assert_eq!(shared.probe(&[1; 3], hash_key(&[1; 3])), Probe::Miss);
        t.validate().unwrap();
        put(&mut t, 5, b"again");
        t.validate().unwrap();
        // Drift is caught.
        t.num_evictable += 1;
        assert!(t.validate().is_err());
    }

    #[test]
    fn readers_on_other_threads_see_only_states_the_table_held() {
        // Keys 0..8 stay resident and ready throughout; keys 8..16 come and go through slots
        // 8..12, all in one bucket so chains are rebuilt under the readers.
        let mut t = table(12);
        let ks = colliding_keys(5, 16);
        for c in 0..8u32 {
            put(&mut t, c, &ks[c as usize]);
        }
        let shared = t.shared();
        let ks = &ks;
        let stop = std::sync::atomic::AtomicBool::new(false);
        // Under Miri (which checks every access of these threads for data races, at a few
        // thousand times the cost) a shorter run.
        let (reads, steps) = if cfg!(miri) {
            (20, 200)
        } else {
            (1000, 20_000u32)
        };
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) || n < reads {
                        for k in &ks[..8] {
                            assert_eq!(shared.probe(k, hash_key(k)), Probe::Ready);
                        }
                        let k = &ks[8 + (n % 8) as usize];
                        assert_ne!(shared.probe(k, hash_key(k)), Probe::Unsure);
                        n += 1;
                    }
                });
            }
            let mut held: Vec<Option<u32>> = vec![None; 4];
            for step in 0..steps {
                let slot = step % 4;
                if let Some(k) = held[slot as usize].take() {
                    let _ = k;
                    t.remove(8 + slot);
                } else {
                    let k = 8 + (step / 4) % 8;
                    let key = &ks[k as usize];
                    if t.find(key, hash_key(key)).is_none() {
                        put(&mut t, 8 + slot, key);
                        held[slot as usize] = Some(k);
                    }
                }
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        t.validate().unwrap();
    }

    /// The lock-free prefix count (what `lookup_prefix` answers while another thread holds the
    /// manager) counts HITs only: a pending key ends the prefix, as a missing one does.
    #[test]
    fn lock_free_prefix_stops_at_a_pending_key() {
        let mut t = table(4);
        let (a, b, c): (&[u8], &[u8], &[u8]) = (b"key-a", b"key-b", b"key-c");
        put(&mut t, 0, a);
        t.insert(1, b, hash_key(b)); // pending: its store has not completed
        put(&mut t, 2, c);
        let shared = t.shared();
        assert_eq!(shared.probe(b, hash_key(b)), Probe::Pending);
        assert_eq!(shared.lookup_prefix(&[a, b, c]), Some(1));
        assert_eq!(shared.lookup_prefix(&[b, a]), Some(0));
        assert_eq!(shared.lookup_prefix(&[a, c, b]), Some(2));
        assert_eq!(shared.lookup_prefix(&[a, c]), Some(2));
        // Past the first batch of 32 keys too.
        let mut t = table(40);
        let keys: Vec<Vec<u8>> = (0..40u8).map(|i| vec![b'k', i]).collect();
        for (i, k) in keys.iter().enumerate() {
            if i == 35 {
                t.insert(i as ChunkId, k, hash_key(k));
            } else {
                put(&mut t, i as ChunkId, k);
            }
        }
        let shared = t.shared();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        assert_eq!(shared.lookup_prefix(&refs), Some(35));
    }

    /// A lock-free release of one of two pins leaves one pin, which the writer sees and can add
    /// to: a further load and two more completions balance, and only the last one makes the
    /// chunk evictable.
    #[test]
    fn a_lock_free_release_of_one_of_two_pins_leaves_one() {
        let mut t = table(1);
        put(&mut t, 0, b"k");
        assert!(t.pin(0));
        assert!(!t.pin(0)); // two loads in flight
        let shared = t.shared();
        assert_eq!(shared.release(&[b"k"]), Release::Done);
        assert_eq!(t.state(0), ChunkState::Ready(1));
        assert!(!t.pin(0)); // a third load while the second is in flight
        assert_eq!(t.state(0), ChunkState::Ready(2));
        let mut order = Vec::new();
        t.drain_releases(|c| order.push(c));
        assert!(order.is_empty());
        assert_eq!(shared.release(&[b"k"]), Release::Done);
        assert_eq!(t.state(0), ChunkState::Ready(1));
        t.drain_releases(|c| order.push(c));
        assert!(
            order.is_empty(),
            "a chunk with a load in flight was made evictable"
        );
        assert_eq!(shared.release(&[b"k"]), Release::Done);
        t.drain_releases(|c| order.push(c));
        assert_eq!(order, vec![0]);
        assert_eq!((t.state(0), t.num_evictable()), (ChunkState::Ready(0), 1));
        t.validate().unwrap();
    }

    /// A lock-free release that meets a key it cannot release (absent, or longer than a slot
    /// holds inline) gives back the pins it already dropped: all or none, as `unpin_all`.
    #[test]
    fn a_lock_free_release_that_meets_an_absent_or_long_key_gives_back_its_pins() {
        let mut t = table(2);
        let long = [7u8; INLINE_KEY + 1];
        put(&mut t, 0, b"a");
        put(&mut t, 1, &long);
        for c in [0, 0, 1] {
            t.check_pin(c, 1).unwrap();
            t.pin(c);
        }
        let shared = t.shared();
        let (a, absent): (&[u8], &[u8]) = (b"a", b"absent");
        for keys in [[a, absent], [a, &long[..]], [a, a]] {
            // The last: "a" twice drops its two pins, then a third key would need the writer.
            let keys: Vec<&[u8]> = keys.iter().copied().chain([absent]).collect();
            assert_eq!(shared.release(&keys), Release::Unsure);
            assert_eq!(t.state(0), ChunkState::Ready(2));
        }
        let mut order = Vec::new();
        t.drain_releases(|c| order.push(c));
        assert!(order.is_empty());
        assert_eq!(
            t.unpin_all(&[0, 0, 1]).unwrap().to_vec(),
            [false, true, true]
        );
        assert_eq!(t.num_evictable(), 2);
        t.validate().unwrap();
    }
}
