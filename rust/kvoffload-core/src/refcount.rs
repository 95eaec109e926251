//! `RefCountTable`: the state of every chunk slot by its ref count.
//!
//! `-1` = pending (store in flight, unreadable), `0` = ready and evictable, `n > 0` = pinned by
//! `n` loads in flight. A slot with no key is absent. Every transition is checked, and the
//! table keeps the number of pending and evictable slots so the manager reads them in O(1).

use crate::error::{ensure, CoreError, Result};
use crate::pool::ChunkId;

const ABSENT: i32 = i32::MIN;
const PENDING: i32 = -1;

/// The state of one slot, as the manager sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkState {
    /// No key lives in the slot.
    Absent,
    /// A store is in flight; the data is not readable.
    Pending,
    /// Readable; `0` means evictable, `n > 0` means pinned by `n` loads.
    Ready(u32),
}

/// Ref counts of `num_chunks` slots plus the pending/evictable totals.
#[derive(Debug, Clone)]
pub struct RefCountTable {
    counts: Vec<i32>,
    num_pending: usize,
    num_evictable: usize,
}

impl RefCountTable {
    /// All `num_chunks` slots absent. Storage grows with the slots in use (see [`grow`](Self::grow)).
    #[must_use]
    pub fn new(num_chunks: u32) -> Self {
        let _ = num_chunks;
        Self {
            counts: Vec::new(),
            num_pending: 0,
            num_evictable: 0,
        }
    }

    /// Make room for slots `0..n` (new slots are absent).
    pub fn grow(&mut self, n: usize) {
        if n > self.counts.len() {
            self.counts.resize(n, ABSENT);
        }
    }

    /// State of slot `id`.
    #[inline]
    #[must_use]
    pub fn state(&self, id: ChunkId) -> ChunkState {
        match self.counts.get(id as usize).copied().unwrap_or(ABSENT) {
            ABSENT => ChunkState::Absent,
            PENDING => ChunkState::Pending,
            n => ChunkState::Ready(n as u32),
        }
    }

    /// Start loading the count of `id` into the cache; changes nothing.
    #[inline]
    pub fn prefetch(&self, id: ChunkId) {
        if let Some(x) = self.counts.get(id as usize) {
            crate::index::prefetch(x);
        }
    }

    /// Raw ref count of a present slot (`-1` pending, `n >= 0` ready).
    #[inline]
    #[must_use]
    pub fn raw(&self, id: ChunkId) -> i32 {
        self.counts.get(id as usize).copied().unwrap_or(ABSENT)
    }

    /// Slots with a store in flight.
    #[must_use]
    pub fn num_pending(&self) -> usize {
        self.num_pending
    }

    /// Ready slots with no load in flight.
    #[must_use]
    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }

    /// Whether `n` evictions can succeed when `protected_ready` of the evictable chunks are
    /// protected: policies are asked only for evictions that can (they assume it).
    #[must_use]
    pub fn can_evict(&self, n: usize, protected_ready: usize) -> bool {
        n <= self.num_evictable.saturating_sub(protected_ready)
    }

    /// absent -> pending (a store was prepared).
    pub fn insert_pending(&mut self, id: ChunkId) {
        debug_assert_eq!(self.counts[id as usize], ABSENT);
        self.counts[id as usize] = PENDING;
        self.num_pending += 1;
    }

    /// pending -> ready 0 (a store completed). Returns `false` and changes nothing otherwise.
    pub fn complete_store(&mut self, id: ChunkId) -> bool {
        if self.counts[id as usize] != PENDING {
            return false;
        }
        self.counts[id as usize] = 0;
        self.num_pending -= 1;
        self.num_evictable += 1;
        true
    }

    /// Check that `extra` more pins of slot `id` are legal.
    pub fn check_pin(&self, id: ChunkId, extra: u32) -> Result<()> {
        let n = self.raw(id);
        if n < 0 {
            return Err(CoreError::KeyState(format!("chunk {id} is not readable")));
        }
        if n.checked_add_unsigned(extra).is_none() {
            return Err(CoreError::Overflow(format!(
                "chunk {id} would be pinned by over 2^31 loads"
            )));
        }
        Ok(())
    }

    /// ready n -> n+1. Returns `true` on a 0 -> 1 transition (the slot stops being evictable).
    /// The caller has checked the pin with [`check_pin`](Self::check_pin).
    pub fn pin(&mut self, id: ChunkId) -> bool {
        let n = &mut self.counts[id as usize];
        debug_assert!(*n >= 0 && *n < i32::MAX);
        *n += 1;
        if *n == 1 {
            self.num_evictable -= 1;
            true
        } else {
            false
        }
    }

    /// ready n -> n-1 for `n > 0`. Returns `true` on a 1 -> 0 transition (evictable again).
    /// The caller has checked that the slot is pinned.
    pub fn unpin(&mut self, id: ChunkId) -> bool {
        let n = &mut self.counts[id as usize];
        debug_assert!(*n > 0);
        *n -= 1;
        if *n == 0 {
            self.num_evictable += 1;
            true
        } else {
            false
        }
    }

    /// pending or ready 0 -> absent (failed store or eviction).
    pub fn remove(&mut self, id: ChunkId) {
        match self.counts[id as usize] {
            PENDING => self.num_pending -= 1,
            0 => self.num_evictable -= 1,
            n => debug_assert!(false, "removing chunk {id} with ref count {n}"),
        }
        self.counts[id as usize] = ABSENT;
    }

    /// Every slot absent.
    pub fn clear(&mut self) {
        self.counts.clear();
        self.num_pending = 0;
        self.num_evictable = 0;
    }

    /// Check the totals against the counts.
    pub fn validate(&self) -> Result<()> {
        let pending = self.counts.iter().filter(|&&n| n == PENDING).count();
        let evictable = self.counts.iter().filter(|&&n| n == 0).count();
        ensure!(
            pending == self.num_pending,
            "refcount: {pending} pending, counter says {}",
            self.num_pending
        );
        ensure!(
            evictable == self.num_evictable,
            "refcount: {evictable} evictable, counter says {}",
            self.num_evictable
        );
        ensure!(
            self.counts.iter().all(|&n| n == ABSENT || n >= PENDING),
            "refcount: a count below -1"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle() {
        let mut t = RefCountTable::new(2);
        t.grow(2);
        assert_eq!(t.state(1), ChunkState::Absent);
        t.insert_pending(0);
        assert_eq!(t.state(0), ChunkState::Pending);
        assert!(t.check_pin(0, 1).is_err());
        assert!(t.complete_store(0));
        assert!(!t.complete_store(0));
        assert_eq!((t.num_pending(), t.num_evictable()), (0, 1));
        t.check_pin(0, 2).unwrap();
        assert!(t.pin(0));
        assert!(!t.pin(0));
        assert_eq!(t.state(0), ChunkState::Ready(2));
        assert_eq!(t.num_evictable(), 0);
        assert!(!t.unpin(0));
        assert!(t.unpin(0));
        assert_eq!(t.num_evictable(), 1);
        t.remove(0);
        assert_eq!(t.state(0), ChunkState::Absent);
        t.validate().unwrap();
    }

    #[test]
    fn failed_store_removal_and_overflow() {
        let mut t = RefCountTable::new(1);
        t.grow(1);
        t.insert_pending(0);
        t.remove(0);
        assert_eq!(t.num_pending(), 0);
        t.insert_pending(0);
        t.complete_store(0);
        t.counts[0] = i32::MAX - 1;
        t.num_evictable = 0;
        assert!(t.check_pin(0, 1).is_ok());
        assert!(matches!(t.check_pin(0, 2), Err(CoreError::Overflow(_))));
        t.validate().unwrap();
    }

    #[test]
    fn validate_catches_drift() {
        let mut t = RefCountTable::new(1);
        t.grow(1);
        t.insert_pending(0);
        t.num_pending = 0;
        assert!(t.validate().is_err());
    }
}
