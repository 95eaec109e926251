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

use super::queues::Queues;
use super::{Access, CachePolicy, PolicyState, RequestRank};
use crate::error::{ensure, Result};
use crate::key::{KeyBuf, KeyHasher};
use crate::pool::ChunkId;
use crate::table::Slots;
use hashlink::linked_hash_map::RawEntryMut;
use hashlink::LinkedHashMap;

/// The highest frequency a chunk reaches.
const MAX_FREQ: u8 = 3;
/// Queue indices.
const SMALL: usize = 0;
const MAIN: usize = 1;

/// S3-FIFO over `capacity` chunk slots; see the module docs.
#[derive(Debug, Clone)]
pub struct S3FifoPolicy {
    small_cap: usize,
    main_cap: usize,
    queues: Queues<2>,
    freq: Vec<u8>,
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
            queues: Queues::default(),
            freq: Vec::new(),
            ghosts: LinkedHashMap::with_hasher(KeyHasher),
        }
    }

    /// Evict `c` (linked, ready); an S victim's key becomes a ghost.
    fn drop_victim(&mut self, c: ChunkId, keys: &Slots, out: &mut Vec<ChunkId>) {
        let from_small = self.queues.queue_of(c) == Some(SMALL);
        self.queues.remove(c);
        if from_small && self.main_cap > 0 {
            self.ghosts.insert(keys.key(c), ());
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
        keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        while let Some(c) = self.queues.first_candidate(MAIN, protected) {
            let i = c as usize;
            if self.freq[i] > 0 {
                self.freq[i] -= 1;
                self.queues.move_to(c, MAIN, true);
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
        keys: &Slots,
        out: &mut Vec<ChunkId>,
        target: usize,
    ) -> bool {
        let before = out.len();
        while out.len() < target {
            let Some(c) = self.queues.first_candidate(SMALL, protected) else {
                break;
            };
            if self.freq[c as usize] > 1 {
                self.queues.move_to(c, MAIN, true);
                if self.queues.len(MAIN) > self.main_cap {
                    self.evict_main(protected, keys, out);
                }
            } else {
                self.drop_victim(c, keys, out);
                break;
            }
        }
        out.len() > before
    }

    fn with_freq(&self, cs: Vec<ChunkId>) -> Vec<(ChunkId, u8)> {
        cs.into_iter().map(|c| (c, self.freq[c as usize])).collect()
    }
}

impl CachePolicy for S3FifoPolicy {
    fn grow(&mut self, n: usize) {
        if n > self.freq.len() {
            crate::mem::resize_huge(&mut self.freq, n, 0);
            self.queues.grow(n);
        }
    }

    fn insert(&mut self, chunk: ChunkId, key: Access<'_>, _rank: &mut RequestRank) {
        self.freq[chunk as usize] = 0;
        let ghost = self
            .ghosts
            .raw_entry_mut()
            .from_key_hashed_nocheck(key.hash, key.key);
        let queue = match ghost {
            RawEntryMut::Occupied(e) => {
                e.remove();
                MAIN
            }
            RawEntryMut::Vacant(_) => SMALL,
        };
        self.queues.insert(chunk, queue);
    }

    fn remove(&mut self, chunk: ChunkId) {
        self.queues.remove(chunk);
    }

    fn hit(&mut self, keys: &[Access<'_>]) {
        for a in keys {
            if let Some(c) = a.chunk.filter(|&c| self.queues.queue_of(c).is_some()) {
                let f = &mut self.freq[c as usize];
                *f = (*f + 1).min(MAX_FREQ);
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
        let target = start + n;
        while out.len() < target {
            // The order of the two steps matters (each has side effects); clippy reads `||` as
            // commutative.
            #[allow(clippy::if_same_then_else)]
            let progressed = if self.queues.len(SMALL) >= self.small_cap {
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
        self.queues.set_ready(chunk, true);
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        self.queues.set_ready(chunk, false);
    }

    fn prefetch(&self, chunk: ChunkId) {
        if let Some(x) = self.freq.get(chunk as usize) {
            crate::mem::prefetch(x);
        }
    }

    fn state(&self) -> PolicyState {
        PolicyState::Queues {
            names: &["small", "main"],
            linked: vec![
                self.with_freq(self.queues.linked(SMALL)),
                self.with_freq(self.queues.linked(MAIN)),
            ],
            parked: vec![
                self.with_freq(self.queues.parked(SMALL)),
                self.with_freq(self.queues.parked(MAIN)),
            ],
            ghosts: self.ghosts.keys().cloned().collect(),
        }
    }

    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        self.queues.validate(resident, |c| refs.raw(c) == 0)?;
        ensure!(
            self.freq.iter().all(|&f| f <= MAX_FREQ),
            "s3fifo: a frequency above 3"
        );
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
    use crate::key::test_util::{keys, TestKeys};

    fn acc(c: ChunkId, ks: &TestKeys) -> Access<'_> {
        let s = &ks[c as usize];
        Access {
            key: &s.key,
            hash: s.hash,
            chunk: Some(c),
            position: None,
        }
    }

    fn add(p: &mut S3FifoPolicy, c: ChunkId, ks: &TestKeys) {
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

    fn evict(p: &mut S3FifoPolicy, n: usize, ks: &TestKeys) -> Vec<ChunkId> {
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
        let refs = Slots::new(12).unwrap();
        p.touch(&[acc(0, &ks), acc(0, &ks), acc(1, &ks)], &refs);
        // 0 (frequency 2) moves to M; 1 (frequency 1) is evicted from S and becomes a ghost.
        assert_eq!(evict(&mut p, 2, &ks), vec![1, 2]);
        let PolicyState::Queues { linked, ghosts, .. } = p.state() else {
            panic!()
        };
        assert_eq!(linked[1], vec![(0, 2)]);
        assert_eq!(linked[0].first(), Some(&(3, 0)));
        assert_eq!(ghosts, vec![ks[1].key.clone(), ks[2].key.clone()]);
        add(&mut p, 1, &ks); // a ghost: straight into M
        let PolicyState::Queues { linked, ghosts, .. } = p.state() else {
            panic!()
        };
        assert_eq!((linked[1].last(), ghosts.len()), (Some(&(1, 0)), 1));
        let resident: Vec<bool> = (0..12).map(|i| i != 2 && i < 10).collect();
        let mut refs = Slots::new(12).unwrap();
        refs.grow(12);
        for c in (0..10).filter(|&c| c != 2) {
            crate::key::test_util::pend(&mut refs, c);
            refs.complete_store(c);
        }
        p.validate(&resident, &refs).unwrap();
    }
}
