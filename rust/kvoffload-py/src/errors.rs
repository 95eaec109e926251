//! The one place where core errors become Python exceptions. The classes live in
//! `kvoffload.errors` (pure Python, so the reference implementation shares them); each
//! `CoreError` variant maps to exactly one of them.

use kvoffload_core::CoreError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyModule, PyType};

/// Name of the `kvoffload.errors` class that a core error variant maps to.
pub(crate) fn class_name(err: &CoreError) -> &'static str {
    match err {
        CoreError::InvalidArgument(_) => "InvalidArgumentError",
        CoreError::KeyState(_) | CoreError::Overflow(_) => "KeyStateError",
        CoreError::DuplicateKey(_) => "DuplicateKeyError",
        CoreError::RequestFinished(_) => "RequestFinishedError",
        CoreError::Invariant(_) => "InvariantViolation",
        CoreError::OutOfRange(_) => "BlockIndexError",
        CoreError::Os(_) => "HostMemoryError",
        CoreError::PageLock(_) => "PageLockError",
        CoreError::SharedRegion(_) => "SharedRegionError",
        CoreError::Closed(_) => "PoolClosedError",
        CoreError::Policy(_) => "PolicyError",
    }
}

/// `kvoffload.errors`, imported once: an error made later runs no import machinery (an import
/// hook is Python code, and errors are often made while a lock is held).
static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// An instance of the `kvoffload.errors` class `name` carrying `msg` (made when raised).
pub(crate) fn raise(py: Python<'_>, name: &str, msg: String) -> PyErr {
    let cls = ERRORS
        .get_or_try_init(py, || py.import("kvoffload.errors").map(Bound::unbind))
        .and_then(|m| m.bind(py).getattr(name))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
    match cls {
        Ok(cls) => PyErr::from_type(cls, msg),
        Err(e) => {
            PyRuntimeError::new_err(format!("kvoffload.errors.{name} unavailable ({e}): {msg}"))
        }
    }
}

/// Convert a core error.
#[allow(clippy::needless_pass_by_value)] // used as `map_err(|e| to_py(py, e))`
pub(crate) fn to_py(py: Python<'_>, err: CoreError) -> PyErr {
    let name = class_name(&err);
    raise(py, name, err.to_string())
}

/// A non-bytes key, or a key collection that is not an iterable.
pub(crate) fn invalid_key(py: Python<'_>, msg: String) -> PyErr {
    raise(py, "InvalidKeyError", msg)
}

/// A broken internal lock (only after a panic, which this crate does not raise).
pub(crate) fn poisoned(py: Python<'_>) -> PyErr {
    raise(
        py,
        "InvariantViolation",
        "internal lock poisoned by an earlier failure".into(),
    )
}

/// Raise the exception a given core variant maps to (for the test asserting each mapping).
#[pyfunction]
pub(crate) fn _raise_core_error(py: Python<'_>, variant: &str) -> PyResult<()> {
    let msg = format!("test {variant}");
    let err = match variant {
        "InvalidArgument" => CoreError::InvalidArgument(msg),
        "KeyState" => CoreError::KeyState(msg),
        "DuplicateKey" => CoreError::DuplicateKey(msg),
        "RequestFinished" => CoreError::RequestFinished(msg),
        "Overflow" => CoreError::Overflow(msg),
        "Invariant" => CoreError::Invariant(msg),
        "OutOfRange" => CoreError::OutOfRange(msg),
        "Os" => CoreError::Os(msg),
        "PageLock" => CoreError::PageLock(msg),
        "SharedRegion" => CoreError::SharedRegion(msg),
        "Closed" => CoreError::Closed(msg),
        "Policy" => CoreError::Policy(msg),
        other => {
            return Err(raise(
                py,
                "InvalidArgumentError",
                format!("unknown variant {other:?}"),
            ))
        }
    };
    Err(to_py(py, err))
}
