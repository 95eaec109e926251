//! `HostMemory`: a core `HostPool` for Python. Zero-copy numpy views whose base object keeps
//! the region mapped, and block transfers (sync and queued) that run detached from the
//! interpreter. No Rust lock is held while Python code can run.

use crate::errors::{raise, to_py};
use kvoffload_core::host::{
    ChunkLayout, Direction, HostPool, HostPoolOptions, JobQueue, RawBuf, Region, RegionInfo,
    RegionOptions, SharedMode, SharedOptions, TransferSpec,
};
use kvoffload_core::CoreError;
use numpy::ndarray::ArrayView2;
use numpy::{
    BorrowError, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::sync::{MutexExt, RwLockExt};
use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::Duration;

/// Run batch work with the interpreter detached (the one place this crate releases the GIL).
fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    py.detach(f)
}

/// Keeps a region mapped; the `.base` of every view `HostMemory` hands out.
#[pyclass(frozen, module = "kvoffload._native")]
pub(crate) struct HostMemoryOwner {
    // This keeps the memory alive.
    region: Arc<Region>,
}

#[pymethods]
impl HostMemoryOwner {
    /// Usable bytes of the region this owner keeps mapped.
    #[getter]
    fn nbytes(&self) -> usize {
        self.region.len()
    }
}

/// A pool of host memory cut into chunks; `kvoffload.HostPool` adapts it.
#[pyclass(frozen, module = "kvoffload._native")]
pub(crate) struct HostMemory {
    /// `None` once closed; transfers clone the `Arc`, so a concurrent close never unmaps
    /// memory a copy is using.
    pool: RwLock<Option<Arc<HostPool>>>,
    /// Tells whether the region is still mapped after close (views may keep it).
    region: Weak<Region>,
    /// The buffers of queued jobs, kept alive until their result is taken.
    buffers: Mutex<HashMap<u64, Py<PyAny>>>,
    /// The pool's job queue; kept after close so that results can still be taken.
    jobs: JobQueue,
    layout: ChunkLayout,
    info: RegionInfo,
    num_threads: usize,
}

fn direction(py: Python<'_>, name: &str) -> PyResult<Direction> {
    match name {
        "gather" => Ok(Direction::Gather),
        "scatter" => Ok(Direction::Scatter),
        other => Err(raise(
            py,
            "InvalidArgumentError",
            format!("direction must be 'gather' or 'scatter', got {other:?}"),
        )),
    }
}

fn shared_mode(py: Python<'_>, name: &str) -> PyResult<SharedMode> {
    match name {
        "create_or_attach" => Ok(SharedMode::CreateOrAttach),
        "create" => Ok(SharedMode::Create),
        "attach" => Ok(SharedMode::Attach),
        other => Err(raise(
            py,
            "InvalidArgumentError",
            format!("shared_mode must be 'create_or_attach', 'create' or 'attach', got {other:?}"),
        )),
    }
}

fn ids<'a>(py: Python<'_>, arr: &'a PyReadonlyArray1<'_, i64>, what: &str) -> PyResult<&'a [i64]> {
    arr.as_slice().map_err(|_| {
        raise(
            py,
            "InvalidArgumentError",
            format!("{what} must be a contiguous int64 array"),
        )
    })
}

/// A borrow of a transfer's buffer through numpy's borrow checker: a second transfer that
/// conflicts with it (writing what this one reads, or the reverse) is refused, not raced.
#[allow(dead_code)] // held for its Drop (which releases the borrow), never read
enum BufBorrow<'py> {
    Read(PyReadonlyArray1<'py, u8>),
    Write(PyReadwriteArray1<'py, u8>),
}

/// Serialises the taking of transfer buffers' borrows. numpy's borrow flags cover whole
/// arrays, so two borrows that overlap in time refuse each other even when neither is kept:
/// `submit` checks its buffer with a borrow it drops at once, and without this two jobs
/// submitted at the same moment on one buffer (the same device cache, from two threads of a
/// free-threaded build) could each refuse the other as "in use by another transfer". Under it a
/// check or a sync transfer's borrow is taken while no other is being taken, so only a borrow
/// that is *held* (a sync transfer's, for its whole copy) refuses another, as documented. With
/// the GIL a check runs start to end under it and the lock is never contended.
static BORROWING: Mutex<()> = Mutex::new(());

/// `f` (which takes buffer borrows, and drops those it does not return) under [`BORROWING`].
fn borrowing<T>(py: Python<'_>, f: impl FnOnce() -> T) -> T {
    // Waited for detached from the interpreter (a blocked attached thread would hold up the
    // free-threaded build's stop-the-world pauses); nothing under it panics or runs Python code
    // that could take it again, and a poisoned lock guards no data.
    let _guard = BORROWING
        .lock_py_attached(py)
        .unwrap_or_else(PoisonError::into_inner);
    f()
}

/// Borrow a flat uint8 array for a transfer: writable for a scatter.
fn borrow_buf<'py>(
    py: Python<'py>,
    buf: &Bound<'py, PyArray1<u8>>,
    dir: Direction,
) -> PyResult<(BufBorrow<'py>, RawBuf)> {
    let bad = |what: String| raise(py, "InvalidArgumentError", format!("the buffer {what}"));
    if !buf.is_c_contiguous() {
        return Err(bad("is not C-contiguous".into()));
    }
    match dir {
        Direction::Scatter => {
            let mut g = buf.try_readwrite().map_err(|e| match e {
                BorrowError::NotWriteable => bad("is read-only (a load writes into it)".into()),
                e => bad(format!("is in use by another transfer ({e})")),
            })?;
            let s = g
                .as_slice_mut()
                .map_err(|_| bad("is not contiguous".into()))?;
            // SAFETY: the slice is the array's whole data; the caller keeps the array alive
            // for as long as the transfer may run.
            let raw = unsafe { RawBuf::new(s.as_mut_ptr(), s.len()) };
            Ok((BufBorrow::Write(g), raw))
        }
        Direction::Gather => {
            let g = buf
                .try_readonly()
                .map_err(|e| bad(format!("is in use by another transfer ({e})")))?;
            let raw =
                RawBuf::from_slice(g.as_slice().map_err(|_| bad("is not contiguous".into()))?);
            Ok((BufBorrow::Read(g), raw))
        }
    }
}

/// The error of a call on a closed pool.
fn closed(py: Python<'_>) -> PyErr {
    to_py(py, CoreError::Closed("the host pool is closed".into()))
}

impl HostMemory {
    fn pool(&self, py: Python<'_>) -> PyResult<Arc<HostPool>> {
        let guard = self
            .pool
            .read_py_attached(py)
            .unwrap_or_else(PoisonError::into_inner);
        let pool = guard.as_ref().map(Arc::clone);
        drop(guard);
        pool.ok_or_else(|| closed(py))
    }

    /// The buffers of queued jobs, locked (waited for detached).
    fn buffers(&self, py: Python<'_>) -> MutexGuard<'_, HashMap<u64, Py<PyAny>>> {
        self.buffers
            .lock_py_attached(py)
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Forget the buffers of jobs `ids` in `map`, then drop them once `map` is unlocked (a decref
/// may run Python code).
fn release_buffers(
    mut map: MutexGuard<'_, HashMap<u64, Py<PyAny>>>,
    ids: impl Iterator<Item = u64>,
) {
    let dropped: Vec<Py<PyAny>> = ids.filter_map(|id| map.remove(&id)).collect();
    drop(map);
    drop(dropped);
}

#[pymethods]
impl HostMemory {
    #[new]
    #[pyo3(signature = (
        num_chunks, chunk_bytes, *, num_threads, lock_pages, huge_pages, shared_name=None,
        shared_mode="create_or_attach", attach_timeout=30.0, janitor=None,
        test_creator_stall=None
    ))]
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)] // Python keywords
    fn new(
        py: Python<'_>,
        num_chunks: usize,
        chunk_bytes: usize,
        num_threads: usize,
        lock_pages: bool,
        huge_pages: bool,
        shared_name: Option<String>,
        shared_mode: &str,
        attach_timeout: f64,
        janitor: Option<Vec<OsString>>,
        test_creator_stall: Option<(f64, bool)>,
    ) -> PyResult<Self> {
        let layout = ChunkLayout::new(num_chunks, chunk_bytes).map_err(|e| to_py(py, e))?;
        let mode = self::shared_mode(py, shared_mode)?;
        let timeout = Duration::try_from_secs_f64(attach_timeout).map_err(|_| {
            raise(
                py,
                "InvalidArgumentError",
                format!("attach_timeout must be a non-negative number, got {attach_timeout}"),
            )
        })?;
        if num_threads == 0 || num_threads > 1024 {
            return Err(raise(
                py,
                "InvalidArgumentError",
                format!("num_threads must be 1-1024, got {num_threads}"),
            ));
        }
        let options = HostPoolOptions {
            region: RegionOptions {
                lock_pages,
                huge_pages,
                shared: shared_name.map(|name| SharedOptions {
                    name,
                    mode,
                    attach_timeout: timeout,
                    janitor,
                }),
                force_touch_prefault: false,
                prefault_threads: num_threads,
                test_creator_stall: test_creator_stall.map(|(secs, fail)| {
                    let pause = Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO);
                    (pause.min(Duration::from_secs(3600)), fail)
                }),
            },
            num_threads,
        };
        let pool = detached(py, || HostPool::new(layout, &options)).map_err(|e| to_py(py, e))?;
        Ok(Self {
            region: Arc::downgrade(pool.region()),
            jobs: pool.jobs().clone(),
            info: pool.region().info().clone(),
            layout,
            num_threads,
            pool: RwLock::new(Some(Arc::new(pool))),
            buffers: Mutex::new(HashMap::new()),
        })
    }

    #[getter]
    fn num_chunks(&self) -> usize {
        self.layout.num_chunks()
    }

    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.layout.chunk_bytes()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.layout.total_bytes()
    }

    #[getter]
    fn mapped_bytes(&self) -> usize {
        self.region.upgrade().map_or(0, |r| r.mapped_len())
    }

    #[getter]
    fn address(&self) -> usize {
        self.region.upgrade().map_or(0, |r| r.as_ptr() as usize)
    }

    #[getter]
    fn num_threads(&self) -> usize {
        self.num_threads
    }

    /// Region facts: prefault method and seconds, locked, huge pages, shared path, creator.
    fn info(&self) -> (&'static str, f64, bool, bool, Option<String>, bool) {
        let i = &self.info;
        (
            i.prefault_method,
            i.prefault_seconds,
            i.locked,
            i.huge_pages,
            i.shared_path.clone(),
            i.creator,
        )
    }

    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        // Waited for detached, as every wait on this lock: a `close` waiting for the write lock
        // makes new readers wait behind it, for as long as a `submit` holds the read lock.
        self.pool
            .read_py_attached(py)
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// Whether the memory is unmapped (closed, and no view or job holds it any more).
    #[getter]
    fn released(&self) -> bool {
        self.region.strong_count() == 0
    }

    /// The whole pool as a writable `uint8[num_chunks, chunk_bytes]` view.
    fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<u8>>> {
        let region = Arc::clone(self.pool(py)?.region());
        let (n, cb) = (self.layout.num_chunks(), self.layout.chunk_bytes());
        // SAFETY: the region maps `n * cb` bytes from `as_ptr`, and the owner created next
        // keeps it mapped for as long as the array (its base) lives.
        let arr = unsafe {
            let v = ArrayView2::from_shape_ptr((n, cb), region.as_ptr().cast_const());
            let owner = Bound::new(py, HostMemoryOwner { region })?;
            PyArray2::borrow_from_array(&v, owner.into_any())
        };
        Ok(arr)
    }

    /// Copy now, detached, on up to `threads` threads (0: all).
    #[pyo3(signature = (direction, buf, block_bytes, blocks, chunks, chunk_offset=0, threads=0))]
    #[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)] // Python signature
    fn transfer(
        &self,
        py: Python<'_>,
        direction: &str,
        buf: Bound<'_, PyArray1<u8>>,
        block_bytes: usize,
        blocks: PyReadonlyArray1<'_, i64>,
        chunks: PyReadonlyArray1<'_, i64>,
        chunk_offset: usize,
        threads: usize,
    ) -> PyResult<()> {
        let dir = self::direction(py, direction)?;
        let pool = self.pool(py)?;
        let (borrow, raw) = borrowing(py, || borrow_buf(py, &buf, dir))?;
        let spec = TransferSpec {
            block_bytes,
            chunk_offset,
            blocks: ids(py, &blocks, "block ids")?,
            chunks: ids(py, &chunks, "chunk ids")?,
        };
        // SAFETY: `buf` (bound here) outlives the call and holds `raw`'s bytes; `borrow` keeps
        // other transfers from writing them meanwhile.
        let result = detached(py, || unsafe { pool.transfer(dir, raw, &spec, threads) });
        drop(borrow);
        result.map_err(|e| to_py(py, e))
    }

    /// Validate now and queue job `job_id`; the buffer is kept alive until its result is taken.
    #[pyo3(signature = (job_id, direction, buf, block_bytes, blocks, chunks, chunk_offset=0))]
    #[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)] // Python signature
    fn submit(
        &self,
        py: Python<'_>,
        job_id: u64,
        direction: &str,
        buf: Bound<'_, PyArray1<u8>>,
        block_bytes: usize,
        blocks: PyReadonlyArray1<'_, i64>,
        chunks: PyReadonlyArray1<'_, i64>,
        chunk_offset: usize,
    ) -> PyResult<()> {
        let dir = self::direction(py, direction)?;
        // The pool stays locked for reading until the job is queued and its buffer kept: a
        // concurrent `close` takes the pool under the write lock, then waits for the queued jobs,
        // then drops the kept buffers, so it either refuses this job or waits for it. (Queued
        // after that wait, the job would have written into a buffer `close` then dropped.) Only
        // a free-threaded build can interleave the two; with the GIL this call runs under it.
        let guard = self
            .pool
            .read_py_attached(py)
            .unwrap_or_else(PoisonError::into_inner);
        let Some(pool) = guard.as_ref() else {
            return Err(closed(py));
        };
        // The borrow is checked now and released at once: a queued job outlives this call, and
        // numpy's borrow flags cannot travel with it (documented: do not write a job's buffer).
        let raw = borrowing(py, || borrow_buf(py, &buf, dir).map(|(_, raw)| raw))?;
        let spec = TransferSpec {
            block_bytes,
            chunk_offset,
            blocks: ids(py, &blocks, "block ids")?,
            chunks: ids(py, &chunks, "chunk ids")?,
        };
        let keep = buf.into_any().unbind();
        let mut map = self.buffers(py);
        let result = if map.contains_key(&job_id) {
            Err(CoreError::InvalidArgument(format!(
                "job id {job_id} is already in flight or its result has not been taken"
            )))
        } else {
            // SAFETY: `keep` holds the array behind `raw`; it leaves `buffers` only after the
            // job is reported finished (get_finished) or all jobs are waited for (close, drop).
            unsafe { pool.submit(job_id, dir, raw, &spec) }
        };
        let rejected = match result {
            Ok(()) => {
                map.insert(job_id, keep);
                None
            }
            Err(e) => Some((e, keep)),
        };
        drop(map);
        // Released before `keep` is: a decref may run Python code, which may close the pool.
        drop(guard);
        match rejected {
            None => Ok(()),
            Some((e, keep)) => {
                drop(keep);
                Err(to_py(py, e))
            }
        }
    }

    /// Results of the jobs finished since the last call: `[(job_id, success)]`.
    fn get_finished(&self, py: Python<'_>) -> Vec<(u64, bool)> {
        // Results taken and buffers forgotten under the buffers' lock, under which `submit`
        // queues: an id whose result this returns is free for reuse at once, never refused by a
        // submit that still finds its buffer kept. The buffers are dropped after the lock (a
        // decref may run Python code).
        let map = self.buffers(py);
        let done = self.jobs.take_finished();
        release_buffers(map, done.iter().map(|&(id, _)| id));
        done
    }

    /// Block (detached) until none of `job_ids` is in flight.
    #[allow(clippy::needless_pass_by_value)] // extracted from a Python list
    fn wait(&self, py: Python<'_>, job_ids: Vec<u64>) {
        detached(py, || self.jobs.wait(&job_ids));
    }

    /// Cancel a job that has not started; it then reports failure. Returns whether it did.
    fn cancel(&self, job_id: u64) -> bool {
        self.jobs.cancel(job_id)
    }

    /// Jobs submitted and not finished.
    fn in_flight(&self) -> usize {
        self.jobs.in_flight()
    }

    /// Wait for queued jobs, then drop this object's hold on the memory. It is unmapped when the
    /// last view is gone too. Idempotent.
    fn close(&self, py: Python<'_>) {
        // Taken once no `submit` is between taking the pool and keeping its job's buffer.
        let pool = self
            .pool
            .write_py_attached(py)
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        detached(py, || self.jobs.wait_all());
        drop(pool);
        // Every kept buffer, taken under the lock and dropped after it (a decref may run
        // Python code).
        let all = std::mem::take(&mut *self.buffers(py));
        drop(all);
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // Jobs write through raw pointers into buffers held in `self.buffers`, which are dropped
        // after this: wait for every job first.
        self.jobs.wait_all();
    }
}

/// Fork hook, in the parent before a fork (`kvoffload_core::host::before_fork`).
#[pyfunction]
pub(crate) fn _before_fork() {
    kvoffload_core::host::before_fork();
}

/// Fork hook, in the parent after a fork (`kvoffload_core::host::after_fork_in_parent`).
#[pyfunction]
pub(crate) fn _after_fork_in_parent() {
    kvoffload_core::host::after_fork_in_parent();
}

/// Fork hook, in the child (`kvoffload_core::host::after_fork_in_child`).
#[pyfunction]
pub(crate) fn _after_fork_in_child() {
    kvoffload_core::host::after_fork_in_child();
}
