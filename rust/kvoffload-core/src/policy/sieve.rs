//! `SievePolicy`: SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI 2024), pin-aware.
//!
//! Chunks sit in one queue in insertion order, each with a *visited* bit. A hit sets the bit; a
//! hit is a touch of a resident key or a request's first access to one (`on_request_access`).
//! Eviction moves a hand from the oldest entry toward the newest, wrapping around: a visited
//! entry has its bit cleared and is passed, an unvisited one is evicted, and the hand stays where
//! the last victim was, for the next eviction. New chunks enter at the newest end.
//!
//! What pinning forces (the paper has no pinned objects):
//! - the hand passes a protected entry (one of the offer being stored) without clearing its bit;
//! - when the hand reaches an entry that is not ready (pinned by a load, or its store pending),
//!   the entry leaves the queue (it is *parked*), keeping its bit. When it becomes ready again it
//!   re-enters right behind the hand, the spot the hand had just passed, so it is examined last
//!   in the current sweep. This keeps eviction amortised O(1) whatever the number of pinned
//!   chunks: the hand never passes the same pinned entry twice.
//!
//! The manager only asks for an eviction it knows can succeed (enough ready, unprotected
//! chunks), so a sweep always ends: after one full turn every visited bit it met is clear.

use super::{Access, CachePolicy, PolicyState, RequestRank};
use crate::error::{ensure, Result};
use crate::pool::ChunkId;
use crate::table::Slots;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Where {
    #[default]
    Out,
    Queue,
    Parked,
}

/// SIEVE over chunk slots; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct SievePolicy {
    place: Vec<Where>,
    visited: Vec<bool>,
    ready: Vec<bool>,
    /// Queue links toward the newest (`newer`) and the oldest (`older`) end.
    newer: Vec<u32>,
    older: Vec<u32>,
    oldest: u32,
    newest: u32,
    /// The entry the hand examines next (`NIL`: start at the oldest).
    hand: u32,
    /// Per-chunk mark of the victims chosen by the current sweep.
    chosen: Vec<u64>,
    sweep: u64,
    /// The chunks whose bit a sweep cleared (kept, so that a sweep allocates nothing).
    cleared: Vec<ChunkId>,
}

impl SievePolicy {
    /// An empty policy.
    #[must_use]
    pub fn new() -> Self {
        Self {
            oldest: NIL,
            newest: NIL,
            hand: NIL,
            ..Self::default()
        }
    }

    /// Link `c` into the queue right before `next` (toward the oldest end); `NIL`: at the
    /// newest end.
    fn link_before(&mut self, c: ChunkId, next: u32) {
        let i = c as usize;
        let prev = if next == NIL {
            self.newest
        } else {
            self.older[next as usize]
        };
        self.older[i] = prev;
        self.newer[i] = next;
        if prev == NIL {
            self.oldest = c;
        } else {
            self.newer[prev as usize] = c;
        }
        if next == NIL {
            self.newest = c;
        } else {
            self.older[next as usize] = c;
        }
        self.place[i] = Where::Queue;
    }

    /// Take `c` out of the queue (the hand moves on if it pointed at `c`).
    fn unlink(&mut self, c: ChunkId) {
        let i = c as usize;
        let (prev, next) = (self.older[i], self.newer[i]);
        if self.hand == c {
            self.hand = next;
        }
        if prev == NIL {
            self.oldest = next;
        } else {
            self.newer[prev as usize] = next;
        }
        if next == NIL {
            self.newest = prev;
        } else {
            self.older[next as usize] = prev;
        }
        self.place[i] = Where::Out;
    }

    fn queue(&self) -> Vec<ChunkId> {
        let mut v = Vec::new();
        let mut c = self.oldest;
        while c != NIL && v.len() < self.place.len() {
            v.push(c);
            c = self.newer[c as usize];
        }
        v
    }
}

impl CachePolicy for SievePolicy {
    fn grow(&mut self, n: usize) {
        if n > self.place.len() {
            crate::mem::resize_huge(&mut self.place, n, Where::Out);
            crate::mem::resize_huge(&mut self.visited, n, false);
            crate::mem::resize_huge(&mut self.ready, n, false);
            crate::mem::resize_huge(&mut self.newer, n, NIL);
            crate::mem::resize_huge(&mut self.older, n, NIL);
            crate::mem::resize_huge(&mut self.chosen, n, 0);
        }
    }

    fn insert(&mut self, chunk: ChunkId, _key: Access<'_>, _rank: &mut RequestRank) {
        let i = chunk as usize;
        self.visited[i] = false;
        self.ready[i] = false;
        self.link_before(chunk, NIL);
    }

    fn remove(&mut self, chunk: ChunkId) {
        let i = chunk as usize;
        if self.place[i] == Where::Queue {
            self.unlink(chunk);
        }
        self.place[i] = Where::Out;
        self.ready[i] = false;
    }

    fn hit(&mut self, keys: &[Access<'_>]) {
        for a in keys {
            if let Some(c) = a.chunk {
                if self.place[c as usize] != Where::Out {
                    self.visited[c as usize] = true;
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
        let start = out.len();
        self.sweep += 1;
        let sweep = self.sweep;
        // Steps since the sweep last chose a victim or cleared a bit: a full turn of the queue
        // without either means no victim is left (the manager rules that out; this is a guard).
        let mut idle = 0usize;
        let mut cleared = std::mem::take(&mut self.cleared);
        cleared.clear();
        let saved_hand = self.hand;
        let mut cur = self.hand;
        while out.len() - start < n {
            if cur == NIL {
                cur = self.oldest;
                if cur == NIL {
                    break;
                }
            }
            let i = cur as usize;
            let next = self.newer[i];
            if !self.ready[i] {
                self.hand = next; // keep the hand valid while `cur` leaves
                self.unlink(cur);
                self.place[i] = Where::Parked;
            } else if self.chosen[i] == sweep || protected(cur) {
                idle += 1;
            } else if self.visited[i] {
                self.visited[i] = false;
                cleared.push(cur);
                idle = 0;
            } else {
                self.chosen[i] = sweep;
                out.push(cur);
                idle = 0;
            }
            cur = next;
            if idle > self.place.len() {
                break;
            }
        }
        if out.len() - start < n {
            for &c in &cleared {
                self.visited[c as usize] = true;
            }
            out.truncate(start);
            self.hand = saved_hand;
            if self.hand != NIL && self.place[self.hand as usize] != Where::Queue {
                self.hand = NIL;
            }
            self.cleared = cleared;
            return false;
        }
        self.cleared = cleared;
        self.hand = cur;
        for &c in &out[start..] {
            self.unlink(c);
            self.ready[c as usize] = false;
        }
        true
    }

    fn clear(&mut self) {
        *self = Self::new();
    }

    fn mark_evictable(&mut self, chunk: ChunkId) {
        let i = chunk as usize;
        self.ready[i] = true;
        if self.place[i] == Where::Parked {
            // Right behind the hand: the spot the sweep had just passed.
            self.link_before(chunk, self.hand);
        }
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        self.ready[chunk as usize] = false;
    }

    fn prefetch(&self, chunk: ChunkId) {
        if let Some(x) = self.place.get(chunk as usize) {
            crate::mem::prefetch(x);
        }
    }

    fn state(&self) -> PolicyState {
        let queue = self
            .queue()
            .into_iter()
            .map(|c| (c, self.visited[c as usize]))
            .collect();
        let parked = (0..self.place.len())
            .filter(|&i| self.place[i] == Where::Parked)
            .map(|i| (i as ChunkId, self.visited[i]))
            .collect();
        PolicyState::Queue {
            queue,
            parked,
            hand: (self.hand != NIL).then_some(self.hand),
        }
    }

    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        ensure!(
            resident.len() == self.place.len(),
            "sieve: per-chunk arrays differ in length"
        );
        let queue = self.queue();
        let mut prev = NIL;
        for &c in &queue {
            ensure!(
                self.place[c as usize] == Where::Queue && self.older[c as usize] == prev,
                "sieve: queue link broken at chunk {c}"
            );
            prev = c;
        }
        ensure!(
            prev == self.newest,
            "sieve: newest end is not the last entry"
        );
        let queued = self.place.iter().filter(|&&p| p == Where::Queue).count();
        ensure!(queued == queue.len(), "sieve: queue count drifted (cycle?)");
        ensure!(
            self.hand == NIL || self.place[self.hand as usize] == Where::Queue,
            "sieve: the hand points outside the queue"
        );
        for (i, &res) in resident.iter().enumerate() {
            let c = i as ChunkId;
            ensure!(
                res == (self.place[i] != Where::Out),
                "sieve: chunk {i} residency differs from the index"
            );
            ensure!(
                self.ready[i] == (res && refs.raw(c) == 0),
                "sieve: chunk {i} ready flag is wrong"
            );
            ensure!(
                self.place[i] != Where::Parked || !self.ready[i],
                "sieve: chunk {i} is ready but parked"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::test_util::{keys, TestKeys};

    fn acc(c: ChunkId) -> Access<'static> {
        Access {
            key: b"",
            hash: 0,
            chunk: Some(c),
            position: None,
        }
    }

    fn filled(n: u32) -> SievePolicy {
        let mut p = SievePolicy::new();
        p.grow(n as usize);
        let mut r = None;
        for c in 0..n {
            p.insert(c, acc(c), &mut r);
            p.mark_evictable(c);
        }
        p
    }

    fn evict(p: &mut SievePolicy, n: usize, ks: &TestKeys) -> Vec<ChunkId> {
        let mut out = Vec::new();
        assert!(p.evict(n, &|_| false, ks, &mut out));
        out
    }

    #[test]
    fn visited_entries_survive_one_pass_and_the_hand_stays() {
        let ks = keys(5);
        let mut p = filled(5);
        p.touch(&[acc(0), acc(2)], &Slots::new(5).unwrap());
        // The hand clears 0, evicts 1, clears 2, evicts 3; it then points at 4.
        assert_eq!(evict(&mut p, 2, &ks), vec![1, 3]);
        let PolicyState::Queue { hand, queue, .. } = p.state() else {
            panic!()
        };
        assert_eq!(
            (hand, queue),
            (Some(4), vec![(0, false), (2, false), (4, false)])
        );
        // 4 goes, then the hand wraps to 0 (its bit already cleared).
        assert_eq!(evict(&mut p, 2, &ks), vec![4, 0]);
    }

    #[test]
    fn pinned_entries_are_parked_and_return_behind_the_hand() {
        let ks = keys(4);
        let mut p = filled(4);
        p.mark_non_evictable(0);
        assert_eq!(evict(&mut p, 1, &ks), vec![1]); // 0 parked on the way
        let PolicyState::Queue { parked, hand, .. } = p.state() else {
            panic!()
        };
        assert_eq!((parked, hand), (vec![(0, false)], Some(2)));
        p.mark_evictable(0); // back right behind the hand: examined last
        let PolicyState::Queue { queue, .. } = p.state() else {
            panic!()
        };
        assert_eq!(queue, vec![(0, false), (2, false), (3, false)]);
        assert_eq!(evict(&mut p, 3, &ks), vec![2, 3, 0]);
    }
}
