//! `PythonPolicy`: a cache policy written in Python (vLLM 0.33.0's `CachePolicy` interface),
//! driven by the Rust manager.
//!
//! The manager keeps the pool, the ref counts, the key index, the admission tracker and the
//! request state in Rust, and calls the policy only where vLLM's manager does something the
//! policy can observe: `insert`, `remove`, `touch`, `on_store_miss`, `on_request_access`,
//! `on_request_finished`, `evict`, `clear`, `mark_evictable` and `mark_non_evictable`. It never
//! calls `get`: residency and ref counts are the manager's, so a lookup costs no Python call.
//!
//! The policy holds one `ChunkStatus` per resident key, built from the class it was given
//! (vLLM's own for a vLLM policy), and the manager writes every ref-count change into it, so a
//! policy reading `ref_cnt` or `is_ready` sees what vLLM's manager would show it.
//!
//! A method that raises does not unwind through the core: the first exception of a call is
//! kept and [`CachePolicy::failed`] tells the core, which undoes its call where it can (see
//! `Manager::with_policy`); the binding then re-raises the exception unchanged. That holds for
//! a `PanicException` too (from some other `PyO3` extension the policy called): `PyO3` restarts
//! the Rust panic when it takes that exception, and [`shield`] catches it here, where the
//! policy was called, before it could unwind through the core and its locks.

use kvoffload_core::policy::{Access, CachePolicy, FinishedKey, PolicyState, RequestRank};
use kvoffload_core::{group_of, ChunkId, CoreError, Result, Slots};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySet, PyString, PyTuple};

/// What one manager call hands the policy besides keys: the request context and the call's key
/// objects (so the policy receives the caller's objects, not copies).
#[derive(Default)]
struct Scope {
    ctx: Option<Py<PyAny>>,
    /// The call's key objects.
    keys: Vec<Py<PyBytes>>,
    /// `(address of the key's bytes, index in keys)`, sorted by address.
    by_addr: Vec<(usize, usize)>,
}

/// One resident chunk as the policy knows it.
struct Record {
    status: Py<PyAny>,
    key: Py<PyBytes>,
}

/// A Python cache policy behind the core's [`CachePolicy`] trait.
pub(crate) struct PythonPolicy {
    obj: Py<PyAny>,
    status_cls: Py<PyAny>,
    records: Vec<Option<Record>>,
    scope: Scope,
    /// The first exception of the current call.
    error: Option<PyErr>,
    /// A method raised since the core last asked.
    failed: bool,
}

impl PythonPolicy {
    /// Drive `obj` (a policy instance); its chunk records are built as `status_cls(chunk_id)`.
    /// Methods are looked up on every call, as vLLM's manager does, so a policy may replace
    /// them while it runs.
    pub(crate) fn new(obj: &Bound<'_, PyAny>, status_cls: &Bound<'_, PyAny>) -> Self {
        Self {
            obj: obj.clone().unbind(),
            status_cls: status_cls.clone().unbind(),
            records: Vec::new(),
            scope: Scope::default(),
            error: None,
            failed: false,
        }
    }

    /// The policy object.
    pub(crate) fn object(&self) -> &Py<PyAny> {
        &self.obj
    }

    /// Start a manager call: its context and key objects; forget earlier failures.
    pub(crate) fn begin(&mut self, ctx: Option<&Bound<'_, PyAny>>, keys: &[Bound<'_, PyBytes>]) {
        self.scope.ctx = ctx.map(|c| c.clone().unbind());
        self.scope.keys = keys.iter().map(|k| k.clone().unbind()).collect();
        self.scope.by_addr = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_bytes().as_ptr() as usize, i))
            .collect();
        self.scope.by_addr.sort_unstable();
        self.error = None;
        self.failed = false;
    }

    /// End the call: drop its objects; the first exception it raised, if any.
    pub(crate) fn finish(&mut self) -> Option<PyErr> {
        self.scope = Scope::default();
        self.failed = false;
        self.error.take()
    }

    /// Keep the first failure of the call.
    fn fail(&mut self, err: PyErr) {
        self.failed = true;
        if self.error.is_none() {
            self.error = Some(err);
        }
    }

    fn check<T>(&mut self, result: PyResult<T>) -> Option<T> {
        result.map_err(|e| self.fail(e)).ok()
    }

    /// The Python object for `key`: the caller's when `key` is one of the call's keys.
    fn key_obj<'py>(&self, py: Python<'py>, key: &[u8]) -> Bound<'py, PyAny> {
        let addr = key.as_ptr() as usize;
        if let Ok(at) = self.scope.by_addr.binary_search_by_key(&addr, |&(a, _)| a) {
            let obj = self.scope.keys[self.scope.by_addr[at].1].bind(py);
            if obj.as_bytes().len() == key.len() {
                return obj.clone().into_any();
            }
        }
        PyBytes::new(py, key).into_any()
    }

    fn ctx<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        match &self.scope.ctx {
            Some(c) => c.bind(py).clone(),
            None => py.None().into_bound(py),
        }
    }

    fn key_list<'py>(&self, py: Python<'py>, keys: &[Access<'_>]) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, keys.iter().map(|a| self.key_obj(py, a.key)))
    }

    /// Call `method(keys, ctx)` (`touch`, `on_store_miss`, `on_request_access`).
    fn call_with_keys(&mut self, method: &Bound<'_, PyString>, keys: &[Access<'_>]) {
        let py = method.py();
        let result = shield(|| {
            self.key_list(py, keys)
                .and_then(|list| self.obj.call_method1(py, method, (list, self.ctx(py))))
        });
        self.check(result);
    }

    /// Call `method(key)` with chunk `chunk`'s key (`remove`, `mark_*`).
    fn call_with_chunk(&mut self, method: &Bound<'_, PyString>, chunk: ChunkId) {
        let py = method.py();
        let Some(rec) = self.records.get(chunk as usize).and_then(Option::as_ref) else {
            return;
        };
        let result = shield(|| self.obj.call_method1(py, method, (rec.key.clone_ref(py),)));
        self.check(result);
    }

    /// Turn `evict`'s answer into chunk ids: every item a `(key, status)` pair naming a resident
    /// chunk by its status's `chunk_id`, with that chunk's key.
    fn victims(
        py: Python<'_>,
        answer: &Bound<'_, PyAny>,
        slots: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> PyResult<()> {
        let bad = |msg: String| crate::errors::raise(py, "PolicyError", msg);
        let iter = answer.try_iter().map_err(|_| {
            bad(format!(
                "evict must return a list of (key, status) pairs or None, got {}",
                crate::keys::type_name(answer)
            ))
        })?;
        for item in iter {
            let item = item?;
            let pair = item
                .cast::<PyTuple>()
                .ok()
                .filter(|t| t.len() == 2)
                .ok_or_else(|| {
                    bad(format!(
                        "evict must return (key, status) pairs, got {}",
                        crate::keys::type_name(&item)
                    ))
                })?;
            let key = pair.get_item(0)?;
            let key = key.cast::<PyBytes>().map_err(|_| {
                bad(format!(
                    "evict returned a key of type {}",
                    crate::keys::type_name(&key)
                ))
            })?;
            let chunk: i64 = pair
                .get_item(1)?
                .getattr(intern!(py, "chunk_id"))
                .and_then(|c| c.extract())
                .map_err(|_| bad(format!("evict returned {key:?} with no int chunk_id")))?;
            let held = u32::try_from(chunk)
                .ok()
                .filter(|&c| (c as usize) < slots.capacity() && slots.resident(c));
            match held {
                Some(c) if slots.key(c).as_slice() == key.as_bytes() => out.push(c),
                _ => {
                    return Err(bad(format!(
                        "evict returned {key:?} with chunk {chunk}, which does not hold that key"
                    )))
                }
            }
        }
        Ok(())
    }
}

/// Run `f` (calls into the policy's Python code), turning a Rust panic that unwinds out of it
/// into a `PanicException` it returns: `PyO3` restarts a panic when it takes a `PanicException`
/// that Python code raised, and unwinding on through the core would skip its undo of the call
/// and poison its locks.
fn shield<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("panic from Rust code")
            .to_owned();
        Err(pyo3::panic::PanicException::new_err(msg))
    })
}

impl CachePolicy for PythonPolicy {
    fn grow(&mut self, n: usize) {
        if n > self.records.len() {
            self.records.resize_with(n, || None);
        }
    }

    fn insert(&mut self, chunk: ChunkId, key: Access<'_>, _rank: &mut RequestRank) {
        Python::attach(|py| {
            let result = shield(|| {
                let status = self.status_cls.bind(py).call1((chunk,))?;
                let key_obj = self.key_obj(py, key.key).cast_into::<PyBytes>()?;
                self.records[chunk as usize] = Some(Record {
                    status: status.clone().unbind(),
                    key: key_obj.clone().unbind(),
                });
                self.obj
                    .call_method1(py, intern!(py, "insert"), (key_obj, status, self.ctx(py)))
            });
            if self.check(result).is_none() {
                // Taken not to have happened: the manager does not report it removed.
                self.records[chunk as usize] = None;
            }
        });
    }

    fn remove(&mut self, chunk: ChunkId) {
        Python::attach(|py| self.call_with_chunk(intern!(py, "remove"), chunk));
        if let Some(r) = self.records.get_mut(chunk as usize) {
            *r = None;
        }
    }

    fn touch(&mut self, keys: &[Access<'_>], _refs: &Slots) {
        Python::attach(|py| self.call_with_keys(intern!(py, "touch"), keys));
    }

    fn on_store_miss(&mut self, keys: &[Access<'_>]) {
        Python::attach(|py| self.call_with_keys(intern!(py, "on_store_miss"), keys));
    }

    fn on_request_access(&mut self, keys: &[Access<'_>], _rank: &mut RequestRank) {
        Python::attach(|py| self.call_with_keys(intern!(py, "on_request_access"), keys));
    }

    fn on_request_finished(&mut self, keys: &[FinishedKey<'_>]) {
        Python::attach(|py| {
            let result = shield(|| {
                // The head-to-tail order, split by KV group (ascending), is each group's order.
                let mut groups: Vec<(u32, Vec<Bound<'_, PyAny>>)> = Vec::new();
                let inserted_only = PySet::empty(py)?;
                let reused = PySet::empty(py)?;
                for k in keys {
                    let obj = PyBytes::new(py, k.key).into_any();
                    let g = group_of(k.key);
                    match groups.iter_mut().find(|(h, _)| *h == g) {
                        Some((_, list)) => list.push(obj.clone()),
                        None => groups.push((g, vec![obj.clone()])),
                    }
                    if k.inserted_only {
                        inserted_only.add(&obj)?;
                    }
                    if k.reused {
                        reused.add(&obj)?;
                    }
                }
                groups.sort_by_key(|(g, _)| *g);
                let groups = PyTuple::new(
                    py,
                    groups
                        .into_iter()
                        .map(|(_, keys)| PyTuple::new(py, keys))
                        .collect::<PyResult<Vec<_>>>()?,
                )?;
                self.obj.call_method1(
                    py,
                    intern!(py, "on_request_finished"),
                    (groups, inserted_only, reused, self.ctx(py)),
                )
            });
            self.check(result);
        });
    }

    fn evict(
        &mut self,
        n: usize,
        _protected: &dyn Fn(ChunkId) -> bool,
        keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        Python::attach(|py| {
            let result = shield(|| {
                // vLLM protects every key of the offer.
                let protected = PySet::new(py, self.scope.keys.iter().map(|k| k.bind(py)))?;
                let answer = self
                    .obj
                    .call_method1(py, intern!(py, "evict"), (n, protected))?;
                let answer = answer.bind(py);
                if answer.is_none() {
                    return Ok(false);
                }
                Self::victims(py, answer, keys, out)?;
                Ok(true)
            });
            match self.check(result) {
                Some(true) => true,
                Some(false) => false,
                None => {
                    out.clear();
                    false
                }
            }
        })
    }

    fn clear(&mut self) {
        Python::attach(|py| {
            let result = shield(|| self.obj.call_method0(py, intern!(py, "clear")));
            self.check(result);
        });
        self.records.clear();
    }

    fn mark_evictable(&mut self, chunk: ChunkId) {
        Python::attach(|py| self.call_with_chunk(intern!(py, "mark_evictable"), chunk));
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        Python::attach(|py| self.call_with_chunk(intern!(py, "mark_non_evictable"), chunk));
    }

    fn state(&self) -> PolicyState {
        PolicyState::External
    }

    /// Every resident chunk, and only those, has a record whose `chunk_id` and `ref_cnt` match.
    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        Python::attach(|py| {
            for (c, rec) in self.records.iter().enumerate() {
                let is_resident = resident.get(c).copied().unwrap_or(false);
                let Some(rec) = rec else {
                    if is_resident {
                        return Err(CoreError::Invariant(format!(
                            "resident chunk {c} has no status record"
                        )));
                    }
                    continue;
                };
                if !is_resident {
                    return Err(CoreError::Invariant(format!(
                        "chunk {c} is free but still has a status record"
                    )));
                }
                let status = rec.status.bind(py);
                let read = |name: &str| {
                    shield(|| status.getattr(name).and_then(|v| v.extract::<i64>()))
                        .map_err(|e| CoreError::Invariant(format!("status of chunk {c}: {e}")))
                };
                let (id, ref_cnt) = (read("chunk_id")?, read("ref_cnt")?);
                let want = i64::from(refs.raw(c as ChunkId));
                if id != c as i64 || ref_cnt != want {
                    return Err(CoreError::Invariant(format!(
                        "status of chunk {c} says chunk_id={id}, ref_cnt={ref_cnt}; \
                         the manager has ref count {want}"
                    )));
                }
            }
            Ok(())
        })
    }

    fn forget(&mut self, chunk: ChunkId) {
        if let Some(r) = self.records.get_mut(chunk as usize) {
            *r = None;
        }
    }

    fn failed(&mut self) -> bool {
        std::mem::take(&mut self.failed)
    }

    fn set_ref(&mut self, chunk: ChunkId, ref_cnt: i32) {
        Python::attach(|py| {
            if let Some(rec) = self.records.get(chunk as usize).and_then(Option::as_ref) {
                let result =
                    shield(|| rec.status.bind(py).setattr(intern!(py, "ref_cnt"), ref_cnt));
                self.check(result);
            }
        });
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}
