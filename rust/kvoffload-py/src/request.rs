//! `RequestState`: the core's per-request state, stored on the request context under this
//! class (``ctx.set_state(state)``), so it lives and dies with the request.

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
