//! `PolicyCore`: kvoffload-core's LRU and ARC policies behind the calls of vLLM's `CachePolicy`
//! API, so vLLM's own Python manager can run them (`kvoffload.integrations.vllm.RustLRU`, ...).
//!
//! vLLM's manager owns the chunk pool and the `ChunkStatus` objects and changes their ref counts
//! itself; it tells the policy at every transition that matters (`insert` pending,
//! `mark_evictable` on reaching 0, `mark_non_evictable` on leaving 0, `remove` of a failed store).
//! This binding keeps its own slot per resident key (the core policies index chunks by slot), a
//! key -> slot table, the key and chunk objects each slot was inserted with (handed back as they
//! are by `get` and `evict`), and a [`RefCountTable`] mirroring each slot's state from those
//! calls: pending, evictable (0) or pinned (shown as 1 whatever the real count).
//!
//! Every method crosses into Rust once: arguments (keys, token positions, the request's rank) are
//! read first, the lock is taken for the pure-Rust work only, and the results are built after it
//! is released.

pub(crate) mod external;
mod slots;
pub(crate) mod state;

use crate::errors::{invalid_key, poisoned, raise, to_py};
use crate::keys::{one_key, Context, Keys};
use crate::request::PolicyRequestRank;
use kvoffload_core::policy::{Access, FinishedKey, RequestRank};
use kvoffload_core::table::{storable_len, MAX_KEY_LEN};
use kvoffload_core::{hash_key, ChunkId, ChunkState, PolicyKind, Slots};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PySet, PyTuple};
use slots::Inner;
use state::{state_dict, state_keys};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Owner ids of policies, so a request's rank is only read back by the policy that issued it.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// A kvoffload-core policy (any of the nine built-in ones) run through vLLM's `CachePolicy`
/// calls.
#[pyclass(frozen, module = "kvoffload._native")]
pub(crate) struct PolicyCore {
    inner: Mutex<Inner>,
    owner: u64,
    /// The policy's name.
    name: &'static str,
    /// Whether the policy reads token positions on insert and access (LRU does; ARC does not).
    reads_positions: bool,
}

impl PolicyCore {
    /// The policy, locked; a contended lock is waited for detached from the interpreter (see
    /// `ManagerCore::acquire`). No Python code runs while it is held.
    fn lock(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, Inner>> {
        self.inner.lock_py_attached(py).map_err(|_| poisoned(py))
    }

    /// `(owner, generation, rank)` of the rank this context holds, if any.
    fn stored_rank(py: Python<'_>, ctx: &Context<'_>) -> PyResult<Option<(u64, u64, u64)>> {
        let cls = py.get_type::<PolicyRequestRank>();
        Ok(ctx
            .get_state(&cls)?
            .and_then(|obj| obj.cast_into::<PolicyRequestRank>().ok())
            .map(|r| {
                let r = r.get();
                (r.owner, r.generation, r.rank)
            }))
    }

    /// Store a rank issued during a call on the context.
    fn save_rank(
        &self,
        py: Python<'_>,
        ctx: &Context<'_>,
        before: RequestRank,
        after: RequestRank,
        generation: u64,
    ) -> PyResult<()> {
        match after {
            Some(rank) if before != after => {
                let state = Bound::new(
                    py,
                    PolicyRequestRank {
                        owner: self.owner,
                        generation,
                        rank,
                    },
                )?;
                ctx.set_state(state.as_any())
            }
            _ => Ok(()),
        }
    }
}

fn key_state_error(py: Python<'_>, msg: String) -> PyErr {
    raise(py, "KeyStateError", msg)
}

#[pymethods]
impl PolicyCore {
    /// A built-in policy named `policy` for `capacity` chunks.
    #[new]
    fn new(py: Python<'_>, policy: &str, capacity: &Bound<'_, PyAny>) -> PyResult<Self> {
        // An int (not a bool) that fits: anything else is refused from kvoffload's tree.
        let fits = (!capacity.is_instance_of::<PyBool>())
            .then(|| capacity.extract::<u32>().ok())
            .flatten();
        let Some(capacity) = fits else {
            let shown = capacity
                .repr()
                .map_or_else(|_| "?".into(), |r| r.to_string());
            return Err(raise(
                py,
                "InvalidArgumentError",
                format!("cache_capacity must be an int in [0, 2**32 - 1], got {shown}"),
            ));
        };
        // Every built-in kind: vLLM's manager calls the hooks where kvoffload's manager does,
        // so a policy behaves in it as in kvoffload's manager (and LRU and ARC as vLLM's own).
        let Some(kind) = PolicyKind::from_name(policy) else {
            return Err(raise(
                py,
                "UnsupportedPolicyError",
                format!("no built-in policy {policy:?}"),
            ));
        };
        let (name, reads_positions, policy) =
            (kind.name(), kind.reads_positions(), kind.build(capacity));
        let slots = Slots::new(capacity).ok_or_else(|| {
            raise(
                py,
                "InvalidArgumentError",
                format!("cannot map the tables of {capacity} slots"),
            )
        })?;
        Ok(Self {
            inner: Mutex::new(Inner {
                policy,
                slots,
                objs: Vec::new(),
                free: Vec::new(),
                generation: 0,
            }),
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            name,
            reads_positions,
        })
    }

    /// The chunk object `key` was inserted with, or `None`.
    fn get(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyAny>>> {
        let key = one_key(key)?;
        let m = self.lock(py)?;
        Ok(m.find(key, hash_key(key))
            .and_then(|c| m.objs[c as usize].as_ref().map(|(_, o)| o.clone_ref(py))))
    }

    /// Add `key` with its `chunk` (a `ChunkStatus`; its `ref_cnt` gives the state: -1 pending,
    /// 0 evictable, more pinned), placed by the storing request's context.
    fn insert(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        chunk: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        one_key(key)?;
        let key_obj = key.cast::<PyBytes>()?;
        if !storable_len(key_obj.as_bytes().len()) {
            return Err(raise(
                py,
                "InvalidArgumentError",
                format!("the key is too long to store ({MAX_KEY_LEN} bytes at most)"),
            ));
        }
        let ref_cnt: i64 = chunk
            .getattr(intern!(py, "ref_cnt"))
            .and_then(|r| r.extract())
            .map_err(|_| {
                let ty = crate::keys::type_name(chunk);
                let msg = format!("chunk must be a ChunkStatus (an int ref_cnt), got {ty}");
                raise(py, "InvalidArgumentError", msg)
            })?;
        let (position, stored) = if self.reads_positions {
            let ctx = Context::new(req_context)?;
            let position = ctx.position(key)?;
            let stored = if position.is_some() {
                Self::stored_rank(py, &ctx)?
            } else {
                None
            };
            (position, Some((ctx, stored)))
        } else {
            (None, None)
        };
        let bytes = key_obj.as_bytes();
        let (before, after, generation) = {
            let mut m = self.lock(py)?;
            let hash = hash_key(bytes);
            if m.find(bytes, hash).is_some() {
                drop(m);
                return Err(key_state_error(
                    py,
                    format!("key {key_obj:?} is already resident"),
                ));
            }
            let objs = (key_obj.clone().unbind(), chunk.clone().unbind());
            let Some(c) = m.occupy(bytes, hash, objs) else {
                let capacity = m.slots.capacity();
                drop(m);
                return Err(key_state_error(
                    py,
                    format!("cannot insert {key_obj:?}: all {capacity} slots hold keys"),
                ));
            };
            let before = stored
                .as_ref()
                .and_then(|(_, s)| m.current_rank(self.owner, *s));
            let mut rank = before;
            let access = Access {
                key: bytes,
                hash,
                chunk: None,
                position,
            };
            m.policy.insert(c, access, &mut rank);
            if ref_cnt >= 0 {
                m.slots.complete_store(c);
                if ref_cnt == 0 {
                    m.policy.mark_evictable(c);
                } else {
                    m.slots.pin(c);
                }
            }
            (before, rank, m.generation)
        };
        if let Some((ctx, _)) = stored {
            self.save_rank(py, &ctx, before, after, generation)?;
        }
        Ok(())
    }

    /// Forget a pending `key` whose store failed (an absent key is ignored).
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = one_key(key)?;
        let released = {
            let mut m = self.lock(py)?;
            let Some(c) = m.find(key, hash_key(key)) else {
                return Ok(());
            };
            if m.slots.state(c) != ChunkState::Pending {
                drop(m);
                return Err(key_state_error(
                    py,
                    "only a pending chunk (a failed store) can be removed".into(),
                ));
            }
            m.policy.remove(c);
            m.vacate(c)
        };
        drop(released);
        Ok(())
    }

    /// Mark keys as recently used (absent keys included: ARC learns from its ghost lists).
    fn touch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let _ = req_context;
        let keys = Keys::extract(keys)?;
        let slices = keys.slices();
        let mut m = self.lock(py)?;
        let access: Vec<Access<'_>> = slices.iter().map(|k| m.access(k, None)).collect();
        let inner = &mut *m;
        inner.policy.touch(&access, &inner.slots);
        Ok(())
    }

    /// Keys about to be stored, seen as misses (ARC adapts to ghost hits).
    fn on_store_miss(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let _ = req_context;
        let keys = Keys::extract(keys)?;
        let slices = keys.slices();
        let mut m = self.lock(py)?;
        let access: Vec<Access<'_>> = slices.iter().map(|k| m.access(k, None)).collect();
        if self.reads_positions {
            // vLLM's LRU keeps CachePolicy's default: a store miss is a touch. (Its manager only
            // reports absent keys, for which a touch changes nothing; the core LRU relies on that.)
            let inner = &mut *m;
            inner.policy.touch(&access, &inner.slots);
        } else {
            m.policy.on_store_miss(&access);
        }
        Ok(())
    }

    /// Keys a request sees for the first time (LRU ranks them by token position; for
    /// kvoffload's own policies a first access to a resident key is a hit).
    fn on_request_access(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        if !self.reads_positions {
            // No rank and no positions: ARC ignores the call, the others count hits.
            let keys = Keys::extract(keys)?;
            let slices = keys.slices();
            let mut m = self.lock(py)?;
            let access: Vec<Access<'_>> = slices.iter().map(|k| m.access(k, None)).collect();
            m.policy.on_request_access(&access, &mut None);
            return Ok(());
        }
        let keys = Keys::extract(keys)?;
        let ctx = Context::new(req_context)?;
        let positions = keys
            .objs()
            .iter()
            .map(|k| ctx.position(k.as_any()))
            .collect::<PyResult<Vec<_>>>()?;
        let stored = Self::stored_rank(py, &ctx)?;
        let slices = keys.slices();
        let (before, after, generation) = {
            let mut m = self.lock(py)?;
            let access: Vec<Access<'_>> = slices
                .iter()
                .zip(&positions)
                .map(|(k, &p)| m.access(k, p))
                .collect();
            let before = m.current_rank(self.owner, stored);
            let mut rank = before;
            m.policy.on_request_access(&access, &mut rank);
            (before, rank, m.generation)
        };
        self.save_rank(py, &ctx, before, after, generation)
    }

    /// A request finished: `key_groups` holds its keys per KV group, head to tail; the keys are
    /// put in one head-to-tail order (by token position when every key has one) for the policy.
    fn on_request_finished(
        &self,
        py: Python<'_>,
        key_groups: &Bound<'_, PyAny>,
        insertion_only_keys: &Bound<'_, PyAny>,
        reused_keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut objs: Vec<Bound<'_, PyBytes>> = Vec::new();
        let groups = key_groups.try_iter().map_err(|_| {
            let ty = crate::keys::type_name(key_groups);
            invalid_key(
                py,
                format!("key_groups must be an iterable of key lists, got {ty}"),
            )
        })?;
        for group in groups {
            objs.extend(Keys::extract(&group?)?.into_objs());
        }
        let ctx = Context::new(req_context)?;
        let mut positions = Vec::with_capacity(objs.len());
        for k in &objs {
            match ctx.position(k.as_any())? {
                Some(p) => positions.push(p),
                None => break,
            }
        }
        let mut order: Vec<usize> = (0..objs.len()).collect();
        if positions.len() == objs.len() {
            order.sort_by_key(|&i| positions[i]); // stable, as Python's sort
        }
        let contains = |set: &Bound<'_, PyAny>, k: &Bound<'_, PyBytes>| -> PyResult<bool> {
            match set.cast::<PySet>() {
                Ok(s) => s.contains(k),
                Err(_) => set.contains(k),
            }
        };
        let mut flags = Vec::with_capacity(objs.len());
        for &i in &order {
            let k = &objs[i];
            flags.push((
                i,
                contains(insertion_only_keys, k)?,
                contains(reused_keys, k)?,
            ));
        }
        let mut m = self.lock(py)?;
        let finished: Vec<FinishedKey<'_>> = flags
            .iter()
            .map(|&(i, inserted_only, reused)| {
                let key = objs[i].as_bytes();
                FinishedKey {
                    key,
                    chunk: m.find(key, hash_key(key)),
                    inserted_only,
                    reused,
                }
            })
            .collect();
        m.policy.on_request_finished(&finished);
        Ok(())
    }

    /// Evict exactly `n` evictable chunks whose keys are not in `protected`: a list of
    /// `(key, chunk)` in eviction order, or `None` (and no change) when there are not `n`.
    fn evict<'py>(
        &self,
        py: Python<'py>,
        n: &Bound<'py, PyAny>,
        protected: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let n: usize = n.extract().map_err(|_| {
            let msg = format!(
                "n must be an int >= 0, got {}",
                n.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            );
            raise(py, "InvalidArgumentError", msg)
        })?;
        if n == 0 {
            return Ok(Some(PyList::empty(py)));
        }
        let protected = Keys::extract(protected)?;
        let slices = protected.slices();
        let released = {
            let mut m = self.lock(py)?;
            let mut shielded: Vec<ChunkId> = slices
                .iter()
                .filter_map(|k| m.find(k, hash_key(k)))
                .collect();
            shielded.sort_unstable();
            shielded.dedup();
            // The same feasibility rule as kvoffload's manager (vLLM's checks only the evictable
            // count, and kvoffload's policies assume a feasible request).
            let shielded_ready = shielded.iter().filter(|&&c| m.slots.raw(c) == 0).count();
            if !m.slots.can_evict(n, shielded_ready) {
                return Ok(None);
            }
            let is_protected = |c: ChunkId| shielded.binary_search(&c).is_ok();
            let mut victims = Vec::with_capacity(n);
            let inner = &mut *m;
            if !inner
                .policy
                .evict(n, &is_protected, &inner.slots, &mut victims)
            {
                return Ok(None);
            }
            victims.iter().map(|&c| m.vacate(c)).collect::<Vec<_>>()
        };
        let out = PyList::empty(py);
        for (key, chunk) in released.into_iter().flatten() {
            out.append(PyTuple::new(py, [key.into_any(), chunk])?)?;
        }
        Ok(Some(out))
    }

    /// Forget every chunk, the order, ghost lists and adaptive state; request ranks go stale.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let released = {
            let mut m = self.lock(py)?;
            m.policy.clear();
            m.slots.clear();
            m.free.clear();
            m.generation += 1;
            std::mem::take(&mut m.objs)
        };
        drop(released);
        Ok(())
    }

    /// `key`'s ref count became 0 (its store completed, or its last load did).
    fn mark_evictable(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = one_key(key)?;
        let mut m = self.lock(py)?;
        let Some(c) = m.find(key, hash_key(key)) else {
            drop(m);
            return Err(key_state_error(
                py,
                "mark_evictable of an absent key".into(),
            ));
        };
        let changed = match m.slots.state(c) {
            ChunkState::Pending => m.slots.complete_store(c),
            ChunkState::Ready(n) if n > 0 => m.slots.unpin_all(&[c]).is_ok_and(|z| z.get(0)),
            _ => false,
        };
        if !changed {
            drop(m);
            return Err(key_state_error(py, "the chunk is already evictable".into()));
        }
        m.policy.mark_evictable(c);
        Ok(())
    }

    /// `key`'s ref count left 0 (a load pinned it).
    fn mark_non_evictable(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = one_key(key)?;
        let mut m = self.lock(py)?;
        let c = m
            .find(key, hash_key(key))
            .filter(|&c| m.slots.state(c) == ChunkState::Ready(0));
        let Some(c) = c else {
            drop(m);
            return Err(key_state_error(
                py,
                "mark_non_evictable of a key that is not evictable".into(),
            ));
        };
        m.slots.pin(c);
        m.policy.mark_non_evictable(c);
        Ok(())
    }

    /// The policy's order, in the layout of `CPUOffloadingManager.policy_state()`.
    fn policy_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (state, keys) = {
            let m = self.lock(py)?;
            let state = m.policy.state();
            let keys = state_keys(&state, |c| m.slots.key(c).to_vec());
            (state, keys)
        };
        state_dict(py, self.name, state, &keys)
    }

    /// Number of resident keys.
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.slots.len())
    }

    /// Raise `InvariantViolation` if the policy's structures disagree with the slots.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let result = {
            let m = self.lock(py)?;
            let resident: Vec<bool> = (0..m.slots.used() as ChunkId)
                .map(|c| m.slots.resident(c))
                .collect();
            m.policy.validate(&resident, &m.slots)
        };
        result.map_err(|e| to_py(py, e))
    }
}
