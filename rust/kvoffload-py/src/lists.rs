//! Python lists (and tuples) read and filled without a call into the interpreter per item.
//!
//! The limited API (abi3) reaches a list's items only through `PyList_GetItem` and
//! `PyList_SetItem`, one call each (the second also checks the list and drops the item it
//! replaces). A batch call reads a list of keys and answers with lists of keys, so those calls
//! are a few percent of it. Every `CPython` that loads an abi3 extension lays a list out the
//! same way: the object header, the size, then `ob_item`, the pointer to the item array. That
//! layout is checked once, against the C API's own answers, on a live list
//! ([`direct`]); where it holds, the items are read from and written to `ob_item`, as
//! `CPython`'s own `PyList_GET_ITEM` and `PyList_SET_ITEM` macros do; where it does not, the
//! C API functions serve. A tuple's items follow its header inline; that layout is checked
//! with the list's, and read the same way.

use crate::errors::to_py;
use kvoffload_core::CoreError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use std::sync::atomic::{AtomicU8, Ordering};

/// Word size: every field of a list's layout is one word.
const W: usize = std::mem::size_of::<usize>();

/// How lists are read and filled: [`UNKNOWN`] until first use, then [`DIRECT`] where the
/// layout checks out ([`check_layout`]), else [`API`] (also what `_list_access("api")` sets).
static MODE: AtomicU8 = AtomicU8::new(UNKNOWN);
const UNKNOWN: u8 = 0;
const DIRECT: u8 = 1;
const API: u8 = 2;

/// Whether `ob_item` can be read straight off a list object (its layout checked once).
#[inline]
fn direct(py: Python<'_>) -> bool {
    match MODE.load(Ordering::Relaxed) {
        DIRECT => true,
        API => false,
        _ => init_mode(py) == DIRECT,
    }
}

/// The mode the layouts allow: [`DIRECT`] where they check out, else [`API`].
#[cold]
fn checked_mode(py: Python<'_>) -> u8 {
    if check_layout(py) {
        DIRECT
    } else {
        API
    }
}

/// Check the layout and settle the mode (a racing check finds the same answer).
#[cold]
fn init_mode(py: Python<'_>) -> u8 {
    let mode = checked_mode(py);
    match MODE.compare_exchange(UNKNOWN, mode, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => mode,
        Err(set) => set,
    }
}

/// `_native._list_access(mode=None)`: how the binding reads and fills lists and reads tuples,
/// `"direct"` (the item arrays) or `"api"` (`PyList_GetItem`/`PyList_SetItem`,
/// `PyTuple_GetItem`). `mode="api"` switches to the
/// C API (for tests of that path); `mode="direct"` switches back only where the layout checks
/// out. Returns the mode in force afterwards.
#[pyfunction]
#[pyo3(signature = (mode=None))]
pub(crate) fn _list_access(py: Python<'_>, mode: Option<&str>) -> PyResult<&'static str> {
    match mode {
        None => {}
        Some("api") => MODE.store(API, Ordering::Relaxed),
        Some("direct") => MODE.store(checked_mode(py), Ordering::Relaxed),
        Some(other) => {
            return Err(crate::errors::raise(
                py,
                "InvalidArgumentError",
                format!("mode must be 'direct', 'api' or None, got {other:?}"),
            ))
        }
    }
    Ok(if direct(py) { "direct" } else { "api" })
}

/// Whether a list is the five words `{refcnt, type, size, ob_item, allocated}` (a release
/// build of `CPython` 3.10+): the type's basic size is five words and has no items inline, and
/// on a live three-item list the third word is its size, the fifth at least that, and the
/// array the fourth points to holds what `PyList_GetItem` answers; and a tuple has its layout
/// too ([`check_tuple_layout`]).
#[cold]
fn check_layout(py: Python<'_>) -> bool {
    let (basic, per_item) = sizes(&py.get_type::<PyList>());
    if basic != 5 * W || per_item != 0 {
        return false;
    }
    let Ok(list) = PyList::new(py, [1u8, 2, 3]) else {
        return false;
    };
    let p = list.as_ptr().cast::<usize>().cast_const();
    // SAFETY: the object is `basic` (five words) long, so its words 2 to 4 are readable; the
    // fourth is dereferenced only once the size and capacity words have proved the layout (a
    // release CPython's `PyListObject`), where it is the item array, holding three items.
    unsafe {
        let (size, items, allocated) = (*p.add(2), *p.add(3), *p.add(4));
        if size != 3 || allocated < 3 || items == 0 || items % W != 0 {
            return false;
        }
        let items = items as *const *mut ffi::PyObject;
        if !(0..3)
            .all(|i| *items.add(i) == ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t))
        {
            return false;
        }
    }
    check_tuple_layout(py)
}

/// Whether a tuple is `{refcnt, type, size}` followed by its items inline (`ob_item[]`): the
/// type's basic size is three words and its item size one, and on a live three-item tuple the
/// third word is its size and the next three its items, as `PyTuple_GetItem` answers.
#[cold]
fn check_tuple_layout(py: Python<'_>) -> bool {
    let (basic, per_item) = sizes(&py.get_type::<PyTuple>());
    if basic != 3 * W || per_item != W {
        return false;
    }
    let Ok(tuple) = PyTuple::new(py, [1u8, 2, 3]) else {
        return false;
    };
    let p = tuple.as_ptr().cast::<usize>().cast_const();
    // SAFETY: a tuple of three items is `basic` plus three item words long: words 2 to 5 are
    // readable.
    unsafe {
        *p.add(2) == 3
            && (0..3).all(|i| {
                *p.add(3 + i) as *mut ffi::PyObject
                    == ffi::PyTuple_GetItem(tuple.as_ptr(), i as ffi::Py_ssize_t)
            })
    }
}

/// A type's `__basicsize__` and `__itemsize__` (`usize::MAX` for one that cannot be read,
/// which no layout check accepts).
fn sizes(ty: &Bound<'_, pyo3::types::PyType>) -> (usize, usize) {
    let read = |name: &str| {
        ty.getattr(name)
            .and_then(|v| v.extract::<usize>())
            .unwrap_or(usize::MAX)
    };
    (read("__basicsize__"), read("__itemsize__"))
}

/// The item array of `list` where lists have the checked layout.
///
/// # Safety
/// `list` is a live list object; the pointer is valid only until the list is resized.
#[inline]
unsafe fn item_array(list: *mut ffi::PyObject) -> *mut *mut ffi::PyObject {
    // SAFETY: per the contract and `direct`'s check, the fourth word is `ob_item`.
    unsafe { *list.cast::<*mut *mut ffi::PyObject>().add(3) }
}

/// A reader of a list's or tuple's items, borrowed: the item array's entries, or those
/// `PyList_GetItem` or `PyTuple_GetItem` answer.
#[derive(Clone, Copy)]
pub(crate) struct Items {
    /// The list or tuple.
    obj: *mut ffi::PyObject,
    /// The item array, when the layout allows reading it.
    array: *mut *mut ffi::PyObject,
    /// Whether `obj` is a tuple (read by `PyTuple_GetItem` without the array).
    tuple: bool,
}

impl Items {
    /// The items of `list`, which must stay live and unchanged (no resize, no item replaced)
    /// while this reader is used: the caller holds the list's critical section.
    #[inline]
    pub(crate) fn of(list: &Bound<'_, PyList>) -> Self {
        Self::new(list.as_any(), false)
    }

    /// The items of `tuple`, which must stay live while this reader is used (its items never
    /// change).
    #[inline]
    pub(crate) fn of_tuple(tuple: &Bound<'_, PyTuple>) -> Self {
        Self::new(tuple.as_any(), true)
    }

    /// The reader of `obj`, a live list (`tuple` false) or tuple.
    #[inline]
    fn new(obj: &Bound<'_, PyAny>, tuple: bool) -> Self {
        let p = obj.as_ptr();
        let array = match (direct(obj.py()), tuple) {
            (false, _) => std::ptr::null_mut(),
            // SAFETY: a live list of the checked layout.
            (true, false) => unsafe { item_array(p) },
            // SAFETY: a live tuple of the checked layout: its items follow its three header
            // words (an address computed, nothing read).
            (true, true) => unsafe { p.cast::<*mut ffi::PyObject>().add(3) },
        };
        Self {
            obj: p,
            array,
            tuple,
        }
    }

    /// Item `i` (borrowed; null if `i` is out of range, with the C API's error set where it
    /// answered).
    ///
    /// # Safety
    /// The list is as [`of`](Self::of) requires, and `i` is below its length.
    #[inline]
    pub(crate) unsafe fn get(self, i: ffi::Py_ssize_t) -> *mut ffi::PyObject {
        if self.array.is_null() {
            // SAFETY: a live list or tuple, as `tuple` says.
            unsafe {
                if self.tuple {
                    ffi::PyTuple_GetItem(self.obj, i)
                } else {
                    ffi::PyList_GetItem(self.obj, i)
                }
            }
        } else {
            // SAFETY: `i` is below the length, so within the item array, which holds a live
            // object at every index below it.
            unsafe { *self.array.offset(i) }
        }
    }
}

/// A new list of `items`, each reference moved into it: written straight to the item array
/// where the layout allows (as `PyList_SET_ITEM` does), else by `PyList_SetItem`. An iterator
/// that ends early leaves `None` in the rest and an error; extra items are dropped, also with
/// an error.
pub(crate) fn new_list<'py, T>(
    py: Python<'py>,
    items: impl ExactSizeIterator<Item = Bound<'py, T>>,
) -> PyResult<Bound<'py, PyList>> {
    let len = items.len();
    let n = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("list too long"))?;
    // SAFETY: attached; a new list of `n` null items, owned here.
    let list = unsafe { ffi::PyList_New(n) };
    if list.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference to a list, which `Bound` now owns (dropped on every path).
    let list = unsafe { Bound::from_owned_ptr(py, list).cast_into_unchecked::<PyList>() };
    let array = if direct(py) {
        // SAFETY: a live list of the checked layout; not resized below.
        unsafe { item_array(list.as_ptr()) }
    } else {
        std::ptr::null_mut()
    };
    let mut items = items;
    let mut filled: usize = 0;
    for item in items.by_ref().take(len) {
        let obj = item.into_any().into_ptr();
        if array.is_null() {
            // SAFETY: a live list, `filled` below its length; steals `obj`'s reference (its
            // null item is dropped: nothing).
            unsafe { ffi::PyList_SetItem(list.as_ptr(), filled as ffi::Py_ssize_t, obj) };
        } else {
            // SAFETY: `filled` is below the length of the fresh list's item array, whose entry
            // there is null (nothing to drop); the list takes `obj`'s reference.
            unsafe { *array.add(filled) = obj };
        }
        filled += 1;
    }
    let extra = items.next().is_some();
    if filled < len || extra {
        for i in filled..len {
            let none = py.None().into_ptr();
            // SAFETY: a live list, `i` below its length; steals the reference to `None`.
            unsafe { ffi::PyList_SetItem(list.as_ptr(), i as ffi::Py_ssize_t, none) };
        }
        let got = if extra {
            "more".to_string()
        } else {
            filled.to_string()
        };
        return Err(to_py(
            py,
            CoreError::Invariant(format!("a list of {len} items was given {got}")),
        ));
    }
    Ok(list)
}
