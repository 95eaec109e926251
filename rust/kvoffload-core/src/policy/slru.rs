//! `SlruPolicy`: segmented LRU (Karedla, Love and Wherry, "Caching strategies to improve disk
//! system performance", IEEE Computer 1994), pin-aware.
//!
//! Two LRU segments: *probation* for chunks not hit since they were stored and *protected* for
//! chunks hit at least once, holding at most four fifths of the capacity. A new chunk enters
//! probation. A hit (a touch of a resident key, or a request's first access to one) moves the
//! chunk to protected's most recent end; when that overfills protected, its least recent chunks
//! go back to probation's most recent end. Eviction takes probation's least recent chunk, or
//! protected's when probation has none.
//!
//! What pinning forces: a chunk that is not ready when an eviction scan reaches it is parked
//! (see [`Queues`]) and re-enters at its segment's least recent end once ready; a protected
//! chunk of the offer being stored is passed over. Demotion takes protected's least recent
//! *linked* chunk, pinned or not (demoting is not evicting); a hit on a parked chunk links it at
//! protected's most recent end at once.

use super::queues::Queues;
use super::{Access, CachePolicy, PolicyState, RequestRank};
use crate::error::Result;
use crate::pool::ChunkId;
use crate::table::Slots;

/// Segment indices.
const PROBATION: usize = 0;
const PROTECTED: usize = 1;

/// Segmented LRU over `capacity` chunk slots; see the module docs.
#[derive(Debug, Clone)]
pub struct SlruPolicy {
    capacity: u32,
    protected_cap: usize,
    queues: Queues<2>,
}

impl SlruPolicy {
    /// An empty policy for `capacity` chunk slots.
    #[must_use]
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            protected_cap: capacity as usize * 4 / 5,
            queues: Queues::default(),
        }
    }
}

impl CachePolicy for SlruPolicy {
    fn grow(&mut self, n: usize) {
        self.queues.grow(n);
    }

    fn insert(&mut self, chunk: ChunkId, _key: Access<'_>, _rank: &mut RequestRank) {
        self.queues.insert(chunk, PROBATION);
    }

    fn remove(&mut self, chunk: ChunkId) {
        self.queues.remove(chunk);
    }

    fn hit(&mut self, keys: &[Access<'_>]) {
        for a in keys {
            let Some(c) = a.chunk.filter(|&c| self.queues.queue_of(c).is_some()) else {
                continue;
            };
            self.queues.move_to(c, PROTECTED, true);
            while self.queues.len(PROTECTED) > self.protected_cap {
                let Some(d) = self.queues.oldest(PROTECTED) else {
                    break; // every protected chunk is parked
                };
                self.queues.move_to(d, PROBATION, true);
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
            let found = [PROBATION, PROTECTED]
                .into_iter()
                .find_map(|q| self.queues.first_candidate(q, protected));
            let Some(c) = found else {
                // The manager asks only for evictions that can succeed; this is a guard.
                debug_assert!(false, "slru: no victim left");
                return false;
            };
            self.queues.remove(c);
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
            names: &["probation", "protected"],
            linked: vec![
                zero(self.queues.linked(PROBATION)),
                zero(self.queues.linked(PROTECTED)),
            ],
            parked: vec![
                zero(self.queues.parked(PROBATION)),
                zero(self.queues.parked(PROTECTED)),
            ],
            ghosts: Vec::new(),
        }
    }

    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        self.queues.validate(resident, |c| refs.raw(c) == 0)
    }
}
