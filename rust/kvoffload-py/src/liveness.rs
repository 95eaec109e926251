//! The clock and the expiry setting of a `ManagerCore`'s pending writes (core: `liveness`).
//!
//! Readings come from `std::time::Instant` (seconds since the manager was built), or from a
//! Python callable given for tests; that one is called with no Rust lock held.

use crate::errors::raise;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt};
use std::time::Instant;

/// Where a manager's time comes from, and after how long a pending write expires.
pub(crate) struct Liveness {
    /// A Python callable returning seconds; `None`: `Instant`, from `epoch`.
    clock: Option<Py<PyAny>>,
    epoch: Instant,
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
            epoch: Instant::now(),
            timeout,
        })
    }

    /// The time now, in seconds. A clock's reading must be a finite int or float.
    pub(crate) fn now(&self, py: Python<'_>) -> PyResult<f64> {
        let Some(clock) = &self.clock else {
            return Ok(self.epoch.elapsed().as_secs_f64());
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
