//! Cache policies: which resident chunk to evict, and how accesses change that order.
//!
//! A policy sees chunks by their [`ChunkId`] (one slot per resident key) and keys by their
//! bytes (ghost entries and ties need them). The manager owns the key index and the ref counts;
//! it tells the policy when a chunk becomes evictable (ref count 0) or stops being evictable,
//! and a policy only ever evicts chunks it was told are evictable and not protected.

mod arc;
mod fifo;
mod ghosts;
mod lfu;
mod lru;
mod order;
mod queues;
mod s3fifo;
mod sieve;
mod slru;
mod twoq;

pub use arc::ArcPolicy;
pub use fifo::FifoPolicy;
pub use lfu::LfuPolicy;
pub use lru::LruPolicy;
pub use s3fifo::S3FifoPolicy;
pub use sieve::SievePolicy;
pub use slru::SlruPolicy;
pub use twoq::TwoQPolicy;

use crate::error::Result;
use crate::key::KeyBuf;
use crate::pool::ChunkId;
use crate::table::Slots;

/// One key of a call, resolved against the cache.
#[derive(Debug, Clone, Copy)]
pub struct Access<'k> {
    /// The key bytes.
    pub key: &'k [u8],
    /// `hash_key(key)`, computed once per call.
    pub hash: u64,
    /// Its chunk when resident (pending, ready or pinned).
    pub chunk: Option<ChunkId>,
    /// Its end-token position in the calling request, when known.
    pub position: Option<i64>,
}

/// One key a finishing request saw, in head-to-tail order, with how the request used it.
#[derive(Debug, Clone, Copy)]
pub struct FinishedKey<'k> {
    /// The key bytes.
    pub key: &'k [u8],
    /// Its chunk when resident now.
    pub chunk: Option<ChunkId>,
    /// The request got a chunk for the key and never reused it.
    pub inserted_only: bool,
    /// The request loaded the key, or offered it while it was readable.
    pub reused: bool,
}

/// The per-request slot a policy may keep state in (LRU: the request's rank).
pub type RequestRank = Option<u64>;

/// A snapshot of a policy's order, for tests and debugging.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyState {
    /// LRU: the rank of each resident chunk, and the last rank issued.
    Lru {
        /// `(chunk, (major, minor))` for every resident chunk, by chunk id.
        ranks: Vec<(ChunkId, (u64, i64))>,
        /// The next rank the counter issues (ranks start at 0).
        next_rank: u64,
    },
    /// ARC: the four lists, oldest first, and the target size of T1.
    Arc {
        /// Chunks seen once.
        t1: Vec<ChunkId>,
        /// Chunks reused.
        t2: Vec<ChunkId>,
        /// Keys evicted from T1.
        b1: Vec<KeyBuf>,
        /// Keys evicted from T2.
        b2: Vec<KeyBuf>,
        /// The adaptive target size of T1.
        target: f64,
    },
    /// FIFO and SIEVE: the queue, oldest first, with each entry's visited bit.
    Queue {
        /// `(chunk, visited)`, oldest first.
        queue: Vec<(ChunkId, bool)>,
        /// `(chunk, visited)` of entries out of the queue until they are ready (SIEVE), by id.
        parked: Vec<(ChunkId, bool)>,
        /// The entry the SIEVE hand examines next (`None`: the oldest).
        hand: Option<ChunkId>,
    },
    /// Queue-based policies (S3-FIFO, 2Q, SLRU): each named queue, oldest first, and each
    /// queue's parked entries by id, as `(chunk, frequency)` (0 where a policy counts none);
    /// the ghost keys, oldest first.
    Queues {
        /// The queues' names, in order.
        names: &'static [&'static str],
        /// Linked entries of each queue, oldest first.
        linked: Vec<Vec<(ChunkId, u8)>>,
        /// Parked entries of each queue, by chunk id.
        parked: Vec<Vec<(ChunkId, u8)>>,
        /// Ghost keys, oldest first.
        ghosts: Vec<KeyBuf>,
    },
    /// An external policy: its order is its own business.
    External,
}

/// The interface every built-in policy implements. All methods are infallible for legal input;
/// the manager validates calls before it reaches the policy.
pub trait CachePolicy: Send {
    /// Make room for chunk ids `0..n` (called before those ids are first inserted).
    fn grow(&mut self, n: usize);
    /// A new chunk, pending, for `key` (its `chunk` field is `None`: it was absent); `rank` is
    /// the storing request's slot.
    fn insert(&mut self, chunk: ChunkId, key: Access<'_>, rank: &mut RequestRank);
    /// Forget a pending chunk whose store failed (no ghost entry).
    fn remove(&mut self, chunk: ChunkId);
    /// Mark keys as recently used; `refs` tells pending from readable chunks (default: a hit).
    fn touch(&mut self, keys: &[Access<'_>], _refs: &Slots) {
        self.hit(keys);
    }
    /// Keys about to be stored that the request had not reported as misses before (default:
    /// nothing).
    fn on_store_miss(&mut self, _keys: &[Access<'_>]) {}
    /// Keys a request sees for the first time, in call order (default: a hit).
    fn on_request_access(&mut self, keys: &[Access<'_>], _rank: &mut RequestRank) {
        self.hit(keys);
    }
    /// Whether [`on_request_access`](Self::on_request_access) reads the keys it is given in a
    /// call whose keys have token positions (`positions`) or have none. When it does not, the
    /// manager passes an empty list rather than build one per call (default: it does).
    fn reads_access_keys(&self, _positions: bool) -> bool {
        true
    }
    /// Whether [`on_store_miss`](Self::on_store_miss) does anything. When it does not, the
    /// manager neither builds the list of misses nor makes the call (default: it does).
    fn reads_store_misses(&self) -> bool {
        true
    }
    /// A hit on the resident keys among `keys`: what kvoffload's own policies do on a touch or
    /// a request's first access, through the defaults of those two (default: nothing).
    fn hit(&mut self, _keys: &[Access<'_>]) {}
    /// A request finished; `keys` is its head-to-tail order (default: nothing).
    fn on_request_finished(&mut self, _keys: &[FinishedKey<'_>]) {}
    /// Choose exactly `n` evictable, unprotected chunks and drop them, or change nothing and
    /// return `false`. Victims are appended to `out` in eviction order.
    fn evict(
        &mut self,
        n: usize,
        protected: &dyn Fn(ChunkId) -> bool,
        keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool;
    /// Forget everything (chunks, order, ghosts, adaptive state).
    fn clear(&mut self);
    /// The chunk's ref count became 0.
    fn mark_evictable(&mut self, chunk: ChunkId);
    /// The chunk's ref count left 0.
    fn mark_non_evictable(&mut self, chunk: ChunkId);
    /// Snapshot of the policy's order.
    fn state(&self) -> PolicyState;
    /// Check the policy's structures against the resident chunks and their ref counts.
    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()>;
    /// Start loading the policy's data of `chunk` into the cache (a batch about to use it);
    /// changes nothing. `chunk` may be any id, even one never inserted.
    fn prefetch(&self, _chunk: ChunkId) {}
    /// Set ARC's target size (tests only); `false` for policies without one.
    fn set_target(&mut self, _target: f64) -> bool {
        false
    }
    /// Whether a call since the last check failed, clearing the flag. Built-in policies never
    /// fail; an external policy (Python code) can raise, and the manager then undoes its call.
    fn failed(&mut self) -> bool {
        false
    }
    /// Chunk `chunk`'s ref count is now `ref_cnt` (-1 pending, 0 ready, n pinned). Called only
    /// for external policies, which mirror ref counts into the records they hold.
    fn set_ref(&mut self, _chunk: ChunkId, _ref_cnt: i32) {}
    /// The manager freed chunk `chunk`, which this policy's `evict` chose. Called only for
    /// external policies, which keep a record per chunk until the eviction is accepted.
    fn forget(&mut self, _chunk: ChunkId) {}
    /// The policy as `Any`, for a binding that must reach its own external policy type.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}
