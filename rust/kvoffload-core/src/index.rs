//! `KeyIndex`: resident key -> chunk id, an open-addressing table built for batches.
//!
//! The key bytes live in the manager's per-chunk slots; the table holds one `u64` per entry:
//! the low 32 bits of the key's hash (its tag) above the chunk id. An entry's home bucket is its
//! tag masked to the table size, so entries can be moved without the keys. Linear probing with
//! backward-shift deletion keeps it free of tombstones; the load factor stays at or below 3/4,
//! and eight entries share a cache line, so a probe rarely leaves one line.
//!
//! Why not `hashbrown`: a batch call resolves up to a few dozen keys, and at 10^5 chunks and
//! beyond each resolution is a cache miss on the table and another on the chunk's key. Here the
//! caller can [`prefetch`](KeyIndex::prefetch) every key's bucket first, then every candidate
//! chunk, so the misses of a batch overlap instead of queueing one after another.

use crate::pool::ChunkId;

/// An empty bucket (no chunk id reaches `u32::MAX`: pools hold at most 2^31 - 1 chunks).
const EMPTY: u64 = u64::MAX;
/// The smallest table (buckets).
const MIN_BUCKETS: usize = 16;

fn entry(hash: u64, chunk: ChunkId) -> u64 {
    ((hash & 0xffff_ffff) << 32) | u64::from(chunk)
}

fn chunk_of(e: u64) -> ChunkId {
    e as u32
}

fn tag_of(e: u64) -> u32 {
    (e >> 32) as u32
}

/// Key -> chunk map; see the module docs. Keys are compared through a caller's closure.
#[derive(Debug, Clone)]
pub struct KeyIndex {
    table: Vec<u64>,
    mask: usize,
    len: usize,
}

impl Default for KeyIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyIndex {
    /// An empty index.
    #[must_use]
    pub fn new() -> Self {
        Self {
            table: vec![EMPTY; MIN_BUCKETS],
            mask: MIN_BUCKETS - 1,
            len: 0,
        }
    }

    /// Number of keys.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the index is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget every key (the table keeps its size).
    pub fn clear(&mut self) {
        self.table.fill(EMPTY);
        self.len = 0;
    }

    fn home(&self, hash: u64) -> usize {
        (hash as u32 as usize) & self.mask
    }

    /// Start loading the bucket of `hash` into the cache; changes nothing.
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        prefetch(&self.table[self.home(hash)]);
    }

    /// The first chunk whose tag matches `hash`, without comparing keys: a guess to prefetch.
    #[inline]
    #[must_use]
    pub fn candidate(&self, hash: u64) -> Option<ChunkId> {
        let tag = hash as u32;
        let mut i = self.home(hash);
        loop {
            let e = self.table[i];
            if e == EMPTY {
                return None;
            }
            if tag_of(e) == tag {
                return Some(chunk_of(e));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The chunk of the key hashing to `hash` for which `is_key(chunk)` holds.
    #[inline]
    pub fn find(&self, hash: u64, mut is_key: impl FnMut(ChunkId) -> bool) -> Option<ChunkId> {
        let tag = hash as u32;
        let mut i = self.home(hash);
        loop {
            let e = self.table[i];
            if e == EMPTY {
                return None;
            }
            if tag_of(e) == tag && is_key(chunk_of(e)) {
                return Some(chunk_of(e));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Add `chunk` under `hash`; its key must not be in the index.
    pub fn insert(&mut self, hash: u64, chunk: ChunkId) {
        if (self.len + 1) * 4 > self.table.len() * 3 {
            self.resize(self.table.len() * 2);
        }
        let mut i = self.home(hash);
        while self.table[i] != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.table[i] = entry(hash, chunk);
        self.len += 1;
    }

    /// Remove `chunk`, indexed under `hash`; `false` if it is not there.
    pub fn remove(&mut self, hash: u64, chunk: ChunkId) -> bool {
        let e = entry(hash, chunk);
        let mut i = self.home(hash);
        loop {
            match self.table[i] {
                EMPTY => return false,
                x if x == e => break,
                _ => i = (i + 1) & self.mask,
            }
        }
        // Backward shift: pull later entries of the run into the hole when their home allows.
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let x = self.table[j];
            if x == EMPTY {
                break;
            }
            let x_home = (tag_of(x) as usize) & self.mask;
            // `x` may fill the hole unless its home lies cyclically in (hole, j].
            let home_after_hole = if hole <= j {
                hole < x_home && x_home <= j
            } else {
                hole < x_home || x_home <= j
            };
            if !home_after_hole {
                self.table[hole] = x;
                hole = j;
            }
        }
        self.table[hole] = EMPTY;
        self.len -= 1;
        true
    }

    fn resize(&mut self, buckets: usize) {
        let old = std::mem::replace(&mut self.table, vec![EMPTY; buckets]);
        self.mask = buckets - 1;
        for e in old.into_iter().filter(|&e| e != EMPTY) {
            let mut i = (tag_of(e) as usize) & self.mask;
            while self.table[i] != EMPTY {
                i = (i + 1) & self.mask;
            }
            self.table[i] = e;
        }
    }

    /// Every `(tag, chunk)` in the index.
    pub fn entries(&self) -> impl Iterator<Item = (u32, ChunkId)> + '_ {
        self.table
            .iter()
            .filter(|&&e| e != EMPTY)
            .map(|&e| (tag_of(e), chunk_of(e)))
    }

    /// Check the count, the load factor and that every entry is reachable from its home.
    pub fn validate(&self) -> crate::Result<()> {
        use crate::error::ensure;
        ensure!(
            self.table.len().is_power_of_two() && self.mask == self.table.len() - 1,
            "index: table size is not a power of two"
        );
        let n = self.table.iter().filter(|&&e| e != EMPTY).count();
        ensure!(n == self.len, "index: {n} entries, count says {}", self.len);
        ensure!(
            self.len * 4 <= self.table.len() * 3,
            "index: over its load factor"
        );
        for (i, &e) in self.table.iter().enumerate() {
            if e == EMPTY {
                continue;
            }
            // No empty bucket between the entry's home and its bucket.
            let mut k = (tag_of(e) as usize) & self.mask;
            while k != i {
                ensure!(
                    self.table[k] != EMPTY,
                    "index: chunk {} unreachable from its home bucket",
                    chunk_of(e)
                );
                k = (k + 1) & self.mask;
            }
        }
        Ok(())
    }
}

/// Hint the CPU to bring `x`'s cache line in; a no-op where there is no prefetch instruction.
#[inline]
pub fn prefetch<T>(x: &T) {
    prefetch_addr(std::ptr::from_ref(x).cast());
}

/// Hint the CPU to bring the cache line of address `p` in. Any address is fine: a prefetch
/// never faults and never reads memory into the program, so `p` need not be valid.
#[inline]
pub fn prefetch_addr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch only hints the cache: it never faults, whatever the address, and
        // SSE (which provides the instruction) is part of the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A hash whose home bucket is chosen, to force collisions and wrap-around.
    fn h(home: u64, salt: u64) -> u64 {
        (salt << 40) | home
    }

    #[test]
    fn collisions_wraparound_and_backward_shift() {
        let mut ix = KeyIndex::new();
        // Five keys homed at bucket 14 of 16: the run wraps to 0, 1, 2.
        for c in 0..5 {
            ix.insert(h(14, c.into()), c);
        }
        ix.insert(h(0, 9), 9); // homed at 0, pushed past the wrapped run
        ix.validate().unwrap();
        for c in 0..5 {
            assert_eq!(ix.find(h(14, c.into()), |x| x == c), Some(c));
        }
        assert!(ix.remove(h(14, 1), 1));
        assert!(!ix.remove(h(14, 1), 1));
        ix.validate().unwrap();
        assert_eq!(ix.find(h(0, 9), |x| x == 9), Some(9));
        assert_eq!(ix.find(h(14, 1), |x| x == 1), None);
        assert_eq!(ix.candidate(h(0, 9)), Some(9));
        assert_eq!(ix.len(), 5);
    }

    #[test]
    fn random_ops_agree_with_a_hashmap() {
        let mut ix = KeyIndex::new();
        let mut model: HashMap<u64, ChunkId> = HashMap::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct low bits: long runs and many tag collisions.
            let hash = (x % 512) | ((x >> 9) % 3) << 32;
            if let Some(&c) = model.get(&hash) {
                if x % 3 == 0 {
                    assert!(ix.remove(hash, c));
                    model.remove(&hash);
                }
            } else if model.len() < 300 {
                ix.insert(hash, step);
                model.insert(hash, step);
            }
            if step % 997 == 0 {
                ix.validate().unwrap();
            }
        }
        ix.validate().unwrap();
        for (&hash, &c) in &model {
            assert_eq!(ix.find(hash, |y| y == c), Some(c));
        }
        assert_eq!(ix.len(), model.len());
        ix.clear();
        assert!(ix.is_empty());
        ix.validate().unwrap();
    }
}
