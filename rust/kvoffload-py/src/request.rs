//! Per-request state stored on the request context under its class (``ctx.set_state(state)``),
//! so it lives and dies with the request: `RequestState` (a `ManagerCore`'s), `RequestRankCell`
//! (a `ManagerCore`'s LRU rank) and `PolicyRequestRank` (a `PolicyCore`'s LRU rank).

use kvoffload_core as core;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::PyBytes;
use std::sync::atomic::{AtomicIsize, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

/// How many forks this process descends from, as counted by the fork hook in the child
/// (`manager::_managers_after_fork_in_child`): a state's holder marked in an earlier count was
/// a thread of a parent, which this process does not have.
pub(crate) static FORK_EPOCH: AtomicU64 = AtomicU64::new(0);

/// Opaque per-request state of a `ManagerCore`, kept on the request context.
#[pyclass(frozen, module = "kvoffload._native")]
pub(crate) struct RequestState {
    pub(crate) inner: Mutex<core::RequestState>,
    /// The key object each seen key was first offered as, by its index among the core state's
    /// seen keys: `on_request_finished` asks the context for positions with these objects, as
    /// vLLM does with the keys it recorded. An entry is used only while it holds its seen key's
    /// bytes (`None`, or out of step after a race on one context: the bytes are used instead).
    pub(crate) objs: Mutex<Vec<Option<Py<PyBytes>>>>,
    /// Where the request's last recording call left its walk of the context's positions dict
    /// (a hint: see `keys::walk_dict`).
    pub(crate) cursor: AtomicIsize,
    /// The mark of the thread holding `inner` while a Python cache policy runs (0: none). That
    /// thread must not lock `inner` again (from inside the policy): it would wait on itself.
    holder: AtomicUsize,
    /// [`FORK_EPOCH`] when `holder` was set.
    holder_epoch: AtomicU64,
    /// With an LRU manager: the context's rank cell, where a rank this state draws is kept.
    pub(crate) rank_cell: Option<Py<RequestRankCell>>,
}

/// Why [`RequestState::lock_attached`] gave no guard.
pub(crate) enum StateLockError {
    Poisoned,
    /// The calling thread holds the state already: a manager call runs its Python policy.
    InUse,
    /// A Python policy's call on another thread held it when this process was forked (this is
    /// the child): no thread here will release it.
    Orphaned,
}

impl RequestState {
    pub(crate) fn new(inner: core::RequestState, rank_cell: Option<Py<RequestRankCell>>) -> Self {
        Self {
            inner: Mutex::new(inner),
            objs: Mutex::new(Vec::new()),
            cursor: AtomicIsize::new(0),
            holder: AtomicUsize::new(0),
            holder_epoch: AtomicU64::new(0),
            rank_cell,
        }
    }

    /// Keep in the context's rank cell the rank that a call drew for `s` (this state's core,
    /// locked; `before`: its rank when the call began). No Python runs: a plain store.
    #[inline]
    pub(crate) fn keep_rank(&self, before: Option<core::RankTag>, s: &core::RequestState) {
        if let Some(cell) = &self.rank_cell {
            let after = s.rank_tag();
            if after.is_some() && after != before {
                cell.get().keep(after);
            }
        }
    }

    /// Lock the state for a call; the wait is detached from the interpreter (`py`), so that a
    /// holder running a Python policy can go on. Refused when the calling thread holds it
    /// itself (a policy handing its context to a manager call).
    #[inline]
    pub(crate) fn lock_attached(
        &self,
        py: Python<'_>,
    ) -> Result<MutexGuard<'_, core::RequestState>, StateLockError> {
        self.lock_with(|m| m.lock_py_attached(py))
    }

    /// Lock the state from a detached call (see [`lock_attached`](Self::lock_attached)).
    pub(crate) fn lock_detached(
        &self,
    ) -> Result<MutexGuard<'_, core::RequestState>, StateLockError> {
        self.lock_with(Mutex::lock)
    }

    /// Take the lock at once if free; else, unless this thread holds it, wait with `wait`.
    #[inline]
    fn lock_with<'s>(
        &'s self,
        wait: impl FnOnce(
            &'s Mutex<core::RequestState>,
        ) -> std::sync::LockResult<MutexGuard<'s, core::RequestState>>,
    ) -> Result<MutexGuard<'s, core::RequestState>, StateLockError> {
        match self.inner.try_lock() {
            Ok(guard) => return Ok(guard),
            Err(TryLockError::Poisoned(_)) => return Err(StateLockError::Poisoned),
            Err(TryLockError::WouldBlock) => {}
        }
        let holder = self.holder.load(Ordering::Acquire);
        if holder == crate::manager::thread_mark() {
            return Err(StateLockError::InUse);
        }
        if holder != 0
            && self.holder_epoch.load(Ordering::Relaxed) != FORK_EPOCH.load(Ordering::Relaxed)
        {
            return Err(StateLockError::Orphaned);
        }
        wait(&self.inner).map_err(|_| StateLockError::Poisoned)
    }

    /// Mark the state held by the thread `mark` (0: by none) while its guard is kept across a
    /// Python policy's calls.
    pub(crate) fn set_holder(&self, mark: usize) {
        self.holder_epoch
            .store(FORK_EPOCH.load(Ordering::Relaxed), Ordering::Relaxed);
        self.holder.store(mark, Ordering::Release);
    }

    /// Disown a state that a failed call gave its request (see `core::RequestState::disown`):
    /// the context keeps the object, but no manager counts it as state, as if the call had
    /// never installed it.
    pub(crate) fn disown(&self) {
        if let Ok(mut s) = self.inner.lock() {
            s.disown();
        }
    }

    /// Keep the objects of the keys a successful recording call added to the seen keys: the
    /// seen keys numbered `mark` on are `keys[i]` for `i` in `added`, in order.
    pub(crate) fn keep_objects(&self, mark: usize, added: &[u32], keys: &[Bound<'_, PyBytes>]) {
        let Ok(mut objs) = self.objs.lock() else {
            return;
        };
        // Objects past `mark` (a state renewed in place) are released after the lock: a
        // decref may run Python code, which may come back for this state.
        let stale = if objs.len() > mark {
            objs.split_off(mark)
        } else {
            Vec::new()
        };
        // Grown like the core's seen keys (a request's first batch makes room for many).
        let need = (mark + added.len()).saturating_sub(objs.len());
        if objs.capacity() - objs.len() < need {
            let extra = core::request::room_for(objs.len(), need);
            objs.reserve_exact(extra);
        }
        objs.resize_with(mark, || None);
        objs.extend(
            added
                .iter()
                .map(|&i| keys.get(i as usize).map(|k| k.clone().unbind())),
        );
        drop(objs);
        drop(stale);
    }
}

#[pymethods]
impl RequestState {
    /// Whether the request has finished (for this manager and generation). Raises
    /// `ReentrantCallError` inside a Python policy's call that holds the state.
    // Both read the state under its lock, waited for detached: a manager call may hold it while
    // a Python policy runs, and a thread blocked attached would hold up the free-threaded
    // build's stop-the-world pauses, that call's included.
    #[getter]
    fn finished(&self, py: Python<'_>) -> PyResult<bool> {
        match self.lock_attached(py) {
            Ok(s) => Ok(s.is_finished()),
            Err(StateLockError::Poisoned) => Ok(false),
            Err(StateLockError::InUse) => Err(in_use(py)),
            Err(StateLockError::Orphaned) => Err(orphaned(py)),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.lock_attached(py) {
            Ok(s) => format!(
                "<RequestState seen={} finished={}>",
                s.seen_keys().len(),
                s.is_finished()
            ),
            Err(StateLockError::Poisoned) => "<RequestState (poisoned)>".into(),
            Err(StateLockError::InUse) => "<RequestState (in use by a manager call)>".into(),
            Err(StateLockError::Orphaned) => {
                "<RequestState (held by a call the process was forked in the middle of)>".into()
            }
        }
    }
}

/// The error for a request state locked again by the thread whose manager call holds it.
pub(crate) fn in_use(py: Python<'_>) -> PyErr {
    crate::errors::raise(
        py,
        "ReentrantCallError",
        "the request's state is held by a manager call running its cache policy on this \
         thread; a policy must not read it or pass the request context to a manager"
            .into(),
    )
}

/// The error for a request state that a call on another thread held when this process forked.
pub(crate) fn orphaned(py: Python<'_>) -> PyErr {
    crate::errors::raise(
        py,
        "ForkedWhileBusyError",
        "this process was forked while a manager call on another thread held the request's \
         state (its Python cache policy did not return in time); that call never ends in the \
         forked child, so the state cannot be read here"
            .into(),
    )
}

/// The rank a `PolicyCore` gave one request; read back only by the same policy in the same cache
/// generation (vLLM's LRU tags its request rank the same way).
#[pyclass(frozen, module = "kvoffload._native")]
pub(crate) struct PolicyRequestRank {
    pub(crate) owner: u64,
    pub(crate) generation: u64,
    pub(crate) rank: u64,
}

/// A request's LRU rank as a `ManagerCore` drew it, tagged with the manager and its cache
/// generation; kept on the request context apart from `RequestState`.
///
/// Another manager's call replaces the request state on a shared context but leaves this cell,
/// so a fresh state of the manager that drew the rank takes it up again, as vLLM's LRU keeps
/// its request rank apart from its manager's request state. A manager that draws a rank writes
/// it here in place: nothing is set on the context after a call has changed anything.
#[pyclass(frozen, module = "kvoffload._native")]
pub(crate) struct RequestRankCell {
    tag: Mutex<Option<core::RankTag>>,
}

impl RequestRankCell {
    pub(crate) fn new() -> Self {
        Self {
            tag: Mutex::new(None),
        }
    }

    /// The rank kept, if any (none in a cell poisoned by a panic, which no call makes).
    pub(crate) fn tag(&self) -> Option<core::RankTag> {
        self.tag.lock().map_or(None, |t| *t)
    }

    /// Let a fresh `state` take up the rank kept here, if its manager drew it in its cache
    /// generation (see `core::RequestState::adopt_rank`).
    pub(crate) fn offer_to(&self, state: &mut core::RequestState) {
        if let Some(tag) = self.tag() {
            state.adopt_rank(tag);
        }
    }

    /// Keep `tag`, replacing the rank kept before.
    pub(crate) fn keep(&self, tag: Option<core::RankTag>) {
        if let Ok(mut t) = self.tag.lock() {
            *t = tag;
        }
    }
}

#[pymethods]
impl RequestRankCell {
    fn __repr__(&self) -> String {
        match self.tag() {
            Some(t) => format!("<RequestRankCell rank={}>", t.rank),
            None => "<RequestRankCell (no rank)>".into(),
        }
    }
}
