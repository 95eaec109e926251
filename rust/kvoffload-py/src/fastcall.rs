//! `ManagerCore.lookup` as a builtin the interpreter calls directly.
//!
//! A scheduler looks keys up one call per key, so a call's fixed cost is most of a lookup's:
//! `PyO3`'s method wrapper (its trampoline and keyword-aware argument parser) took about 150 of
//! the ~420 instructions of a one-key call. [`bind_lookup`] makes a builtin function bound to
//! one core (`PyCMethod_New` with the core as its `self`) whose C function takes the vectorcall
//! arguments as they come: one or two positional arguments go straight to the same body as
//! the method; any other shape (keywords, a wrong count) is handed to the method itself, so
//! errors and keyword handling stay exactly `PyO3`'s. A panic is caught here and raised as
//! `PanicException`, as `PyO3` does; none is expected.

use crate::manager::ManagerCore;
use pyo3::ffi;
use pyo3::panic::PanicException;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// A method definition the interpreter reads (never writes) for as long as the process lives.
struct MethodDef(ffi::PyMethodDef);

// SAFETY: the definition is a constant: its pointers are to static C strings and a function,
// and neither this crate nor the interpreter ever writes through it.
unsafe impl Sync for MethodDef {}

static LOOKUP: MethodDef = MethodDef(ffi::PyMethodDef {
    ml_name: c"lookup".as_ptr(),
    ml_meth: ffi::PyMethodDefPointer {
        PyCFunctionFastWithKeywords: lookup,
    },
    ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
    ml_doc: c"lookup(key, req_context=None)\n--\n\n`LookupResult.MISS`, `.HIT` or `.HIT_PENDING`; \
the context is not read."
        .as_ptr(),
});

/// `core.lookup` as a builtin bound to `core`.
pub(crate) fn bind_lookup<'py>(core: &Bound<'py, ManagerCore>) -> PyResult<Bound<'py, PyAny>> {
    let py = core.py();
    // SAFETY: `LOOKUP` is a valid, immortal definition of a METH_FASTCALL | METH_KEYWORDS
    // function (the interpreter only reads it, so the pointer's mutability is never used);
    // `core` is a live object, which the new function holds a reference to as its `self`. The
    // call returns a new reference or null with an exception set.
    let f = unsafe {
        ffi::PyCMethod_New(
            (&raw const LOOKUP.0).cast_mut(),
            core.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    if f.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new, non-null reference (above).
    Ok(unsafe { Bound::from_owned_ptr(py, f) })
}

/// The C function of [`LOOKUP`]: `slf` is the bound core, `args` the `nargs` positional
/// arguments followed by one value per name in `kwnames` (null: none).
unsafe extern "C" fn lookup(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: the interpreter calls a builtin's C function with the calling thread attached.
    let py = unsafe { Python::assume_attached() };
    let out = std::panic::catch_unwind(|| {
        // SAFETY: `slf` is the `self` that `bind_lookup` bound, a live `ManagerCore` (the
        // function holds a reference to it for as long as it exists).
        let core =
            unsafe { Bound::from_borrowed_ptr(py, slf).cast_into_unchecked::<ManagerCore>() };
        if kwnames.is_null() && (nargs == 1 || nargs == 2) {
            // SAFETY: the interpreter passes `nargs` live positional arguments at `args`.
            let key = unsafe { Bound::from_borrowed_ptr(py, *args) };
            return core.get().lookup_one(py, &key);
        }
        // Keywords or a wrong count: the method itself, with the same arguments.
        let n = usize::try_from(nargs).unwrap_or(0);
        let names = if kwnames.is_null() {
            None
        } else {
            // SAFETY: a non-null `kwnames` is a live tuple of str.
            Some(unsafe { Bound::from_borrowed_ptr(py, kwnames).cast_into_unchecked::<PyTuple>() })
        };
        let total = n + names.as_ref().map_or(0, PyTupleMethods::len);
        // SAFETY: the interpreter passes `nargs` positional values then one value per keyword
        // name at `args`, all live for the call.
        let values: Vec<Bound<'_, PyAny>> = (0..total)
            .map(|i| unsafe { Bound::from_borrowed_ptr(py, *args.add(i)) })
            .collect();
        let positional = PyTuple::new(py, &values[..n])?;
        let kwargs = match &names {
            Some(names) => {
                let d = PyDict::new(py);
                for (name, value) in names.iter().zip(&values[n..]) {
                    d.set_item(name, value)?;
                }
                Some(d)
            }
            None => None,
        };
        core.as_any()
            .call_method(pyo3::intern!(py, "lookup"), positional, kwargs.as_ref())
    });
    match out {
        Ok(Ok(result)) => result.into_ptr(),
        Ok(Err(e)) => {
            e.restore(py);
            std::ptr::null_mut()
        }
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic in kvoffload's lookup".to_owned());
            PanicException::new_err(msg).restore(py);
            std::ptr::null_mut()
        }
    }
}
