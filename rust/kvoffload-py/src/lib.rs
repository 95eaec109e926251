//! `kvoffload._native`: `PyO3` bindings of kvoffload-core. Only module exports live here.

mod errors;
mod fastcall;
mod host;
mod keys;
mod lists;
mod liveness;
mod manager;
mod policy;
mod request;

use pyo3::prelude::*;

/// The private native module of kvoffload.
#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<manager::ManagerCore>()?;
    m.add_class::<request::RequestState>()?;
    m.add_class::<request::RequestRankCell>()?;
    m.add_class::<host::HostMemory>()?;
    m.add_class::<host::HostMemoryOwner>()?;
    m.add_class::<policy::PolicyCore>()?;
    m.add_class::<request::PolicyRequestRank>()?;
    m.add_function(wrap_pyfunction!(keys::register_context_type, m)?)?;
    m.add_function(wrap_pyfunction!(errors::_raise_core_error, m)?)?;
    m.add_function(wrap_pyfunction!(lists::_list_access, m)?)?;
    m.add_function(wrap_pyfunction!(host::_before_fork, m)?)?;
    m.add_function(wrap_pyfunction!(host::_after_fork_in_parent, m)?)?;
    m.add_function(wrap_pyfunction!(host::_after_fork_in_child, m)?)?;
    m.add_function(wrap_pyfunction!(manager::_managers_before_fork, m)?)?;
    m.add_function(wrap_pyfunction!(
        manager::_managers_after_fork_in_parent,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(manager::_managers_after_fork_in_child, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
