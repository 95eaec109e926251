//! `FifoPolicy`: first in, first out.
//!
//! Chunks leave in the order they were inserted (stored); hits change nothing. Eviction takes
//! the oldest ready, unprotected chunks. A chunk that is pinned (or still pending) keeps its
//! place and is skipped: it leaves once it is ready again and everything older has gone. That
//! skip is the one deviation from textbook FIFO, and pinning forces it.
//!
//! The ready chunks live in an [`EvictionOrder`] keyed by insertion sequence, so a pin and its
//! release cost O(1) and eviction never walks past a pinned chunk twice.

use super::order::EvictionOrder;
use super::{Access, CachePolicy, PolicyState, RequestRank};
use crate::error::{ensure, Result};
use crate::pool::ChunkId;
use crate::table::Slots;

/// FIFO over chunk slots.
#[derive(Debug, Clone)]
pub struct FifoPolicy {
    resident: Vec<bool>,
    /// The ready chunks by insertion sequence. It also keeps every resident chunk's sequence
    /// (`last_key`), in the order or not: one copy.
    order: EvictionOrder<u64>,
    held: Vec<ChunkId>,
    next_seq: u64,
}

impl Default for FifoPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl FifoPolicy {
    /// An empty policy.
    #[must_use]
    pub fn new() -> Self {
        Self {
            resident: Vec::new(),
            order: EvictionOrder::new(),
            held: Vec::new(),
            next_seq: 0,
        }
    }
}

impl CachePolicy for FifoPolicy {
    fn grow(&mut self, n: usize) {
        if n > self.resident.len() {
            crate::mem::resize_huge(&mut self.resident, n, false);
            self.order.grow(n);
        }
    }

    fn insert(&mut self, chunk: ChunkId, _key: Access<'_>, _rank: &mut RequestRank) {
        self.next_seq += 1;
        self.resident[chunk as usize] = true;
        // Pending: out of the order until `mark_evictable`, which inserts it at this sequence.
        self.order.set_key(chunk, self.next_seq);
    }

    fn remove(&mut self, chunk: ChunkId) {
        self.order.remove(chunk);
        self.resident[chunk as usize] = false;
    }

    fn evict(
        &mut self,
        n: usize,
        protected: &dyn Fn(ChunkId) -> bool,
        _keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        let start = out.len();
        self.held.clear();
        out.extend(
            self.order
                .iter(&mut self.held)
                .map(|(_, c)| c)
                .filter(|&c| !protected(c))
                .take(n),
        );
        for &c in &self.held {
            self.order.remove(c);
        }
        if out.len() - start < n {
            out.truncate(start);
            return false;
        }
        for &c in &out[start..] {
            self.order.remove(c);
            self.resident[c as usize] = false;
        }
        true
    }

    fn clear(&mut self) {
        self.resident.clear();
        self.order.clear();
        self.held.clear();
        self.next_seq = 0;
    }

    fn mark_evictable(&mut self, chunk: ChunkId) {
        self.order.release_in_place(chunk);
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        self.order.hold(chunk);
    }

    fn prefetch(&self, chunk: ChunkId) {
        self.order.prefetch(chunk);
    }

    fn state(&self) -> PolicyState {
        let mut order: Vec<(u64, ChunkId)> = (0..self.resident.len())
            .filter(|&i| self.resident[i])
            .map(|i| (self.order.last_key(i as ChunkId), i as ChunkId))
            .collect();
        order.sort_unstable();
        PolicyState::Queue {
            queue: order.into_iter().map(|(_, c)| (c, false)).collect(),
            parked: Vec::new(),
            hand: None,
        }
    }

    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        ensure!(
            resident == self.resident.as_slice(),
            "fifo: resident set differs from the index"
        );
        self.order.validate()?;
        let mut ready = 0;
        for (i, &res) in resident.iter().enumerate() {
            let c = i as ChunkId;
            let ev = res && refs.raw(c) == 0;
            ensure!(
                self.order.contains(c) == ev,
                "fifo: chunk {i} evictable membership is wrong"
            );
            ensure!(
                !res || (1..=self.next_seq).contains(&self.order.last_key(c)),
                "fifo: chunk {i} sequence not yet issued"
            );
            ready += usize::from(ev);
        }
        ensure!(ready == self.order.len(), "fifo: order count drifted");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::test_util::keys;

    fn acc() -> Access<'static> {
        Access {
            key: b"",
            hash: 0,
            chunk: None,
            position: None,
        }
    }

    #[test]
    fn oldest_ready_first_and_pinned_keep_their_place() {
        let ks = keys(4);
        let mut p = FifoPolicy::new();
        p.grow(4);
        let mut r = None;
        for c in 0..4 {
            p.insert(c, acc(), &mut r);
            p.mark_evictable(c);
        }
        p.mark_non_evictable(0); // pinned: skipped, kept in place
        let mut out = Vec::new();
        assert!(p.evict(2, &|c| c == 2, &ks, &mut out));
        assert_eq!(out, vec![1, 3]);
        p.mark_evictable(0);
        out.clear();
        assert!(!p.evict(3, &|_| false, &ks, &mut out), "all-or-nothing");
        assert!(out.is_empty());
        assert!(p.evict(2, &|_| false, &ks, &mut out));
        assert_eq!(out, vec![0, 2]);
    }
}
