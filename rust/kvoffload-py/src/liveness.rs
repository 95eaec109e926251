//! The clock and the expiry setting of a `ManagerCore`'s pending writes (core: `liveness`).
//!
//! Readings come from the core's `monotonic_seconds` (`std::time::Instant`), which the core reads
//! itself when writes are placed, or from a Python callable given for tests, which is called with
//! no Rust lock held, once at the start of each call that needs the time.

use crate::errors::raise;
use kvoffload_core::liveness::monotonic_seconds;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt};

/// Where a manager's time comes from, and after how long a pending write expires.
pub(crate) struct Liveness {
    /// A Python callable returning seconds; `None`: `monotonic_seconds`.
    clock: Option<Py<PyAny>>,
    /// `None`: writes never expire (vLLM's behaviour).
    pub(crate) timeout: Option<f64>,
}

impl Liveness {
    /// Check `timeout` (`None`, or a number >= 0) and keep `clock` (`None`, or a callable).
    pub(crate) fn new(
        py: Python<'_>,
        timeout: Option<f64>,
        clock: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if let Some(t) = timeout.filter(|t| t.is_nan() || *t < 0.0) {
            return Err(raise(
                py,
                "InvalidArgumentError",
                format!("pending_write_timeout must be >= 0 or None, got {t}"),
            ));
        }
        if let Some(c) = clock.as_ref().filter(|c| !c.is_callable()) {
            return Err(raise(
                py,
                "InvalidArgumentError",
                format!(
                    "clock must be a callable returning seconds, got {}",
                    type_name(c)
                ),
            ));
        }
        Ok(Self {
            clock: clock.map(Bound::unbind),
            timeout,
        })
    }

    /// The core's own clock source, unless a Python clock replaces it.
    pub(crate) fn source(&self) -> Option<fn() -> f64> {
        self.clock
            .is_none()
            .then_some(monotonic_seconds as fn() -> f64)
    }

    /// The reading a `prepare_store` needs before its call: a Python clock's (always), or the
    /// core clock's when overdue writes are to expire; `None`: the core reads its own clock.
    pub(crate) fn store_reading(&self, py: Python<'_>) -> PyResult<Option<f64>> {
        if self.clock.is_some() || self.timeout.is_some() {
            self.now(py).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The time now, in seconds. A clock's reading must be a finite int or float.
    pub(crate) fn now(&self, py: Python<'_>) -> PyResult<f64> {
        let Some(clock) = &self.clock else {
            return Ok(monotonic_seconds());
        };
        let value = clock.bind(py).call0()?;
        let number = !value.is_instance_of::<PyBool>()
            && (value.is_instance_of::<PyFloat>() || value.is_instance_of::<PyInt>());
        match value.extract::<f64>() {
            Ok(t) if number && t.is_finite() => Ok(t),
            _ => Err(raise(
                py,
                "InvalidArgumentError",
                format!(
                    "clock must return a finite int or float, got {}",
                    value
                        .repr()
                        .map_or_else(|_| type_name(&value), |r| r.to_string())
                ),
            )),
        }
    }

    /// The timeout of an explicit expiry: `timeout` if given, else the manager's.
    pub(crate) fn timeout_for(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<f64> {
        match timeout.or(self.timeout) {
            Some(t) if t >= 0.0 => Ok(t),
            Some(t) => Err(raise(
                py,
                "InvalidArgumentError",
                format!("timeout must be >= 0, got {t}"),
            )),
            None => Err(raise(
                py,
                "InvalidArgumentError",
                "no timeout: pass one, or build the manager with pending_write_timeout".into(),
            )),
        }
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}
