//! `TwoQPolicy`: 2Q (Johnson and Shasha, "2Q: A Low Overhead High Performance Buffer Management
//! Replacement Algorithm", VLDB 1994), the full version, pin-aware.
//!
//! A FIFO queue A1in for chunks seen once (a quarter of the capacity), an LRU queue Am for the
//! rest, and a ghost FIFO A1out of keys evicted from A1in (half the capacity). A new chunk
//! enters A1in, or Am if its key is a ghost. A hit (a touch of a resident key, or a request's
//! first access to one) moves an Am chunk to Am's most recent end; a hit in A1in changes nothing
//! (the paper's correlated references). To evict: while A1in holds more than its share, A1in's
//! oldest chunk goes and its key becomes a ghost; otherwise Am's least recent chunk goes.
//!
//! What pinning forces: a chunk that is not ready when a scan reaches it is parked (see
//! [`Queues`]) and re-enters at its queue's oldest end once ready; a protected chunk (of the
//! offer being stored) is passed over; when the preferred queue has no candidate, the other one
//! gives the victim. A hit on a parked Am chunk links it at Am's most recent end at once.

use super::queues::Queues;
use super::{Access, CachePolicy, PolicyState, RequestRank};
use crate::error::{ensure, Result};
use crate::key::{KeyBuf, KeyHasher};
use crate::pool::ChunkId;
use crate::table::Slots;
use hashlink::linked_hash_map::RawEntryMut;
use hashlink::LinkedHashMap;

/// Queue indices.
const A1IN: usize = 0;
const AM: usize = 1;

/// 2Q over `capacity` chunk slots; see the module docs.
#[derive(Debug, Clone)]
pub struct TwoQPolicy {
    capacity: u32,
    kin: usize,
    kout: usize,
    queues: Queues<2>,
    /// A1out, oldest first.
    ghosts: LinkedHashMap<KeyBuf, (), KeyHasher>,
}

impl TwoQPolicy {
    /// An empty policy for `capacity` chunk slots.
    #[must_use]
    pub fn new(capacity: u32) -> Self {
        let cap = capacity as usize;
        Self {
            capacity,
            kin: (cap / 4).max(1),
            kout: (cap / 2).max(1),
            queues: Queues::default(),
            ghosts: LinkedHashMap::with_hasher(KeyHasher),
        }
    }
}

impl CachePolicy for TwoQPolicy {
    fn grow(&mut self, n: usize) {
        self.queues.grow(n);
    }

    fn insert(&mut self, chunk: ChunkId, key: Access<'_>, _rank: &mut RequestRank) {
        let ghost = self
            .ghosts
            .raw_entry_mut()
            .from_key_hashed_nocheck(key.hash, key.key);
        let queue = match ghost {
            RawEntryMut::Occupied(e) => {
                e.remove();
                AM
            }
            RawEntryMut::Vacant(_) => A1IN,
        };
        self.queues.insert(chunk, queue);
    }

    fn remove(&mut self, chunk: ChunkId) {
        self.queues.remove(chunk);
    }

    fn hit(&mut self, keys: &[Access<'_>]) {
        for a in keys {
            if let Some(c) = a.chunk.filter(|&c| self.queues.queue_of(c) == Some(AM)) {
                self.queues.move_to(c, AM, true);
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
        for _ in 0..n {
            let order = if self.queues.len(A1IN) > self.kin {
                [A1IN, AM]
            } else {
                [AM, A1IN]
            };
            let found = order
                .into_iter()
                .find_map(|q| self.queues.first_candidate(q, protected).map(|c| (q, c)));
            let Some((q, c)) = found else {
                // The manager asks only for evictions that can succeed; this is a guard.
                debug_assert!(false, "2q: no victim left");
                return false;
            };
            self.queues.remove(c);
            if q == A1IN {
                self.ghosts.insert(keys.key(c), ());
                while self.ghosts.len() > self.kout {
                    self.ghosts.pop_front();
                }
            }
            out.push(c);
        }
        true
    }

    fn clear(&mut self) {
        *self = Self::new(self.capacity);
    }

    fn mark_evictable(&mut self, chunk: ChunkId) {
        self.queues.set_ready(chunk, true);
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        self.queues.set_ready(chunk, false);
    }

    fn state(&self) -> PolicyState {
        let zero = |cs: Vec<ChunkId>| cs.into_iter().map(|c| (c, 0)).collect();
        PolicyState::Queues {
            names: &["a1in", "am"],
            linked: vec![zero(self.queues.linked(A1IN)), zero(self.queues.linked(AM))],
            parked: vec![zero(self.queues.parked(A1IN)), zero(self.queues.parked(AM))],
            ghosts: self.ghosts.keys().cloned().collect(),
        }
    }

    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        self.queues.validate(resident, |c| refs.raw(c) == 0)?;
        ensure!(self.ghosts.len() <= self.kout, "2q: A1out over its bound");
        Ok(())
    }
}
