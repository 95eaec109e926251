//! `LfuPolicy`: least frequently used with aging (LFU-Aging, Arlitt, Cherkasova, Dilley,
//! Friedrich and Jin, "Evaluating content management techniques for Web proxy caches", 2000),
//! pin-aware, O(1) amortised.
//!
//! Each resident chunk has a reference count from 1 (its store) to 15 (the cap, `M_refs`),
//! raised by a hit (a touch of a resident key, or a request's first access to one). Eviction
//! takes the chunk with the lowest count, the one that reached that count first among equals.
//! Aging: when the average count over the resident chunks exceeds 4 (`A_max`), every count is
//! halved (rounding down, so a count can reach 0), which lets once-popular chunks leave.
//!
//! One FIFO queue per count (16 of them) makes a hit and an eviction O(1); halving rebuilds the
//! queues in O(n), after at least n/2 hits since the last halving, so O(1) amortised per hit.
//! Halving keeps order: queues are emptied from the lowest count up and each chunk goes to the
//! newest end of its new queue. Pinning, as for every queue-based policy (see [`Queues`]): a chunk
//! not ready when an eviction scan reaches it is parked and re-enters at its queue's oldest end
//! once ready; a protected chunk (of the offer being stored) is passed over.

use super::queues::Queues;
use super::{Access, CachePolicy, PolicyState, RequestRank};
use crate::error::{ensure, Result};
use crate::pool::ChunkId;
use crate::table::Slots;

/// The highest count (`M_refs`).
const MAX_COUNT: usize = 15;
/// Halve every count when the average count exceeds this (`A_max`).
const MAX_AVERAGE: usize = 4;
/// Queue names, by count.
const NAMES: [&str; MAX_COUNT + 1] = [
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15",
];

/// LFU with aging over chunk slots; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct LfuPolicy {
    /// Queue `k` holds the chunks whose count is `k`.
    queues: Queues<{ MAX_COUNT + 1 }>,
    /// Sum of the counts of the resident chunks.
    total: usize,
    resident: usize,
    /// A queue's chunks while aging moves them (kept, so that aging allocates nothing).
    scratch: Vec<ChunkId>,
}

impl LfuPolicy {
    /// An empty policy.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn count(&self, c: ChunkId) -> usize {
        self.queues.queue_of(c).unwrap_or(0)
    }

    /// Halve every count, keeping each queue's order (see the module docs).
    fn age(&mut self) {
        // Lowest count first: each queue's chunks join the newest end of a queue already done.
        let mut chunks = std::mem::take(&mut self.scratch);
        for n in 1..=MAX_COUNT {
            self.queues.linked_into(n, &mut chunks);
            for &c in &chunks {
                self.queues.move_to(c, n / 2, true);
            }
        }
        self.scratch = chunks;
        // Parked chunks have no order to keep.
        self.queues.retarget_parked_all(|n| n / 2);
        self.total = (0..=MAX_COUNT).map(|n| n * self.queues.len(n)).sum();
    }

    fn entries(lists: impl Fn(usize) -> Vec<ChunkId>) -> Vec<Vec<(ChunkId, u8)>> {
        (0..=MAX_COUNT)
            .map(|n| lists(n).into_iter().map(|c| (c, n as u8)).collect())
            .collect()
    }
}

impl CachePolicy for LfuPolicy {
    fn grow(&mut self, n: usize) {
        self.queues.grow(n);
    }

    fn insert(&mut self, chunk: ChunkId, _key: Access<'_>, _rank: &mut RequestRank) {
        self.queues.insert(chunk, 1);
        self.total += 1;
        self.resident += 1;
    }

    fn remove(&mut self, chunk: ChunkId) {
        self.total -= self.count(chunk);
        self.resident -= 1;
        self.queues.remove(chunk);
    }

    fn hit(&mut self, keys: &[Access<'_>]) {
        for a in keys {
            let Some(c) = a.chunk.filter(|&c| self.queues.queue_of(c).is_some()) else {
                continue;
            };
            let n = self.count(c);
            if n < MAX_COUNT {
                self.queues.move_to(c, n + 1, true);
                self.total += 1;
                if self.total > MAX_AVERAGE * self.resident {
                    self.age();
                }
            }
        }
    }

    fn evict(
        &mut self,
        n: usize,
        protected: &dyn Fn(ChunkId) -> bool,
        _keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        for _ in 0..n {
            let found = (0..=MAX_COUNT).find_map(|q| self.queues.first_candidate(q, protected));
            let Some(c) = found else {
                // The manager asks only for evictions that can succeed; this is a guard.
                debug_assert!(false, "lfu: no victim left");
                return false;
            };
            self.remove(c);
            out.push(c);
        }
        true
    }

    fn clear(&mut self) {
        let scratch = std::mem::take(&mut self.scratch);
        *self = Self {
            scratch,
            ..Self::new()
        };
    }

    fn mark_evictable(&mut self, chunk: ChunkId) {
        self.queues.set_ready(chunk, true);
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        self.queues.set_ready(chunk, false);
    }

    fn state(&self) -> PolicyState {
        PolicyState::Queues {
            names: &NAMES,
            linked: Self::entries(|n| self.queues.linked(n)),
            parked: Self::entries(|n| self.queues.parked(n)),
            ghosts: Vec::new(),
        }
    }

    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        self.queues.validate(resident, |c| refs.raw(c) == 0)?;
        let n = resident.iter().filter(|&&r| r).count();
        let total: usize = (0..=MAX_COUNT).map(|k| k * self.queues.len(k)).sum();
        ensure!(
            n == self.resident && total == self.total,
            "lfu: resident count or count total drifted"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acc(c: ChunkId) -> Access<'static> {
        Access {
            key: b"",
            hash: 0,
            chunk: Some(c),
            position: None,
        }
    }

    #[test]
    fn least_frequent_first_and_aging_halves_counts() {
        let mut p = LfuPolicy::new();
        p.grow(3);
        for c in 0..3 {
            p.insert(c, acc(c), &mut None);
            p.mark_evictable(c);
        }
        let refs = Slots::new(3).unwrap();
        p.touch(&[acc(0), acc(0), acc(2)], &refs); // counts 3, 1, 2
        let mut out = Vec::new();
        assert!(p.evict(1, &|_| false, &crate::key::test_util::keys(0), &mut out));
        assert_eq!(out, vec![1]);
        // Total 5 over 2 chunks; 4 more hits on 2 push the average past 4: halve to 1 and 3.
        p.touch(&[acc(2), acc(2), acc(2), acc(2)], &refs);
        let PolicyState::Queues { linked, .. } = p.state() else {
            panic!()
        };
        assert_eq!(
            (linked[1].clone(), linked[3].clone()),
            (vec![(0, 1)], vec![(2, 3)])
        );
        out.clear();
        assert!(p.evict(1, &|_| false, &crate::key::test_util::keys(0), &mut out));
        assert_eq!(out, vec![0]);
    }
}
