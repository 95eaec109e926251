//! `Inner`: a core policy with the slot bookkeeping a `PolicyCore` keeps around it: one slot
//! per resident key (the core policies index chunks by slot), the key -> slot table, the key and
//! chunk objects of each slot, and the mirror of each slot's state.

use hashbrown::HashTable;
use kvoffload_core::key::KeySlot;
use kvoffload_core::policy::{Access, RequestRank};
use kvoffload_core::{hash_key, CachePolicy, ChunkId, KeyBuf, RefCountTable};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The policy and its slot bookkeeping.
pub(super) struct Inner {
    pub(super) policy: Box<dyn CachePolicy>,
    /// Mirror of each slot's state: -1 pending, 0 evictable, 1 pinned.
    pub(super) refs: RefCountTable,
    /// Key bytes and hash of each slot (the core policies read them for ties and ghosts).
    pub(super) slots: Vec<KeySlot>,
    /// `(key object, chunk object)` of each occupied slot.
    pub(super) objs: Vec<Option<(Py<PyBytes>, Py<PyAny>)>>,
    /// Resident key -> slot, by `hash_key`; equality through `slots`.
    pub(super) index: HashTable<ChunkId>,
    /// Vacant slots below `slots.len()`, the next to reuse last.
    pub(super) free: Vec<ChunkId>,
    /// Bumped by `clear`: request ranks of earlier generations are stale.
    pub(super) generation: u64,
}

impl Inner {
    pub(super) fn find(&self, key: &[u8], hash: u64) -> Option<ChunkId> {
        self.index
            .find(hash, |&c| self.slots[c as usize].key.as_slice() == key)
            .copied()
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

    /// Take a vacant slot for `key`, growing every per-slot table when none is free.
    pub(super) fn occupy(
        &mut self,
        key: &[u8],
        hash: u64,
        objs: (Py<PyBytes>, Py<PyAny>),
    ) -> ChunkId {
        let c = if let Some(c) = self.free.pop() {
            c
        } else {
            let c = self.slots.len() as ChunkId;
            let n = self.slots.len() + 1;
            self.slots.resize_with(n, KeySlot::default);
            self.objs.resize_with(n, || None);
            self.refs.grow(n);
            self.policy.grow(n);
            c
        };
        let slot = &mut self.slots[c as usize];
        slot.key = KeyBuf::from_slice(key);
        slot.hash = hash;
        slot.resident = true;
        self.objs[c as usize] = Some(objs);
        let slots = &self.slots;
        self.index
            .insert_unique(hash, c, |&d| slots[d as usize].hash);
        c
    }

    /// Vacate slot `c` (already dropped by the policy and the ref counts); returns its objects
    /// for the caller to release after the lock.
    pub(super) fn vacate(&mut self, c: ChunkId) -> Option<(Py<PyBytes>, Py<PyAny>)> {
        let slot = &mut self.slots[c as usize];
        let hash = slot.hash;
        slot.key = KeyBuf::new();
        slot.resident = false;
        if let Ok(entry) = self.index.find_entry(hash, |&d| d == c) {
            entry.remove();
        }
        self.free.push(c);
        self.objs[c as usize].take()
    }

    /// Whether `rank` was issued by this policy in the current generation.
    pub(super) fn current_rank(&self, owner: u64, rank: Option<(u64, u64, u64)>) -> RequestRank {
        rank.and_then(|(o, g, r)| (o == owner && g == self.generation).then_some(r))
    }
}
