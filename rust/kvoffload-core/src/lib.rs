//! kvoffload-core: the bookkeeping of a scheduler-side KV-cache offloading manager.
//!
//! A host pool of `num_chunks` slots holds offloaded KV blocks, one key per slot. The
//! [`Manager`] decides which keys to store, which to load back and which to evict, exactly as
//! vLLM 0.33.0's `CPUOffloadingManager` does, from these parts:
//! - [`ChunkPool`]: free slots, handed out in vLLM's order;
//! - [`Slots`]: -1 pending, 0 evictable, n pinned by n loads;
//! - [`AdmissionTracker`]: bounded offer counts for the store threshold;
//! - [`CachePolicy`]: [`LruPolicy`] and [`ArcPolicy`];
//! - [`RequestState`]: what one request saw, owned by the request;
//! - [`PendingWrites`]: the pending writes, oldest first, for their age and optional expiry.
//!
//! [`host`] holds the memory behind the chunk ids: a pre-faulted anonymous or `/dev/shm` region
//! cut into chunks, bounds-checked block transfers in and out of it, and an asynchronous job
//! queue for them.
//!
//! This crate has no Python in it; `kvoffload-py` binds it.

pub mod admission;
pub mod error;
pub mod host;
pub mod key;
pub mod liveness;
pub mod manager;
pub mod mem;
pub mod policy;
pub mod pool;
pub mod recycle;
pub mod request;
pub mod sketch;
pub mod table;

pub use admission::AdmissionTracker;
pub use error::{CoreError, Result};
pub use host::{ChunkLayout, HostPool, HostPoolOptions, Region, RegionOptions};
pub use key::{group_of, hash_key, KeyBuf};
pub use liveness::PendingWrites;
pub use manager::{
    Admission, Event, Hints, Lookup, Manager, ManagerConfig, PolicyKind, RawStats, StoreOutcome,
};
pub use policy::{ArcPolicy, CachePolicy, LruPolicy, PolicyState};
pub use pool::{ChunkId, ChunkPool};
pub use request::{RankTag, RequestState};
pub use table::{ChunkState, ChunkTable, Probe, Release, Slots, Unpinned};
