//! Reading a call's arguments out of Python without per-key Python code: key bytes borrowed
//! from the `bytes` objects, token positions and request state read from the context.

use crate::errors::{invalid_key, raise};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyType};

/// The `bytes` objects of a call, kept alive while their bytes are borrowed.
pub(crate) struct Keys<'py> {
    pub(crate) objs: Vec<Bound<'py, PyBytes>>,
}

impl<'py> Keys<'py> {
    /// Collect the keys of `obj` (a list, tuple or any iterable of `bytes`).
    pub(crate) fn extract(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        // Sized up front for a list or tuple: growing one push at a time cost more than reading
        // the keys.
        let known = obj
            .cast::<PyList>()
            .map(PyListMethods::len)
            .or_else(|_| obj.cast::<PyTuple>().map(PyTupleMethods::len))
            .unwrap_or(0);
        let mut objs = Vec::with_capacity(known);
        let mut push = |item: Bound<'py, PyAny>| -> PyResult<()> {
            match item.cast_into::<PyBytes>() {
                Ok(b) => {
                    objs.push(b);
                    Ok(())
                }
                Err(e) => {
                    let got = e.into_inner();
                    let ty = type_name(&got);
                    Err(invalid_key(py, format!("keys must be bytes, got {ty}")))
                }
            }
        };
        if let Ok(list) = obj.cast::<PyList>() {
            prefetch_items(list);
            for item in list.iter() {
                push(item)?;
            }
        } else if let Ok(tuple) = obj.cast::<PyTuple>() {
            for item in tuple.iter() {
                push(item)?;
            }
        } else if obj.is_instance_of::<PyBytes>() {
            return Err(invalid_key(
                py,
                "expected a collection of keys, got a single bytes key".into(),
            ));
        } else {
            let iter = obj.try_iter().map_err(|_| {
                let ty = type_name(obj);
                invalid_key(py, format!("keys must be an iterable of bytes, got {ty}"))
            })?;
            for item in iter {
                push(item?)?;
            }
        }
        Ok(Self { objs })
    }

    /// The key bytes, lined up with the objects.
    pub(crate) fn slices(&self) -> Vec<&[u8]> {
        self.objs.iter().map(PyBytesMethods::as_bytes).collect()
    }
}

/// Start loading every item of `list` (its header and first bytes) into the cache, so that the
/// cache misses on a batch of key objects overlap instead of queueing.
fn prefetch_items(list: &Bound<'_, PyList>) {
    if list.len() < 2 {
        return;
    }
    // Under the list's critical section no other thread can resize it or replace its items
    // (free-threaded builds; with the GIL this is the GIL itself), so the length read here
    // stays true for the whole loop and every pointer read is a live item's.
    pyo3::sync::critical_section::with_critical_section(list.as_any(), || {
        let Ok(len) = pyo3::ffi::Py_ssize_t::try_from(list.len()) else {
            return;
        };
        for i in 0..len {
            // SAFETY: `list` is a live list that no other thread can change meanwhile (the
            // critical section) and `i` is below its length, so `PyList_GetItem` returns a
            // borrowed pointer to a live object; the pointer is only handed to a prefetch,
            // which never dereferences it. No Python code runs in this loop, so the critical
            // section is never suspended.
            let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), i) };
            if item.is_null() {
                // SAFETY: attached to the interpreter (we have a `Bound`); this drops the error
                // just raised (unreachable while the length holds).
                unsafe { pyo3::ffi::PyErr_Clear() };
                return;
            }
            // The object header and the next line (a `bytes` object's data starts 32 bytes in).
            let p = item.cast::<u8>().cast_const();
            kvoffload_core::mem::prefetch_addr(p);
            kvoffload_core::mem::prefetch_addr(p.wrapping_add(64));
        }
    });
}

/// The Python type name of `obj`, for error messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// One key argument.
pub(crate) fn one_key<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes());
    }
    let ty = type_name(obj);
    Err(invalid_key(
        obj.py(),
        format!("a key must be bytes, got {ty}"),
    ))
}

static REQ_CONTEXT: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `kvoffload.types.ReqContext`, whose instances are read through their dicts directly.
fn req_context_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    REQ_CONTEXT
        .get_or_try_init(py, || {
            py.import("kvoffload.types")?
                .getattr("ReqContext")?
                .cast_into::<PyType>()
                .map(Bound::unbind)
                .map_err(PyErr::from)
        })
        .map(|t| t.bind(py))
}

/// A position value read from a context: `None`, or an int in the int64 range.
pub(crate) fn position_value(v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if v.is_none() {
        return Ok(None);
    }
    v.extract::<i64>().map(Some).map_err(|_| {
        let ty = type_name(v);
        raise(
            v.py(),
            "InvalidArgumentError",
            format!("a token position must be an int in the int64 range, got {ty}"),
        )
    })
}

/// A result class and its `__new__`, looked up once: [`build`](Self::build) makes bare instances.
pub(crate) struct Blank {
    cls: Py<PyType>,
    new: Py<PyAny>,
}

impl Blank {
    fn of(cls: Bound<'_, PyType>) -> PyResult<Self> {
        let new = cls.getattr(pyo3::intern!(cls.py(), "__new__"))?.unbind();
        Ok(Self {
            cls: cls.unbind(),
            new,
        })
    }

    /// A bare instance (``cls.__new__(cls)``, no `__init__`) with `attrs` set: builds the
    /// result dataclasses without running Python-level constructors, and without looking up
    /// `__new__` again on every call.
    pub(crate) fn build<'py>(
        &self,
        py: Python<'py>,
        attrs: &[(&Bound<'py, pyo3::types::PyString>, Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.new.bind(py).call1((self.cls.bind(py),))?;
        for (name, value) in attrs {
            obj.setattr(*name, value)?;
        }
        Ok(obj)
    }
}

/// The `kvoffload.types` objects results are built from, looked up once.
pub(crate) struct ResultTypes {
    pub(crate) prepare_store_output: Blank,
    pub(crate) cpu_spec: Blank,
    /// `LookupResult.MISS`, `.HIT`, `.HIT_PENDING`.
    pub(crate) lookup: [Py<PyAny>; 3],
}

impl ResultTypes {
    /// The types of `namespace` (a module or any object with `PrepareStoreOutput`,
    /// `CPULoadStoreSpec` and `LookupResult` attributes: kvoffload's types, or vLLM's).
    pub(crate) fn from_namespace(namespace: &Bound<'_, PyAny>) -> PyResult<Self> {
        let blank = |name: &str| -> PyResult<Blank> {
            Blank::of(namespace.getattr(name)?.cast_into::<PyType>()?)
        };
        let lr = namespace.getattr("LookupResult")?;
        Ok(Self {
            prepare_store_output: blank("PrepareStoreOutput")?,
            cpu_spec: blank("CPULoadStoreSpec")?,
            lookup: [
                lr.getattr("MISS")?.unbind(),
                lr.getattr("HIT")?.unbind(),
                lr.getattr("HIT_PENDING")?.unbind(),
            ],
        })
    }
}

static RESULT_TYPES: PyOnceLock<ResultTypes> = PyOnceLock::new();

/// The cached [`ResultTypes`] of `kvoffload.types`.
pub(crate) fn result_types(py: Python<'_>) -> PyResult<&ResultTypes> {
    RESULT_TYPES.get_or_try_init(py, || {
        ResultTypes::from_namespace(py.import("kvoffload.types")?.as_any())
    })
}

/// A second context class read through its dicts, like kvoffload's `ReqContext` (set once).
static EXTRA_CONTEXT: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Read instances of `cls` (exactly that class, not subclasses) through their `_state` and
/// `_offload_key_positions` dicts instead of calling their methods. For a class whose methods
/// only read and write those two dicts, as kvoffload's `ReqContext` does (vLLM's does the same).
/// One class can be registered per process; registering it again is a no-op.
#[pyfunction]
pub(crate) fn register_context_type(py: Python<'_>, cls: &Bound<'_, PyType>) -> PyResult<()> {
    let set = EXTRA_CONTEXT.get_or_init(py, || cls.clone().unbind());
    if set.bind(py).is(cls) {
        Ok(())
    } else {
        Err(raise(
            py,
            "InvalidArgumentError",
            format!("a context class is already registered: {}", set.bind(py)),
        ))
    }
}

/// Whether `obj`'s class is one whose instances are read through their dicts.
fn has_fast_dicts(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    let ty = obj.get_type();
    if ty.is(req_context_type(py)?) {
        return Ok(true);
    }
    Ok(EXTRA_CONTEXT.get(py).is_some_and(|t| ty.is(t.bind(py))))
}

/// A request context: kvoffload's own `ReqContext` (fast path through its dicts) or any object
/// with vLLM's `get_state`/`set_state`/`get_offload_key_position` methods.
pub(crate) struct Context<'py> {
    obj: Bound<'py, PyAny>,
    /// `(_state, _offload_key_positions)` of a kvoffload `ReqContext`.
    dicts: Option<(Bound<'py, PyDict>, Bound<'py, PyDict>)>,
}

impl<'py> Context<'py> {
    pub(crate) fn new(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        let mut dicts = None;
        if has_fast_dicts(obj)? {
            let state = obj
                .getattr(pyo3::intern!(py, "_state"))?
                .cast_into::<PyDict>()
                .ok();
            let pos = obj
                .getattr(pyo3::intern!(py, "_offload_key_positions"))?
                .cast_into::<PyDict>()
                .ok();
            if let (Some(s), Some(p)) = (state, pos) {
                dicts = Some((s, p));
            }
        }
        if dicts.is_none() {
            const METHODS: [&str; 3] = ["get_state", "set_state", "get_offload_key_position"];
            for name in METHODS {
                if !obj.getattr(name).is_ok_and(|m| m.is_callable()) {
                    let ty = type_name(obj);
                    return Err(raise(
                        py,
                        "InvalidArgumentError",
                        format!(
                            "req_context must be a ReqContext (or have {}); {ty} lacks {name}",
                            METHODS.join(", ")
                        ),
                    ));
                }
            }
        }
        Ok(Self {
            obj: obj.clone(),
            dicts,
        })
    }

    /// The context object itself.
    pub(crate) fn object(&self) -> &Bound<'py, PyAny> {
        &self.obj
    }

    /// `ctx.get_state(cls)`.
    pub(crate) fn get_state(
        &self,
        cls: &Bound<'py, PyType>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let v = match &self.dicts {
            Some((state, _)) => state.get_item(cls)?,
            None => Some(
                self.obj
                    .call_method1(pyo3::intern!(self.obj.py(), "get_state"), (cls,))?,
            ),
        };
        Ok(v.filter(|v| !v.is_none()))
    }

    /// `ctx.set_state(value)`.
    pub(crate) fn set_state(&self, value: &Bound<'py, PyAny>) -> PyResult<()> {
        match &self.dicts {
            Some((state, _)) => state.set_item(value.get_type(), value),
            None => self
                .obj
                .call_method1(pyo3::intern!(self.obj.py(), "set_state"), (value,))
                .map(drop),
        }
    }

    /// Whether the context can hold positions at all (an empty positions dict cannot).
    fn may_have_positions(&self) -> bool {
        self.dicts.as_ref().is_none_or(|(_, p)| !p.is_empty())
    }

    /// The position of one key object, or `None`.
    pub(crate) fn position(&self, key: &Bound<'py, PyAny>) -> PyResult<Option<i64>> {
        let v = match &self.dicts {
            Some((_, pos)) => pos.get_item(key)?,
            None => Some(self.obj.call_method1(
                pyo3::intern!(self.obj.py(), "get_offload_key_position"),
                (key,),
            )?),
        };
        v.map_or(Ok(None), |v| position_value(&v))
    }

    /// Positions of `keys` (`None` when the context holds none).
    pub(crate) fn positions(
        &self,
        keys: &[Bound<'py, PyBytes>],
    ) -> PyResult<Option<Vec<Option<i64>>>> {
        if !self.may_have_positions() {
            return Ok(None);
        }
        let mut positions = Vec::with_capacity(keys.len());
        for k in keys {
            positions.push(self.position(k.as_any())?);
        }
        Ok(Some(positions))
    }
}
