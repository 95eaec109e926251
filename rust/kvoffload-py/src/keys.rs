//! Reading a call's arguments out of Python without per-key Python code: key bytes borrowed
//! from the `bytes` objects, token positions and request state read from the context.

use crate::errors::{invalid_key, raise};
use crate::lists::Items;
use kvoffload_core::recycle::{self, Recycled};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyString, PyTuple, PyType};

/// The `bytes` objects of a call, kept alive while their bytes are borrowed. Both fields are
/// private: `bytes` lends out the buffers of the objects `objs` holds, so neither may change
/// apart from the other.
pub(crate) struct Keys<'py> {
    objs: Vec<Bound<'py, PyBytes>>,
    /// Each object's bytes, read once as the objects are collected. Never handed out longer
    /// than a borrow of `self` (see [`slices`](Self::slices)).
    bytes: Vec<&'static [u8]>,
}

impl<'py> Keys<'py> {
    /// Collect the keys of `obj` (a list, tuple or any iterable of `bytes`). An exact list or
    /// tuple is read directly; anything else, subclasses included, is iterated, as vLLM's
    /// Python loops would (a subclass's own `__iter__` decides what it holds).
    pub(crate) fn extract(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        // Buffers reused from earlier calls: a steady stream of calls allocates none.
        let mut keys = Self {
            objs: recycle::take(0),
            bytes: recycle::take(0),
        };
        if let Ok(list) = obj.cast_exact::<PyList>() {
            keys.extend_from_list(list)?;
        } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
            // A tuple's items never change and it lives through the call (the caller holds
            // it), so its borrowed items stay live without a critical section.
            let items = Items::of_tuple(tuple);
            keys.extend_from_items(py, tuple.len(), |i| {
                // SAFETY: `tuple` is a live tuple and `i` below its length.
                unsafe { items.get(i) }
            })?;
        } else if obj.is_instance_of::<PyBytes>() {
            return Err(invalid_key(
                py,
                "expected a collection of keys, got a single bytes key".into(),
            ));
        } else {
            // A str or bytearray is iterable, but of characters or ints, never of keys (even
            // when empty).
            let text = obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyByteArray>();
            let iter = (!text)
                .then(|| obj.try_iter().ok())
                .flatten()
                .ok_or_else(|| {
                    let ty = type_name(obj);
                    invalid_key(py, format!("keys must be an iterable of bytes, got {ty}"))
                })?;
            for item in iter {
                keys.push(item?)?;
            }
        }
        Ok(keys)
    }

    fn reserve(&mut self, n: usize) {
        self.objs.reserve_exact(n);
        self.bytes.reserve_exact(n);
    }

    /// Add one item, which must be `bytes` (or a subclass).
    #[inline]
    fn push(&mut self, item: Bound<'py, PyAny>) -> PyResult<()> {
        match item.cast_into::<PyBytes>() {
            Ok(b) => {
                self.push_bytes(b);
                Ok(())
            }
            Err(e) => {
                let got = e.into_inner();
                let ty = type_name(&got);
                Err(invalid_key(
                    got.py(),
                    format!("keys must be bytes, got {ty}"),
                ))
            }
        }
    }

    #[inline]
    fn push_bytes(&mut self, b: Bound<'py, PyBytes>) {
        // SAFETY: `b` is a live `bytes`, kept in `objs` until `self` drops; the slice is only
        // ever lent out for a borrow of `self` (`slices`).
        self.bytes.push(unsafe { bytes_of(b.as_ptr()) });
        self.objs.push(b);
    }

    /// The items of a list, read under the list's critical section: no other thread can
    /// resize the list or replace its items meanwhile (free-threaded builds; with the GIL this
    /// is the GIL itself), so the length read here stays true throughout and every item read
    /// is a live object. No Python code runs inside, so the section is never suspended.
    fn extend_from_list(&mut self, list: &Bound<'py, PyList>) -> PyResult<()> {
        pyo3::sync::critical_section::with_critical_section(list.as_any(), || {
            let items = Items::of(list);
            self.extend_from_items(list.py(), list.len(), |i| {
                // SAFETY: `list` is a live list that cannot change meanwhile and `i` is below
                // its length.
                unsafe { items.get(i) }
            })
        })
    }

    /// The `len` items `item(0..len)` of a list or tuple, each a borrowed pointer to a live
    /// object that stays live (and in place) for the whole call; 32 at a time: every item's
    /// header is prefetched first, so that the cache misses of a batch of key objects overlap,
    /// then the batch is checked, kept and its bytes read.
    fn extend_from_items(
        &mut self,
        py: Python<'py>,
        len: usize,
        item: impl Fn(pyo3::ffi::Py_ssize_t) -> *mut pyo3::ffi::PyObject,
    ) -> PyResult<()> {
        const BATCH: usize = 32;
        self.reserve(len);
        // The interpreter's `bytes` type object (only its address is taken).
        let bytes_type = std::ptr::addr_of_mut!(pyo3::ffi::PyBytes_Type);
        let mut items = [std::ptr::null_mut::<pyo3::ffi::PyObject>(); BATCH];
        for lo in (0..len).step_by(BATCH) {
            let items = &mut items[..BATCH.min(len - lo)];
            for (i, slot) in (lo..).zip(items.iter_mut()) {
                let i = pyo3::ffi::Py_ssize_t::try_from(i).unwrap_or(pyo3::ffi::Py_ssize_t::MAX);
                let p = item(i);
                if p.is_null() {
                    // Unreachable while the length holds: the error raised for the index.
                    return Err(PyErr::fetch(py));
                }
                // The object header and the next line (a `bytes` object's data starts 32
                // bytes in); a prefetch never dereferences its address.
                let at = p.cast::<u8>().cast_const();
                kvoffload_core::mem::prefetch_addr(at);
                kvoffload_core::mem::prefetch_addr(at.wrapping_add(64));
                *slot = p;
            }
            let exact = items.iter().all(|&p| {
                // SAFETY: a live object (the caller's contract): its type is readable.
                unsafe { pyo3::ffi::Py_TYPE(p) == bytes_type }
            });
            if exact {
                // Every exact `bytes` object has one layout, so its data lies at one offset
                // from its start (no call into the interpreter per key).
                // SAFETY: a live, exact `bytes` (above).
                let offset = unsafe { exact_offset(items[0]) };
                self.bytes.extend(items.iter().map(|&p| {
                    // SAFETY: a live, exact `bytes` (above), whose buffer starts `offset` bytes
                    // in, as its type's do; kept in `objs` just below for as long as `self`
                    // lives; `slices` lends it out no longer.
                    unsafe { bytes_at(p, offset) }
                }));
                self.objs.extend(items.iter().map(|&p| {
                    // SAFETY: a live object, exactly `bytes`; `from_borrowed_ptr` takes a new
                    // reference of our own.
                    unsafe { Bound::from_borrowed_ptr(py, p).cast_into_unchecked() }
                }));
            } else {
                for &p in items.iter() {
                    // SAFETY: a live object; `from_borrowed_ptr` takes a new reference of our
                    // own.
                    self.push(unsafe { Bound::from_borrowed_ptr(py, p) })?;
                }
            }
        }
        Ok(())
    }

    /// Run `f` on the bytes and addresses of `obj`'s keys, borrowed from the caller's list or
    /// tuple without a reference of our own to any of them: `None` (and `f` not run) unless
    /// `obj` is an exact list or tuple of at most `max_keys` exact `bytes` objects. A list is read,
    /// and `f` runs, inside the list's critical section, so no other thread can replace an
    /// item meanwhile.
    ///
    /// `f` must not run Python code or detach from the interpreter: either could free a key
    /// object (a finalizer or another thread changing the list) while its bytes are lent.
    pub(crate) fn borrowed<R>(
        obj: &Bound<'py, PyAny>,
        max_keys: usize,
        f: impl FnOnce(&[&[u8]], &[usize]) -> R,
    ) -> Option<R> {
        if let Ok(list) = obj.cast_exact::<PyList>() {
            pyo3::sync::critical_section::with_critical_section(list.as_any(), || {
                if list.len() > max_keys {
                    return None;
                }
                let items = Items::of(list);
                lend(list.len(), f, |i| {
                    // SAFETY: `list` is a live list that cannot change meanwhile and `i` is
                    // below its length.
                    unsafe { items.get(i) }
                })
            })
        } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
            if tuple.len() > max_keys {
                return None;
            }
            let items = Items::of_tuple(tuple);
            lend(tuple.len(), f, |i| {
                // SAFETY: `tuple` is a live tuple and `i` below its length.
                unsafe { items.get(i) }
            })
        } else {
            None
        }
    }

    /// The key bytes, lined up with the objects.
    pub(crate) fn slices(&self) -> &[&[u8]] {
        &self.bytes
    }

    /// The key objects, in order.
    pub(crate) fn objs(&self) -> &[Bound<'py, PyBytes>] {
        &self.objs
    }

    /// The key objects, taken (their borrowed bytes go with `self`).
    pub(crate) fn into_objs(mut self) -> Vec<Bound<'py, PyBytes>> {
        std::mem::take(&mut self.objs)
    }
}

impl Drop for Keys<'_> {
    fn drop(&mut self) {
        // The borrowed bytes first: they point into the objects.
        recycle::give(std::mem::take(&mut self.bytes));
        recycle::give(std::mem::take(&mut self.objs));
    }
}

/// [`Keys::borrowed`] over `len` items `item(0..len)`, each a borrowed pointer to an object
/// that stays live and in place while `f` runs (the caller's contract).
fn lend<R>(
    len: usize,
    f: impl FnOnce(&[&[u8]], &[usize]) -> R,
    item: impl Fn(pyo3::ffi::Py_ssize_t) -> *mut pyo3::ffi::PyObject,
) -> Option<R> {
    let bytes_type = std::ptr::addr_of_mut!(pyo3::ffi::PyBytes_Type);
    let mut addrs: Recycled<usize> = Recycled::with_capacity(len);
    for i in 0..len {
        let i = pyo3::ffi::Py_ssize_t::try_from(i).ok()?;
        let p = item(i);
        // SAFETY: a non-null item is a live object (the caller's contract): its type is
        // readable.
        if p.is_null() || unsafe { pyo3::ffi::Py_TYPE(p) } != bytes_type {
            return None;
        }
        addrs.push(p as usize);
    }
    let offset = match addrs.first() {
        // SAFETY: every item is a live, exact `bytes` (checked above).
        Some(&p) => unsafe { exact_offset(p as *mut pyo3::ffi::PyObject) },
        None => 0,
    };
    let slices: Recycled<&[u8]> = addrs
        .iter()
        // SAFETY: a live, exact `bytes` whose buffer starts `offset` bytes in (as every exact
        // `bytes` object's does), live while `f` runs, which the slices do not outlive.
        .map(|&p| unsafe { bytes_at(p as *mut pyo3::ffi::PyObject, offset) })
        .collect();
    Some(f(&slices, &addrs))
}

/// The bytes of a `bytes` object (or subclass instance), as a slice not tied to a borrow.
///
/// # Safety
/// `obj` is a live `bytes` object, attached to the interpreter, and the caller keeps it alive
/// for as long as the slice is used (see [`Keys`]).
#[inline]
unsafe fn bytes_of(obj: *mut pyo3::ffi::PyObject) -> &'static [u8] {
    // SAFETY: per the contract; the offset is where `obj`'s buffer starts.
    unsafe { bytes_at(obj, data_offset(obj)) }
}

/// How far into `obj` its buffer starts.
///
/// # Safety
/// `obj` is a live `bytes` object (or subclass instance), attached to the interpreter.
#[inline]
unsafe fn data_offset(obj: *mut pyo3::ffi::PyObject) -> usize {
    // SAFETY: per the contract; `PyBytes_AsString` cannot fail on a `bytes`.
    let data = unsafe { pyo3::ffi::PyBytes_AsString(obj) };
    (data as usize).wrapping_sub(obj as usize)
}

/// [`bytes_of`] given where the buffer starts: `offset` bytes into the object (the same for
/// every object of one type, so a caller may read it once and reuse it).
///
/// # Safety
/// As [`bytes_of`], and `offset` is where `obj`'s buffer starts.
#[inline]
unsafe fn bytes_at(obj: *mut pyo3::ffi::PyObject, offset: usize) -> &'static [u8] {
    // SAFETY: per the contract, `obj` is a live `bytes` whose immutable buffer starts `offset`
    // bytes in (inside the object) and holds `Py_SIZE(obj)` bytes while the object lives.
    unsafe {
        let len = usize::try_from(pyo3::ffi::Py_SIZE(obj)).unwrap_or(0);
        std::slice::from_raw_parts(obj.cast::<u8>().cast_const().add(offset), len)
    }
}

/// Where an exact `bytes` object's buffer starts (the same for every one: one layout), read
/// once off a live one.
static EXACT_BYTES_OFFSET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// How far into any exact `bytes` object its buffer starts: [`data_offset`] of the first one
/// asked about, kept ([`EXACT_BYTES_OFFSET`]); later calls make no call into the interpreter.
///
/// # Safety
/// `obj` is a live, exact `bytes` object, attached to the interpreter.
#[inline]
unsafe fn exact_offset(obj: *mut pyo3::ffi::PyObject) -> usize {
    // SAFETY: per the contract.
    *EXACT_BYTES_OFFSET.get_or_init(|| unsafe { data_offset(obj) })
}

/// The bytes of `obj`, a `bytes` object or subclass instance: an exact `bytes`'s read straight
/// from its buffer (no call into the interpreter), any other's through the C API.
#[inline]
pub(crate) fn bytes_in<'a>(obj: &'a Bound<'_, PyBytes>) -> &'a [u8] {
    let p = obj.as_ptr();
    // SAFETY: a live object: its type is readable.
    if unsafe { pyo3::ffi::Py_TYPE(p) } != std::ptr::addr_of_mut!(pyo3::ffi::PyBytes_Type) {
        return obj.as_bytes();
    }
    // SAFETY: a live, exact `bytes`, whose buffer starts where every exact `bytes`'s does; the
    // slice is tied to the borrow of `obj`, which keeps it alive.
    unsafe { bytes_at(p, exact_offset(p)) }
}

/// The Python type name of `obj`, for error messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// One key argument.
#[inline]
pub(crate) fn one_key<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    match obj.cast::<PyBytes>() {
        Ok(b) => Ok(bytes_in(b)),
        Err(_) => Err(not_bytes(obj)),
    }
}

/// The error of a key argument that is not `bytes`.
#[cold]
#[inline(never)]
fn not_bytes(obj: &Bound<'_, PyAny>) -> PyErr {
    let ty = type_name(obj);
    invalid_key(obj.py(), format!("a key must be bytes, got {ty}"))
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

/// A position value read from a context: `None`, or an int in the int64 range. A value that
/// is no int (`TypeError`) or out of range (`OverflowError`) is an `InvalidArgumentError`; any
/// other exception its `__index__` raises is the caller's, and propagates.
pub(crate) fn position_value(v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if v.is_none() {
        return Ok(None);
    }
    let py = v.py();
    v.extract::<i64>().map(Some).map_err(|e| {
        if !e.is_instance_of::<PyTypeError>(py) && !e.is_instance_of::<PyOverflowError>(py) {
            return e;
        }
        let ty = type_name(v);
        raise(
            py,
            "InvalidArgumentError",
            format!("a token position must be an int in the int64 range, got {ty}"),
        )
    })
}

/// A position read directly from a dict's value: `None`, or an int in the int64 range.
#[derive(Clone, Copy)]
struct Plain(Option<i64>);

/// A positions dict's value, borrowed: `None`, or an int in the int64 range, read without
/// taking a reference to it or converting it through the generic path; `None` for any other
/// value, which the caller reads the general way (and reports).
///
/// # Safety
/// `v` is a live object, kept alive for the call (the dict's critical section is held).
unsafe fn plain_value(v: *mut pyo3::ffi::PyObject) -> Option<Plain> {
    use pyo3::ffi;
    // SAFETY: `v` is live (the caller's contract); only its identity and type are read.
    let (none, int) = unsafe {
        (
            v == ffi::Py_None(),
            ffi::Py_TYPE(v) == std::ptr::addr_of_mut!(ffi::PyLong_Type),
        )
    };
    if none {
        return Some(Plain(None));
    }
    if !int {
        return None;
    }
    let mut overflow = 0;
    // SAFETY: `v` is a live exact int, which the conversion reads without running Python code;
    // out of range it sets `overflow` and raises nothing.
    let x = unsafe { ffi::PyLong_AsLongLongAndOverflow(v, &raw mut overflow) };
    (overflow == 0).then_some(Plain(Some(x)))
}

/// `key`'s entry in a positions dict when it is absent, `None` or an int in the int64 range
/// (see [`plain_value`]; most of a read's ~180 instructions are the interpreter's dict lookup);
/// `None` for any other value.
fn plain_position<'py>(
    pos: &Bound<'py, PyDict>,
    key: &Bound<'py, PyAny>,
) -> Option<PyResult<Option<i64>>> {
    use pyo3::ffi;
    let py = pos.py();
    // The dict's critical section (free-threaded builds; with the GIL, the GIL) keeps the value
    // found alive until it has been read: no other thread can replace it meanwhile.
    pyo3::sync::critical_section::with_critical_section(pos.as_any(), || {
        // SAFETY: `pos` is a dict and `key` an object, both live; the call returns a borrowed
        // value or null (absent, or an error raised by a key's `__eq__`).
        let v = unsafe { ffi::PyDict_GetItemWithError(pos.as_ptr(), key.as_ptr()) };
        if v.is_null() {
            return Some(PyErr::take(py).map_or(Ok(None), Err));
        }
        // SAFETY: `v` is live: the critical section is held.
        unsafe { plain_value(v) }.map(|p| Ok(p.0))
    })
}

/// Dict entries [`walk_dict`] looks at past its place for the next key before it gives up on
/// that key.
const WALK_AHEAD: usize = 4;
/// Keys in a row that [`walk_dict`] may fail to find before it stops looking for the rest.
const WALK_MISSES: u32 = 3;

/// Reads the values of keys that a positions dict holds in the order they are asked for (a
/// scheduler records a request's block positions in prefix order, and offers its blocks in the
/// same order), by walking the dict's entries (`PyDict_Next`) from `at` instead of looking each
/// key up; one pass over `keys` in one critical section of the dict (no Python code runs in
/// it). Pushes each key's position to `out`, or `None` when the walk did not read it, and
/// then its index to `unread`; returns where the walk stopped.
///
/// An entry is taken only when its key *is* the object asked for, and only for exact `bytes`
/// objects, whose hash and equality cannot be overridden: a dict holds at most one key equal
/// to such an object, so a lookup would find that very entry. Anything else (the key not
/// [`WALK_AHEAD`] entries ahead, a value that is not a plain int) is left unread for the
/// caller to look up as usual; after [`WALK_MISSES`] keys in a row that the walk did not find
/// it stops looking, so a dict in another order costs a bounded few probes a call.
fn walk_dict<T>(
    pos: &Bound<'_, PyDict>,
    keys: &[Bound<'_, T>],
    mut at: isize,
    out: &mut Recycled<Option<i64>>,
    unread: &mut Recycled<usize>,
) -> isize {
    use pyo3::ffi;
    let bytes_type = std::ptr::addr_of_mut!(ffi::PyBytes_Type);
    pyo3::sync::critical_section::with_critical_section(pos.as_any(), || {
        let mut misses = 0;
        for (i, key) in keys.iter().enumerate() {
            let key = key.as_ptr();
            // SAFETY: a live object (the caller holds it): its type is readable.
            let exact = unsafe { ffi::Py_TYPE(key) } == bytes_type;
            let mut found = None;
            if misses < WALK_MISSES && exact {
                let mut next = at;
                for _ in 0..WALK_AHEAD {
                    let mut k = std::ptr::null_mut();
                    let mut v = std::ptr::null_mut();
                    // SAFETY: `pos` is a live dict; `PyDict_Next` accepts any position (past
                    // the end or negative: no entry) and returns borrowed references, which
                    // the critical section keeps alive while they are read. It runs no Python
                    // code.
                    if unsafe {
                        ffi::PyDict_Next(pos.as_ptr(), &raw mut next, &raw mut k, &raw mut v)
                    } == 0
                    {
                        break;
                    }
                    if k == key {
                        at = next;
                        // SAFETY: `v` is live (above).
                        found = Some(unsafe { plain_value(v) });
                        break;
                    }
                }
                if found.is_some() {
                    misses = 0;
                } else {
                    misses += 1;
                }
            }
            if let Some(Plain(p)) = found.flatten() {
                out.push(p);
            } else {
                out.push(None);
                unread.push(i);
            }
        }
    });
    at
}

/// A result class and its `__new__`, looked up once: [`build`](Self::build) makes bare instances.
pub(crate) struct Blank {
    cls: Py<PyType>,
    new: Py<PyAny>,
    /// `object`'s `tp_new`, when the class keeps it (no `__new__` of its own): then
    /// `cls.__new__(cls)` is exactly `tp_new(cls, (), NULL)`, without the method wrapper's
    /// argument tuple and checks.
    object_new: Option<pyo3::ffi::newfunc>,
    /// An empty tuple, the arguments passed to `object_new`.
    no_args: Py<PyTuple>,
}

impl Blank {
    fn of(cls: Bound<'_, PyType>) -> PyResult<Self> {
        use pyo3::ffi;
        let py = cls.py();
        let new = cls.getattr(pyo3::intern!(py, "__new__"))?.unbind();
        // SAFETY: the class and `object` are live type objects, and `PyType_GetSlot` reads
        // any type's slots (3.10+) without failing on a slot that exists; a non-null `tp_new`
        // slot is a `newfunc` (the slot's documented type).
        let object_new = unsafe {
            let object = std::ptr::addr_of_mut!(ffi::PyBaseObject_Type);
            let slot = ffi::PyType_GetSlot(cls.as_type_ptr(), ffi::Py_tp_new);
            (!slot.is_null() && slot == ffi::PyType_GetSlot(object, ffi::Py_tp_new))
                .then(|| std::mem::transmute::<*mut std::ffi::c_void, ffi::newfunc>(slot))
        };
        Ok(Self {
            cls: cls.unbind(),
            new,
            object_new,
            no_args: PyTuple::empty(py).unbind(),
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
        let obj = match self.object_new {
            // SAFETY: `object`'s `tp_new`, which the class has as its own (see `of`), called
            // as calling the class calls it: with the class, an args tuple and no keywords. It
            // returns a new reference, or null with an exception set.
            Some(tp_new) => unsafe {
                let made = tp_new(
                    self.cls.bind(py).as_type_ptr(),
                    self.no_args.as_ptr(),
                    std::ptr::null_mut(),
                );
                Bound::from_owned_ptr_or_err(py, made)?
            },
            None => self.new.bind(py).call1((self.cls.bind(py),))?,
        };
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
/// `Some(n)`: it is, and a plain instance's dict holds `n` entries (its dataclass fields).
fn fast_dict_fields(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    static OWN: PyOnceLock<usize> = PyOnceLock::new();
    static EXTRA: PyOnceLock<usize> = PyOnceLock::new();
    let py = obj.py();
    let ty = obj.get_type();
    let cell = if ty.is(req_context_type(py)?) {
        &OWN
    } else if EXTRA_CONTEXT.get(py).is_some_and(|t| ty.is(t.bind(py))) {
        &EXTRA
    } else {
        return Ok(None);
    };
    // Not a dataclass: 0, so that every instance is checked for methods of its own.
    let fields = || -> PyResult<usize> {
        py.import("dataclasses")?
            .getattr("fields")?
            .call1((&ty,))?
            .len()
    };
    Ok(Some(*cell.get_or_init(py, || fields().unwrap_or(0))))
}

/// The `(_state, _offload_key_positions)` dicts of a context whose class is read through them,
/// or `None` (read through its methods) when the instance does not hold both dicts, or holds a
/// method of its own in place of one of its class's. An instance dict of no more than the
/// class's `fields` entries holds no such method (its fields are there).
fn fast_dicts<'py>(
    obj: &Bound<'py, PyAny>,
    fields: usize,
) -> PyResult<Option<(Bound<'py, PyDict>, Bound<'py, PyDict>)>> {
    let py = obj.py();
    let Ok(attrs) = obj
        .getattr(pyo3::intern!(py, "__dict__"))?
        .cast_into::<PyDict>()
    else {
        return Ok(None);
    };
    let methods = [
        pyo3::intern!(py, "get_offload_key_position"),
        pyo3::intern!(py, "get_state"),
        pyo3::intern!(py, "set_state"),
    ];
    let checked = if attrs.len() > fields { 3 } else { 0 };
    for name in &methods[..checked] {
        if attrs.contains(name)? {
            return Ok(None);
        }
    }
    let dict = |name: &Bound<'py, PyString>| -> PyResult<Option<Bound<'py, PyDict>>> {
        Ok(attrs
            .get_item(name)?
            .and_then(|d| d.cast_into::<PyDict>().ok()))
    };
    let state = dict(pyo3::intern!(py, "_state"))?;
    let positions = dict(pyo3::intern!(py, "_offload_key_positions"))?;
    Ok(state.zip(positions))
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
        if let Some(fields) = fast_dict_fields(obj)? {
            dicts = fast_dicts(obj, fields)?;
        }
        if dicts.is_none() {
            const METHODS: [&str; 3] = ["get_state", "set_state", "get_offload_key_position"];
            // Every method is looked up, so the message names all that are missing (as the
            // reference's does).
            let missing: Vec<&str> = METHODS
                .into_iter()
                .filter(|name| !obj.getattr(*name).is_ok_and(|m| m.is_callable()))
                .collect();
            if !missing.is_empty() {
                let ty = type_name(obj);
                return Err(raise(
                    py,
                    "InvalidArgumentError",
                    format!(
                        "req_context must be a ReqContext (or have {}); {ty} lacks {}",
                        METHODS.join(", "),
                        missing.join(", ")
                    ),
                ));
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

    /// The position of one key object, or `None`; `i64::MIN` is refused as the manager refuses
    /// it (an LRU rank negates positions).
    pub(crate) fn position(&self, key: &Bound<'py, PyAny>) -> PyResult<Option<i64>> {
        let p = self.any_position(key)?;
        if p == Some(i64::MIN) {
            let msg = "a token position is out of range";
            return Err(raise(self.obj.py(), "InvalidArgumentError", msg.to_owned()));
        }
        Ok(p)
    }

    /// The position of one key object as read, or `None`.
    fn any_position(&self, key: &Bound<'py, PyAny>) -> PyResult<Option<i64>> {
        let v = match &self.dicts {
            Some((_, pos)) => {
                if let Some(found) = plain_position(pos, key) {
                    return found;
                }
                pos.get_item(key)?
            }
            None => Some(self.obj.call_method1(
                pyo3::intern!(self.obj.py(), "get_offload_key_position"),
                (key,),
            )?),
        };
        v.map_or(Ok(None), |v| position_value(&v))
    }

    /// Positions of `keys`, in order, walking the positions dict from `*cursor` (a
    /// `PyDict_Next` position; see [`walk_dict`]) and leaving `*cursor` after the last entry
    /// the walk took. The keys the walk did not read are looked up after it, in order.
    pub(crate) fn positions_walking<T>(
        &self,
        keys: &[Bound<'py, T>],
        cursor: &mut isize,
    ) -> PyResult<Recycled<Option<i64>>> {
        let mut positions = Recycled::with_capacity(keys.len());
        let Some((_, pos)) = &self.dicts else {
            for k in keys {
                positions.push(self.position(k.as_any())?);
            }
            return Ok(positions);
        };
        let mut unread = Recycled::with_capacity(0);
        let at = walk_dict(pos, keys, *cursor, &mut positions, &mut unread);
        for &i in &unread {
            positions[i] = self.position(keys[i].as_any())?;
        }
        *cursor = at;
        Ok(positions)
    }

    /// Positions of `keys` (`None` when the context holds none), walking the positions dict
    /// from `*cursor` (see [`positions_walking`](Self::positions_walking)).
    pub(crate) fn positions(
        &self,
        keys: &[Bound<'py, PyBytes>],
        cursor: &mut isize,
    ) -> PyResult<Option<Recycled<Option<i64>>>> {
        if !self.may_have_positions() {
            return Ok(None);
        }
        self.positions_walking(keys, cursor).map(Some)
    }
}
