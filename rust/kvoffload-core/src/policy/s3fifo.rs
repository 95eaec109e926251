//! `S3FifoPolicy`: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction",
//! SOSP 2023), pin-aware.
//!
//! A small FIFO queue S (a tenth of the capacity), a main FIFO queue M (the rest) and a ghost
//! FIFO G of keys recently evicted from S (as many as M holds). Each resident chunk has a
//! frequency of 0 to 3, raised by a hit (a touch of a resident key, or a request's first access
//! to one). A new chunk enters S, or M if its key is a ghost. To evict: while S holds at least
//! its share, take S's oldest chunk: with a frequency above 1 it moves to M (and if M is full, M
//! evicts one), otherwise it is evicted and its key becomes a ghost. Otherwise take M's oldest:
//! with a frequency above 0 it goes back to M's newest end with its frequency lowered by one,
//! otherwise it is evicted. A victim of this call's batch is counted as soon as it is evicted,
//! and eviction stops at the batch's count even in the middle of a step.
//!
//! What pinning forces (the paper has no pinned objects): an entry that is not ready when a scan
//! reaches it (pinned by a load, or its store pending) leaves its queue (it is *parked*, still
//! counted in the queue's size) and re-enters at the queue's oldest end once it is ready, where
//! it would have been examined; an entry of the offer being stored (protected) is passed over
//! and keeps its place and frequency. The queue lengths that steer eviction count parked
//! entries.

use super::{Access, CachePolicy, FinishedKey, PolicyState, RequestRank};
use crate::error::{ensure, Result};
use crate::key::{KeyBuf, KeyHasher, KeySlot};
use crate::pool::ChunkId;
use crate::refcount::RefCountTable;
use hashlink::LinkedHashMap;

const NIL: u32 = u32::MAX;
/// The highest frequency a chunk reaches.
const MAX_FREQ: u8 = 3;

/// Where a chunk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Place {
    #[default]
    Out,
    Small,
    Main,
    /// Parked, belonging to S.
    ParkedSmall,
    /// Parked, belonging to M.
    ParkedMain,
}

/// One FIFO queue threaded through the per-chunk links.
#[derive(Debug, Clone, Copy)]
struct Queue {
    oldest: u32,
    newest: u32,
    /// Entries, parked ones included.
    len: usize,
}

impl Default for Queue {
    fn default() -> Self {
        Self {
            oldest: NIL,
            newest: NIL,
            len: 0,
        }
    }
}

/// S3-FIFO over `capacity` chunk slots; see the module docs.
#[derive(Debug, Clone)]
pub struct S3FifoPolicy {
    small_cap: usize,
    main_cap: usize,
    place: Vec<Place>,
    freq: Vec<u8>,
    ready: Vec<bool>,
    newer: Vec<u32>,
    older: Vec<u32>,
    small: Queue,
    main: Queue,
    /// Ghost keys, oldest first.
    ghosts: LinkedHashMap<KeyBuf, (), KeyHasher>,
}

impl S3FifoPolicy {
    /// An empty policy for `capacity` chunk slots.
    #[must_use]
    pub fn new(capacity: u32) -> Self {
        let capacity = capacity as usize;
        let small_cap = (capacity / 10).max(1);
        Self {
            small_cap,
            main_cap: capacity.saturating_sub(small_cap),
            place: Vec::new(),
            freq: Vec::new(),
            ready: Vec::new(),
            newer: Vec::new(),
            older: Vec::new(),
            small: Queue::default(),
            main: Queue::default(),
            ghosts: LinkedHashMap::with_hasher(KeyHasher),
        }
    }

    fn queue_mut(&mut self, small: bool) -> &mut Queue {
        if small {
            &mut self.small
        } else {
            &mut self.main
        }
    }

    /// Link `c` at the newest (`newest == true`) or oldest end of S or M.
    fn link(&mut self, c: ChunkId, small: bool, newest: bool) {
        let i = c as usize;
        let q = *self.queue_mut(small);
        if newest {
            self.older[i] = q.newest;
            self.newer[i] = NIL;
            if q.newest == NIL {
                self.queue_mut(small).oldest = c;
            } else {
                self.newer[q.newest as usize] = c;
            }
            self.queue_mut(small).newest = c;
        } else {
            self.newer[i] = q.oldest;
            self.older[i] = NIL;
            if q.oldest == NIL {
                self.queue_mut(small).newest = c;
            } else {
                self.older[q.oldest as usize] = c;
            }
            self.queue_mut(small).oldest = c;
        }
        self.place[i] = if small { Place::Small } else { Place::Main };
    }

    /// Unlink `c` from the queue it is linked in (its place is left to the caller).
    fn unlink(&mut self, c: ChunkId) {
        let i = c as usize;
        let small = self.place[i] == Place::Small;
        let (prev, next) = (self.older[i], self.newer[i]);
        if prev == NIL {
            self.queue_mut(small).oldest = next;
        } else {
            self.newer[prev as usize] = next;
        }
        if next == NIL {
            self.queue_mut(small).newest = prev;
        } else {
            self.older[next as usize] = prev;
        }
    }

    /// The oldest ready, unprotected entry of S or M; not-ready entries met before it are parked.
    fn first_candidate(
        &mut self,
        small: bool,
        protected: &dyn Fn(ChunkId) -> bool,
    ) -> Option<ChunkId> {
        let mut c = self.queue_mut(small).oldest;
        while c != NIL {
            let next = self.newer[c as usize];
            if !self.ready[c as usize] {
                self.unlink(c);
                self.place[c as usize] = if small {
                    Place::ParkedSmall
                } else {
                    Place::ParkedMain
                };
            } else if !protected(c) {
                return Some(c);
            }
            c = next;
        }
        None
    }

    /// Evict `c` (linked, ready) from its queue; an S victim's key becomes a ghost.
    fn drop_victim(&mut self, c: ChunkId, keys: &[KeySlot], out: &mut Vec<ChunkId>) {
        let i = c as usize;
        let small = self.place[i] == Place::Small;
        self.unlink(c);
        self.queue_mut(small).len -= 1;
        self.place[i] = Place::Out;
        self.ready[i] = false;
        if small && self.main_cap > 0 {
            let slot = &keys[i];
            self.ghosts.insert(slot.key.clone(), ());
            while self.ghosts.len() > self.main_cap {
                self.ghosts.pop_front();
            }
        }
        out.push(c);
    }

    /// One eviction from M (entries with a frequency go round first); `false` if M has none.
    fn evict_main(
        &mut self,
        protected: &dyn Fn(ChunkId) -> bool,
        keys: &[KeySlot],
        out: &mut Vec<ChunkId>,
    ) -> bool {
        while let Some(c) = self.first_candidate(false, protected) {
            let i = c as usize;
            if self.freq[i] > 0 {
                self.freq[i] -= 1;
                self.unlink(c);
                self.link(c, false, true);
            } else {
                self.drop_victim(c, keys, out);
                return true;
            }
        }
        false
    }

    /// Evictions from S until one S entry is evicted or `out` reaches `target`; `false` if
    /// nothing was evicted.
    fn evict_small(
        &mut self,
        protected: &dyn Fn(ChunkId) -> bool,
        keys: &[KeySlot],
        out: &mut Vec<ChunkId>,
        target: usize,
    ) -> bool {
        let before = out.len();
        while out.len() < target {
            let Some(c) = self.first_candidate(true, protected) else {
                break;
            };
            if self.freq[c as usize] > 1 {
                self.unlink(c);
                self.small.len -= 1;
                self.link(c, false, true);
                self.main.len += 1;
                if self.main.len > self.main_cap {
                    self.evict_main(protected, keys, out);
                }
            } else {
                self.drop_victim(c, keys, out);
                break;
            }
        }
        out.len() > before
    }

    fn hit(&mut self, keys: &[Access<'_>]) {
        for a in keys {
            if let Some(c) = a.chunk {
                let i = c as usize;
                if self.place[i] != Place::Out {
                    self.freq[i] = (self.freq[i] + 1).min(MAX_FREQ);
                }
            }
        }
    }

    /// The linked entries of a queue, oldest first.
    fn listed(&self, q: Queue) -> Vec<ChunkId> {
        let mut v = Vec::new();
        let mut c = q.oldest;
        while c != NIL && v.len() < self.place.len() {
            v.push(c);
            c = self.newer[c as usize];
        }
        v
    }

    /// `(chunk, frequency)` of S's or M's linked entries, oldest first.
    fn freqs(&self, q: Queue) -> Vec<(ChunkId, u8)> {
        self.listed(q)
            .into_iter()
            .map(|c| (c, self.freq[c as usize]))
            .collect()
    }
}

impl CachePolicy for S3FifoPolicy {
    fn grow(&mut self, n: usize) {
        if n > self.place.len() {
            self.place.resize(n, Place::Out);
            self.freq.resize(n, 0);
            self.ready.resize(n, false);
            self.newer.resize(n, NIL);
            self.older.resize(n, NIL);
        }
    }

    fn insert(&mut self, chunk: ChunkId, key: Access<'_>, _rank: &mut RequestRank) {
        let i = chunk as usize;
        self.freq[i] = 0;
        self.ready[i] = false;
        let ghost = self
            .ghosts
            .raw_entry_mut()
            .from_key_hashed_nocheck(key.hash, key.key);
        let small = match ghost {
            hashlink::linked_hash_map::RawEntryMut::Occupied(e) => {
                e.remove();
                false
            }
            hashlink::linked_hash_map::RawEntryMut::Vacant(_) => true,
        };
        self.link(chunk, small, true);
        self.queue_mut(small).len += 1;
    }

    fn remove(&mut self, chunk: ChunkId) {
        let i = chunk as usize;
        let small = match self.place[i] {
            Place::Out => return,
            Place::Small => {
                self.unlink(chunk);
                true
            }
            Place::Main => {
                self.unlink(chunk);
                false
            }
            Place::ParkedSmall => true,
            Place::ParkedMain => false,
        };
        self.queue_mut(small).len -= 1;
        self.place[i] = Place::Out;
        self.ready[i] = false;
    }

    fn touch(&mut self, keys: &[Access<'_>], _refs: &RefCountTable) {
        self.hit(keys);
    }

    fn on_store_miss(&mut self, _keys: &[Access<'_>]) {}

    fn on_request_access(&mut self, keys: &[Access<'_>], _rank: &mut RequestRank) {
        self.hit(keys);
    }

    fn on_request_finished(&mut self, _keys: &[FinishedKey<'_>]) {}

    fn evict(
        &mut self,
        n: usize,
        protected: &dyn Fn(ChunkId) -> bool,
        keys: &[KeySlot],
        out: &mut Vec<ChunkId>,
    ) -> bool {
        let start = out.len();
        let target = start + n;
        while out.len() < target {
            // The order of the two steps matters (each has side effects); clippy reads `||` as
            // commutative.
            #[allow(clippy::if_same_then_else)]
            let progressed = if self.small.len >= self.small_cap {
                self.evict_small(protected, keys, out, target)
                    || self.evict_main(protected, keys, out)
            } else {
                self.evict_main(protected, keys, out)
                    || self.evict_small(protected, keys, out, target)
            };
            if !progressed {
                // The manager asks only for evictions that can succeed; this is a guard.
                debug_assert!(false, "s3fifo: no victim left");
                return false;
            }
        }
        true
    }

    fn clear(&mut self) {
        *self = Self::new((self.small_cap + self.main_cap) as u32);
    }

    fn mark_evictable(&mut self, chunk: ChunkId) {
        let i = chunk as usize;
        self.ready[i] = true;
        match self.place[i] {
            Place::ParkedSmall => self.link(chunk, true, false),
            Place::ParkedMain => self.link(chunk, false, false),
            _ => {}
        }
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        self.ready[chunk as usize] = false;
    }

    fn prefetch(&self, chunk: ChunkId) {
        if let Some(x) = self.place.get(chunk as usize) {
            crate::index::prefetch(x);
        }
    }

    fn state(&self) -> PolicyState {
        let parked = |p: Place| -> Vec<(ChunkId, u8)> {
            (0..self.place.len())
                .filter(|&i| self.place[i] == p)
                .map(|i| (i as ChunkId, self.freq[i]))
                .collect()
        };
        PolicyState::S3Fifo {
            small: self.freqs(self.small),
            main: self.freqs(self.main),
            parked_small: parked(Place::ParkedSmall),
            parked_main: parked(Place::ParkedMain),
            ghosts: self.ghosts.keys().cloned().collect(),
        }
    }

    fn validate(&self, resident: &[bool], refs: &RefCountTable) -> Result<()> {
        ensure!(
            resident.len() == self.place.len(),
            "s3fifo: per-chunk arrays differ in length"
        );
        for (q, want, parked) in [
            (self.small, Place::Small, Place::ParkedSmall),
            (self.main, Place::Main, Place::ParkedMain),
        ] {
            let linked = self.listed(q);
            let mut prev = NIL;
            for &c in &linked {
                ensure!(
                    self.place[c as usize] == want && self.older[c as usize] == prev,
                    "s3fifo: queue link broken at chunk {c}"
                );
                prev = c;
            }
            ensure!(prev == q.newest, "s3fifo: newest end is not the last entry");
            let n = self
                .place
                .iter()
                .filter(|&&p| p == want || p == parked)
                .count();
            ensure!(
                n == q.len
                    && linked.len() == n - self.place.iter().filter(|&&p| p == parked).count(),
                "s3fifo: queue length drifted"
            );
        }
        for (i, &res) in resident.iter().enumerate() {
            let c = i as ChunkId;
            ensure!(
                res == (self.place[i] != Place::Out),
                "s3fifo: chunk {i} residency differs from the index"
            );
            ensure!(
                self.ready[i] == (res && refs.raw(c) == 0),
                "s3fifo: chunk {i} ready flag is wrong"
            );
            ensure!(
                !matches!(self.place[i], Place::ParkedSmall | Place::ParkedMain) || !self.ready[i],
                "s3fifo: chunk {i} is ready but parked"
            );
            ensure!(
                self.freq[i] <= MAX_FREQ,
                "s3fifo: chunk {i} frequency above 3"
            );
        }
        ensure!(
            self.ghosts.len() <= self.main_cap,
            "s3fifo: ghost queue over its bound"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::test_util::keys;

    fn acc(c: ChunkId, ks: &[KeySlot]) -> Access<'_> {
        let s = &ks[c as usize];
        Access {
            key: &s.key,
            hash: s.hash,
            chunk: Some(c),
            position: None,
        }
    }

    fn add(p: &mut S3FifoPolicy, c: ChunkId, ks: &[KeySlot]) {
        p.insert(
            c,
            Access {
                chunk: None,
                ..acc(c, ks)
            },
            &mut None,
        );
        p.mark_evictable(c);
    }

    fn evict(p: &mut S3FifoPolicy, n: usize, ks: &[KeySlot]) -> Vec<ChunkId> {
        let mut out = Vec::new();
        assert!(p.evict(n, &|_| false, ks, &mut out));
        out
    }

    #[test]
    fn one_hit_wonders_leave_through_s_and_come_back_through_m() {
        let ks = keys(12);
        let mut p = S3FifoPolicy::new(10); // S holds 1, M 9
        p.grow(12);
        for c in 0..10 {
            add(&mut p, c, &ks);
        }
        let refs = RefCountTable::new(12);
        p.touch(&[acc(0, &ks), acc(0, &ks), acc(1, &ks)], &refs);
        // 0 (frequency 2) moves to M; 1 (frequency 1) is evicted from S and becomes a ghost.
        assert_eq!(evict(&mut p, 2, &ks), vec![1, 2]);
        let PolicyState::S3Fifo {
            small,
            main,
            ghosts,
            ..
        } = p.state()
        else {
            panic!()
        };
        assert_eq!(main, vec![(0, 2)]);
        assert_eq!(small.first(), Some(&(3, 0)));
        assert_eq!(ghosts, vec![ks[1].key.clone(), ks[2].key.clone()]);
        add(&mut p, 1, &ks); // a ghost: straight into M
        let PolicyState::S3Fifo { main, ghosts, .. } = p.state() else {
            panic!()
        };
        assert_eq!((main.last(), ghosts.len()), (Some(&(1, 0)), 1));
        let resident: Vec<bool> = (0..12).map(|i| i != 2 && i < 10).collect();
        let mut refs = RefCountTable::new(12);
        refs.grow(12);
        for c in (0..10).filter(|&c| c != 2) {
            refs.insert_pending(c);
            refs.complete_store(c);
        }
        p.validate(&resident, &refs).unwrap();
    }
}
