//! Per-request state stored on the request context under its class (``ctx.set_state(state)``),
//! so it lives and dies with the request: `RequestState` (a `ManagerCore`'s) and
//! `PolicyRequestRank` (a `PolicyCore`'s LRU rank).

use kvoffload_core as core;
use pyo3::prelude::*;
use std::sync::Mutex;

/// Opaque per-request state of a `ManagerCore`, kept on the request context.
#[pyclass(frozen, module = "kvoffload._native")]
pub(crate) struct RequestState {
    pub(crate) inner: Mutex<core::RequestState>,
}

#[pymethods]
impl RequestState {
    /// Whether the request has finished (for this manager and generation).
    #[getter]
    fn finished(&self) -> bool {
        self.inner.lock().is_ok_and(|s| s.is_finished())
    }

    fn __repr__(&self) -> String {
        match self.inner.lock() {
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
