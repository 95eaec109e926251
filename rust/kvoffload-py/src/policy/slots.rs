//! `Inner`: a core policy with the slot bookkeeping a `PolicyCore` keeps around it: one slot
//! per resident key (the core policies index chunks by slot), the key -> slot table, the key and
//! chunk objects of each slot, and the mirror of each slot's state.

use kvoffload_core::policy::{Access, RequestRank};
use kvoffload_core::{hash_key, CachePolicy, ChunkId, Slots};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The policy and its slot bookkeeping.
pub(super) struct Inner {
    pub(super) policy: Box<dyn CachePolicy>,
    /// Key, hash and mirrored state of each slot (-1 pending, 0 evictable, 1 pinned), and the
    /// key -> slot index (the core policies read keys for ties and ghosts).
    pub(super) slots: Slots,
    /// `(key object, chunk object)` of each occupied slot.
    pub(super) objs: Vec<Option<(Py<PyBytes>, Py<PyAny>)>>,
    /// Vacant slots below `slots.used()`, the next to reuse last.
    pub(super) free: Vec<ChunkId>,
    /// Bumped by `clear`: request ranks of earlier generations are stale.
    pub(super) generation: u64,
}

impl Inner {
    pub(super) fn find(&self, key: &[u8], hash: u64) -> Option<ChunkId> {
        self.slots.find(key, hash)
    }

    pub(super) fn access<'k>(&self, key: &'k [u8], position: Option<i64>) -> Access<'k> {
        let hash = hash_key(key);
        Access {
            key,
            hash,
            chunk: self.find(key, hash),
            position,
        }
    }

    /// Take a vacant slot for `key`, pending; `None` if every slot of the capacity is taken.
    pub(super) fn occupy(
        &mut self,
        key: &[u8],
        hash: u64,
        objs: (Py<PyBytes>, Py<PyAny>),
    ) -> Option<ChunkId> {
        let c = if let Some(c) = self.free.pop() {
            c
        } else {
            let c = self.slots.used();
            if c >= self.slots.capacity() {
                return None;
            }
            self.objs.resize_with(c + 1, || None);
            self.policy.grow(c + 1);
            c as ChunkId
        };
        self.slots.insert(c, key, hash);
        self.objs[c as usize] = Some(objs);
        Some(c)
    }

    /// Vacate slot `c` (pending or evictable, already dropped by the policy); returns its
    /// objects for the caller to release after the lock.
    pub(super) fn vacate(&mut self, c: ChunkId) -> Option<(Py<PyBytes>, Py<PyAny>)> {
        self.slots.remove(c);
        self.free.push(c);
        self.objs[c as usize].take()
    }
    /// Whether `rank` was issued by this policy in the current generation.
    pub(super) fn current_rank(&self, owner: u64, rank: Option<(u64, u64, u64)>) -> RequestRank {
        rank.and_then(|(o, g, r)| (o == owner && g == self.generation).then_some(r))
    }
}
