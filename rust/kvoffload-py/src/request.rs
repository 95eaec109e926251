//! Per-request state stored on the request context under its class (``ctx.set_state(state)``),
//! so it lives and dies with the request: `RequestState` (a `ManagerCore`'s) and
//! `PolicyRequestRank` (a `PolicyCore`'s LRU rank).

use kvoffload_core as core;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::PyBytes;
use std::sync::atomic::AtomicIsize;
use std::sync::Mutex;

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
    /// (a hint: see `keys::DictWalk`).
    pub(crate) cursor: AtomicIsize,
}

impl RequestState {
    pub(crate) fn new(inner: core::RequestState) -> Self {
        Self {
            inner: Mutex::new(inner),
            objs: Mutex::new(Vec::new()),
            cursor: AtomicIsize::new(0),
        }
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
        if let Ok(mut objs) = self.objs.lock() {
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
        }
    }
}

#[pymethods]
impl RequestState {
    /// Whether the request has finished (for this manager and generation).
    // Both read the state under its lock, waited for detached: a manager call may hold it while
    // a Python policy runs, and a thread blocked attached would hold up the free-threaded
    // build's stop-the-world pauses, that call's included.
    #[getter]
    fn finished(&self, py: Python<'_>) -> bool {
        self.inner
            .lock_py_attached(py)
            .is_ok_and(|s| s.is_finished())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.inner.lock_py_attached(py) {
            Ok(s) => format!(
                "<RequestState seen={} finished={}>",
                s.seen_keys().len(),
                s.is_finished()
            ),
            Err(_) => "<RequestState (poisoned)>".into(),
        }
    }
}

/// The rank a `PolicyCore` gave one request; read back only by the same policy in the same cache
/// generation (vLLM's LRU tags its request rank the same way).
#[pyclass(frozen, module = "kvoffload._native")]
pub(crate) struct PolicyRequestRank {
    pub(crate) owner: u64,
    pub(crate) generation: u64,
    pub(crate) rank: u64,
}
