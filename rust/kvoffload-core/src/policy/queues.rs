//! `Queues`: a few FIFO/LRU queues of chunks threaded through shared per-chunk links, with
//! pin-aware *parking*, for the queue-based policies (S3-FIFO, 2Q, SLRU).
//!
//! Every resident chunk belongs to one queue. It is either linked in that queue or *parked*:
//! taken out because an eviction scan reached it while it was not ready (pinned or pending).
//! A parked chunk still counts in its queue's length; the policy links it back when it is ready
//! again. A scan therefore walks past a pinned chunk at most once per pin, and eviction costs
//! amortised O(1) whatever the number of pinned chunks.

use crate::error::{ensure, Result};
use crate::pool::ChunkId;

const NIL: u32 = u32::MAX;
/// `queue[c]` of a chunk in no queue.
const NONE: u8 = u8::MAX;

/// `N` queues over chunk slots; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct Queues<const N: usize> {
    /// The queue of each chunk (`NONE`: not resident).
    queue: Vec<u8>,
    parked: Vec<bool>,
    /// Whether the chunk is ready (ref count 0), as the manager last said.
    ready: Vec<bool>,
    newer: Vec<u32>,
    older: Vec<u32>,
    /// `(oldest, newest)` linked entry of each queue.
    ends: [(u32, u32); N],
    /// Entries of each queue, parked ones included.
    lens: [usize; N],
}

impl<const N: usize> Default for Queues<N> {
    fn default() -> Self {
        Self {
            queue: Vec::new(),
            parked: Vec::new(),
            ready: Vec::new(),
            newer: Vec::new(),
            older: Vec::new(),
            ends: [(NIL, NIL); N],
            lens: [0; N],
        }
    }
}

impl<const N: usize> Queues<N> {
    /// Make room for chunk ids `0..n`.
    pub(crate) fn grow(&mut self, n: usize) {
        if n > self.queue.len() {
            crate::mem::resize_huge(&mut self.queue, n, NONE);
            crate::mem::resize_huge(&mut self.parked, n, false);
            crate::mem::resize_huge(&mut self.ready, n, false);
            crate::mem::resize_huge(&mut self.newer, n, NIL);
            crate::mem::resize_huge(&mut self.older, n, NIL);
        }
    }

    /// The queue of `c`, if resident.
    pub(crate) fn queue_of(&self, c: ChunkId) -> Option<usize> {
        self.queue
            .get(c as usize)
            .filter(|&&q| q != NONE)
            .map(|&q| usize::from(q))
    }

    /// Whether `c` is parked.
    #[cfg(test)]
    pub(crate) fn is_parked(&self, c: ChunkId) -> bool {
        self.parked.get(c as usize).copied().unwrap_or(false)
    }

    /// Entries of queue `q`, parked ones included.
    pub(crate) fn len(&self, q: usize) -> usize {
        self.lens[q]
    }

    fn link(&mut self, c: ChunkId, q: usize, newest: bool) {
        let i = c as usize;
        let (oldest_end, newest_end) = self.ends[q];
        if newest {
            self.older[i] = newest_end;
            self.newer[i] = NIL;
            if newest_end == NIL {
                self.ends[q].0 = c;
            } else {
                self.newer[newest_end as usize] = c;
            }
            self.ends[q].1 = c;
        } else {
            self.newer[i] = oldest_end;
            self.older[i] = NIL;
            if oldest_end == NIL {
                self.ends[q].1 = c;
            } else {
                self.older[oldest_end as usize] = c;
            }
            self.ends[q].0 = c;
        }
    }

    fn unlink(&mut self, c: ChunkId) {
        let i = c as usize;
        let q = usize::from(self.queue[i]);
        let (prev, next) = (self.older[i], self.newer[i]);
        if prev == NIL {
            self.ends[q].0 = next;
        } else {
            self.newer[prev as usize] = next;
        }
        if next == NIL {
            self.ends[q].1 = prev;
        } else {
            self.older[next as usize] = prev;
        }
    }

    /// Add a new (not ready) chunk at the newest end of queue `q`.
    pub(crate) fn insert(&mut self, c: ChunkId, q: usize) {
        let i = c as usize;
        self.queue[i] = q as u8;
        self.parked[i] = false;
        self.ready[i] = false;
        self.link(c, q, true);
        self.lens[q] += 1;
    }

    /// Drop `c` (linked or parked) from its queue.
    pub(crate) fn remove(&mut self, c: ChunkId) {
        let i = c as usize;
        let Some(q) = self.queue_of(c) else { return };
        if !self.parked[i] {
            self.unlink(c);
        }
        self.lens[q] -= 1;
        self.queue[i] = NONE;
        self.parked[i] = false;
        self.ready[i] = false;
    }

    /// Move `c` (linked or parked) to the newest (`newest`) or oldest end of queue `q`.
    pub(crate) fn move_to(&mut self, c: ChunkId, q: usize, newest: bool) {
        let i = c as usize;
        let from = usize::from(self.queue[i]);
        if self.parked[i] {
            self.parked[i] = false;
        } else {
            self.unlink(c);
        }
        self.lens[from] -= 1;
        self.queue[i] = q as u8;
        self.link(c, q, newest);
        self.lens[q] += 1;
    }

    /// Move parked `c` to queue `q`, still parked.
    pub(crate) fn retarget_parked(&mut self, c: ChunkId, q: usize) {
        let i = c as usize;
        debug_assert!(self.parked[i]);
        self.lens[usize::from(self.queue[i])] -= 1;
        self.queue[i] = q as u8;
        self.lens[q] += 1;
    }

    /// The manager says `c` is ready (`true`) or not. A parked chunk that is ready again
    /// re-enters at its queue's oldest end, where the scan would have examined it; returns
    /// whether that happened.
    pub(crate) fn set_ready(&mut self, c: ChunkId, ready: bool) -> bool {
        let i = c as usize;
        self.ready[i] = ready;
        let relink = ready && self.parked[i];
        if relink {
            self.move_to(c, usize::from(self.queue[i]), false);
        }
        relink
    }

    /// The oldest ready entry of queue `q` for which `skip` is false; the entries met before it
    /// that are not ready are parked.
    pub(crate) fn first_candidate(
        &mut self,
        q: usize,
        skip: &dyn Fn(ChunkId) -> bool,
    ) -> Option<ChunkId> {
        let mut c = self.ends[q].0;
        while c != NIL {
            let i = c as usize;
            let next = self.newer[i];
            if !self.ready[i] {
                self.unlink(c);
                self.parked[i] = true;
            } else if !skip(c) {
                return Some(c);
            }
            c = next;
        }
        None
    }

    /// The oldest linked entry of queue `q`, ready or not.
    pub(crate) fn oldest(&self, q: usize) -> Option<ChunkId> {
        let c = self.ends[q].0;
        (c != NIL).then_some(c)
    }

    /// Linked entries of queue `q`, oldest first.
    pub(crate) fn linked(&self, q: usize) -> Vec<ChunkId> {
        let mut v = Vec::new();
        self.linked_into(q, &mut v);
        v
    }

    /// [`linked`](Self::linked) into `out` (cleared first), reusing its buffer.
    pub(crate) fn linked_into(&self, q: usize, out: &mut Vec<ChunkId>) {
        out.clear();
        let mut c = self.ends[q].0;
        while c != NIL && out.len() < self.queue.len() {
            out.push(c);
            c = self.newer[c as usize];
        }
    }

    /// Move every parked chunk from its queue `q` to queue `to(q)`, still parked.
    pub(crate) fn retarget_parked_all(&mut self, to: impl Fn(usize) -> usize) {
        for i in 0..self.queue.len() {
            if self.parked[i] {
                let q = to(usize::from(self.queue[i]));
                self.retarget_parked(i as ChunkId, q);
            }
        }
    }

    /// Parked entries of queue `q`, by chunk id.
    pub(crate) fn parked(&self, q: usize) -> Vec<ChunkId> {
        (0..self.queue.len())
            .filter(|&i| self.parked[i] && usize::from(self.queue[i]) == q)
            .map(|i| i as ChunkId)
            .collect()
    }

    /// Check the links, lengths and flags against the resident chunks and which are ready.
    pub(crate) fn validate(
        &self,
        resident: &[bool],
        ready: impl Fn(ChunkId) -> bool,
    ) -> Result<()> {
        ensure!(
            resident.len() == self.queue.len(),
            "queues: per-chunk arrays differ in length"
        );
        for q in 0..N {
            let linked = self.linked(q);
            let mut prev = NIL;
            for &c in &linked {
                let i = c as usize;
                ensure!(
                    usize::from(self.queue[i]) == q && !self.parked[i] && self.older[i] == prev,
                    "queues: link broken at chunk {c}"
                );
                prev = c;
            }
            ensure!(
                prev == self.ends[q].1,
                "queues: newest end is not the last entry"
            );
            ensure!(
                linked.len() + self.parked(q).len() == self.lens[q],
                "queues: length of queue {q} drifted"
            );
        }
        for (i, &res) in resident.iter().enumerate() {
            let c = i as ChunkId;
            ensure!(
                res == (self.queue[i] != NONE),
                "queues: chunk {i} residency differs from the index"
            );
            ensure!(
                self.ready[i] == (res && ready(c)),
                "queues: chunk {i} ready flag is wrong"
            );
            ensure!(
                !(self.parked[i] && self.ready[i]),
                "queues: chunk {i} is ready but parked"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_park_unready_entries_and_lengths_count_them() {
        let mut q: Queues<2> = Queues::default();
        q.grow(4);
        for c in 0..4 {
            q.insert(c, 0);
            q.set_ready(c, c != 1);
        }
        // 0 is protected (skipped, stays), 1 is not ready (parked), 2 is the candidate.
        assert_eq!(q.first_candidate(0, &|c| c == 0), Some(2));
        assert!(q.is_parked(1) && !q.is_parked(0));
        assert_eq!(
            (q.len(0), q.linked(0), q.parked(0)),
            (4, vec![0, 2, 3], vec![1])
        );
        assert!(
            q.set_ready(1, true),
            "parked and ready: the policy links it back"
        );
        q.move_to(1, 1, false);
        q.move_to(3, 1, false); // oldest end of queue 1: 3 before 1
        assert_eq!((q.linked(1), q.len(0), q.len(1)), (vec![3, 1], 2, 2));
        q.remove(0);
        let resident = [false, true, true, true];
        q.validate(&resident, |_| true).unwrap();
        assert_eq!(q.oldest(1), Some(3));
    }
}
