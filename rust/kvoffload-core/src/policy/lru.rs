//! `LruPolicy`: request-ranked recency.
//!
//! Every resident chunk has a rank `(major, minor)`; eviction takes evictable, unprotected
//! chunks in ascending `(rank, key bytes)` order. A counter issues fresh ranks `(k, 0)`, from 0 up. A
//! request takes one rank `k` from the same counter at its first access, and its chunks with a
//! known token position `p` rank `(k, -p)`: tails before heads of the same request. (`-p`
//! saturates: `i64::MIN`, which the manager refuses, ranks as `i64::MIN + 1` does.)
//!
//! The evictable chunks live in an [`EvictionOrder`] keyed by `(major, minor)`: fresh ranks
//! append in O(1), older ranks (a chunk evictable again, a token position) take a B-tree insert.
//! Eviction starts at the least recent evictable chunk and never walks past pinned or pending
//! ones.
//! Chunks sharing a rank (equal positions in different KV groups) are ordered by key bytes
//! when they are evicted.

use super::order::EvictionOrder;
use super::{Access, CachePolicy, FinishedKey, PolicyState, RequestRank};
use crate::error::{ensure, Result};
use crate::pool::ChunkId;
use crate::table::Slots;

type Rank = (u64, i64);

/// Request-ranked LRU over `capacity` chunk slots.
#[derive(Debug, Clone)]
pub struct LruPolicy {
    resident: Vec<bool>,
    /// The evictable chunks by rank (pinned and pending ones held in place). It also keeps
    /// every resident chunk's rank (`last_key`), member or not: one copy, one cache line.
    order: EvictionOrder<Rank>,
    /// Held entries an eviction scan walked past, detached when it ends.
    held: Vec<ChunkId>,
    /// The next rank the counter issues.
    next_rank: u64,
}

impl LruPolicy {
    /// An empty policy for `capacity` chunk slots.
    #[must_use]
    pub fn new(capacity: u32) -> Self {
        let _ = capacity;
        Self {
            resident: Vec::new(),
            order: EvictionOrder::new(),
            held: Vec::new(),
            next_rank: 0,
        }
    }

    fn fresh_rank(&mut self) -> Rank {
        self.next_rank += 1;
        (self.next_rank - 1, 0)
    }

    fn request_rank(&mut self, slot: &mut RequestRank) -> u64 {
        *slot.get_or_insert_with(|| {
            self.next_rank += 1;
            self.next_rank - 1
        })
    }

    fn set_rank(&mut self, chunk: ChunkId, rank: Rank) {
        if self.order.contains(chunk) {
            self.order.remove(chunk);
            self.order.insert(chunk, rank);
        } else if self.order.held_key_of(chunk).is_some() {
            // A pinned or pending chunk held at its old rank: held at the new one, so its
            // release is O(1).
            self.order.remove(chunk);
            self.order.insert_held(chunk, rank);
        } else {
            // Detached by a scan (pinned or pending): `mark_evictable` inserts it.
            self.order.set_key(chunk, rank);
        }
    }

    /// Give `chunk` a fresh rank, above every other: straight to the order's tail when it is in
    /// the order (as [`set_rank`](Self::set_rank) would put it, in fewer steps).
    fn refresh(&mut self, chunk: ChunkId) {
        let rank = self.fresh_rank();
        if !self.order.move_to_tail(chunk, rank) {
            // Detached by a scan (pinned or pending): `mark_evictable` inserts it.
            self.order.set_key(chunk, rank);
        }
    }
}

impl CachePolicy for LruPolicy {
    fn grow(&mut self, n: usize) {
        if n > self.resident.len() {
            crate::mem::resize_huge(&mut self.resident, n, false);
            self.order.grow(n);
        }
    }

    fn insert(&mut self, chunk: ChunkId, key: Access<'_>, rank: &mut RequestRank) {
        self.resident[chunk as usize] = true;
        // Pending: held at its rank (a batch's chunks side by side), released there in O(1).
        if let Some(p) = key.position {
            let r = (self.request_rank(rank), p.saturating_neg());
            self.order.insert_held(chunk, r);
        } else {
            // A fresh rank sorts last: straight to the tail.
            let r = self.fresh_rank();
            self.order.push_last(chunk, r, true);
        }
    }

    fn remove(&mut self, chunk: ChunkId) {
        self.order.remove(chunk);
        self.resident[chunk as usize] = false;
    }

    fn touch(&mut self, keys: &[Access<'_>], _refs: &Slots) {
        for a in keys {
            if let Some(c) = a.chunk {
                self.order.prefetch_neighbours(c);
            }
        }
        for a in keys.iter().rev() {
            if let Some(c) = a.chunk {
                self.refresh(c);
            }
        }
    }

    fn on_store_miss(&mut self, _keys: &[Access<'_>]) {}

    fn reads_store_misses(&self) -> bool {
        false
    }

    fn prefetch(&self, chunk: ChunkId) {
        self.order.prefetch(chunk);
    }

    /// Only keys with a position are re-ranked (the request rank is taken either way).
    fn reads_access_keys(&self, positions: bool) -> bool {
        positions
    }

    fn on_request_access(&mut self, keys: &[Access<'_>], rank: &mut RequestRank) {
        let request_rank = self.request_rank(rank);
        for a in keys {
            let (Some(c), Some(p)) = (a.chunk, a.position) else {
                continue;
            };
            let r = (request_rank, p.saturating_neg());
            if self.order.last_key(c) < r {
                self.set_rank(c, r);
            }
        }
    }

    fn on_request_finished(&mut self, keys: &[FinishedKey<'_>]) {
        for k in keys.iter().rev() {
            if let Some(c) = k.chunk {
                self.refresh(c);
            }
        }
    }

    fn evict(
        &mut self,
        n: usize,
        protected: &dyn Fn(ChunkId) -> bool,
        keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        let start = out.len();
        self.held.clear();
        let mut it = self.order.iter(&mut self.held).peekable();
        let mut run: Vec<ChunkId> = Vec::new();
        'outer: while out.len() - start < n {
            let Some((rank, c)) = it.next() else { break };
            if it.peek().is_some_and(|&(r2, _)| r2 == rank) {
                // Chunks sharing a rank leave in key-byte order.
                run.clear();
                run.push(c);
                while let Some(&(r2, c2)) = it.peek() {
                    if r2 != rank {
                        break;
                    }
                    run.push(c2);
                    it.next();
                }
                run.sort_by_cached_key(|&x| keys.key(x));
                for &c in &run {
                    if !protected(c) {
                        out.push(c);
                        if out.len() - start == n {
                            break 'outer;
                        }
                    }
                }
            } else if !protected(c) {
                out.push(c);
            }
        }
        drop(it);
        for &c in &self.held {
            self.order.remove(c);
        }
        if out.len() - start < n {
            out.truncate(start);
            return false;
        }
        self.order.remove_all(&out[start..]);
        for &c in &out[start..] {
            self.resident[c as usize] = false;
        }
        true
    }

    fn clear(&mut self) {
        self.resident.clear();
        self.order.clear();
        self.held.clear();
        self.next_rank = 0;
    }

    fn mark_evictable(&mut self, chunk: ChunkId) {
        debug_assert!(self.resident[chunk as usize] && !self.order.contains(chunk));
        self.order.release_in_place(chunk);
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        debug_assert!(self.order.contains(chunk));
        self.order.hold(chunk);
    }

    fn state(&self) -> PolicyState {
        let ranks = (0..self.resident.len())
            .filter(|&i| self.resident[i])
            .map(|i| (i as ChunkId, self.order.last_key(i as ChunkId)))
            .collect();
        PolicyState::Lru {
            ranks,
            next_rank: self.next_rank,
        }
    }

    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        ensure!(
            resident == self.resident.as_slice(),
            "lru: resident set differs from the index"
        );
        self.order.validate()?;
        // Ranks live in the order alone (`last_key`), so a member's key is its rank by
        // construction.
        let mut n = 0;
        for (i, &res) in self.resident.iter().enumerate() {
            let c = i as ChunkId;
            let ev = res && refs.raw(c) == 0;
            ensure!(
                self.order.contains(c) == ev,
                "lru: chunk {i} evictable membership is wrong"
            );
            n += usize::from(ev);
            ensure!(
                !res || self.order.last_key(c).0 < self.next_rank,
                "lru: chunk {i} rank not yet issued"
            );
            ensure!(
                self.order.held_key_of(c).is_none() || (res && refs.raw(c) != 0),
                "lru: chunk {i} held in the order but not pinned or pending"
            );
        }
        ensure!(
            n == self.order.len(),
            "lru: order holds {} entries for {n} evictable",
            self.order.len()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::test_util::{keys, keys_of};

    fn ready(p: &mut LruPolicy, c: ChunkId, pos: Option<i64>, rank: &mut RequestRank) {
        p.grow(c as usize + 1);
        p.insert(
            c,
            Access {
                key: b"",
                hash: 0,
                chunk: None,
                position: pos,
            },
            rank,
        );
        p.mark_evictable(c);
    }

    fn evict(p: &mut LruPolicy, n: usize, keys: &Slots, prot: &[ChunkId]) -> Option<Vec<ChunkId>> {
        let mut out = Vec::new();
        p.evict(n, &|c| prot.contains(&c), keys, &mut out)
            .then_some(out)
    }

    #[test]
    fn evicts_least_recent_first_and_touch_refreshes() {
        let ks = keys(3);
        let mut p = LruPolicy::new(3);
        let mut r = None;
        for c in 0..3 {
            ready(&mut p, c, None, &mut r);
        }
        let acc = |c: ChunkId| Access {
            key: b"",
            hash: 0,
            chunk: Some(c),
            position: None,
        };
        p.touch(&[acc(0), acc(1)], &Slots::new(3).unwrap());
        // touch gives 1 then 0 fresh ranks: 0 is most recent.
        assert_eq!(evict(&mut p, 3, &ks, &[]), Some(vec![2, 1, 0]));
    }

    #[test]
    fn positions_rank_tails_first_within_request() {
        let ks = keys(4);
        let mut p = LruPolicy::new(4);
        let mut r = None;
        ready(&mut p, 0, Some(16), &mut r);
        ready(&mut p, 1, Some(32), &mut r);
        let mut other = None;
        ready(&mut p, 2, None, &mut other);
        // Chunks 0 and 1 rank (0, -16) and (0, -32): older than chunk 2's fresh (1, 0).
        assert_eq!(evict(&mut p, 3, &ks, &[]), Some(vec![1, 0, 2]));
    }

    #[test]
    fn equal_ranks_leave_in_key_order_and_protection_holds() {
        let ks = keys_of(&[b"b", b"a", b"c"]);
        let mut p = LruPolicy::new(3);
        let mut r = None;
        for c in 0..3 {
            ready(&mut p, c, Some(8), &mut r);
        }
        assert_eq!(evict(&mut p, 2, &ks, &[1]), Some(vec![0, 2]));
        assert_eq!(evict(&mut p, 2, &ks, &[]), None, "all-or-nothing");
        assert_eq!(evict(&mut p, 1, &ks, &[]), Some(vec![1]));
    }

    #[test]
    fn request_access_only_raises_ranks() {
        let mut p = LruPolicy::new(2);
        let mut r = None;
        ready(&mut p, 0, None, &mut r);
        let mut req = None;
        p.on_request_access(
            &[Access {
                key: b"",
                hash: 0,
                chunk: Some(0),
                position: Some(4),
            }],
            &mut req,
        );
        // The request's rank (1) is newer than chunk 0's (0, 0): raised to (1, -4).
        assert_eq!(p.order.last_key(0), (1, -4));
        let PolicyState::Lru { next_rank, .. } = p.state() else {
            panic!()
        };
        assert_eq!(next_rank, 2);
        p.validate(&[true], &{
            let mut t = Slots::new(2).unwrap();
            t.grow(1);
            crate::key::test_util::pend(&mut t, 0);
            t.complete_store(0);
            t
        })
        .unwrap();
    }

    #[test]
    fn the_lowest_position_ranks_without_overflow() {
        // `-i64::MIN` is no i64: the rank saturates (the manager refuses that position anyway).
        let ks = keys(3);
        let mut p = LruPolicy::new(3);
        let mut r = None;
        ready(&mut p, 0, Some(i64::MIN), &mut r);
        ready(&mut p, 1, Some(i64::MAX), &mut r);
        assert_eq!(p.order.last_key(0), (0, i64::MAX));
        let at = |c: ChunkId| Access {
            key: b"",
            hash: 0,
            chunk: Some(c),
            position: Some(i64::MIN),
        };
        let mut later = None;
        p.on_request_access(&[at(0), at(1)], &mut later);
        assert_eq!(p.order.last_key(1), (1, i64::MAX));
        assert_eq!(evict(&mut p, 2, &ks, &[]), Some(vec![0, 1]));
    }
}
