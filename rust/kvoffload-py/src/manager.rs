//! `ManagerCore`: the core manager behind a lock, with arguments read in one pass and results
//! built after the lock is released. With a built-in policy no Python runs while a Rust lock is
//! held. A Python policy ([`PythonPolicy`]) runs under the lock, and a call from inside the
//! policy is refused. Either way a held lock is waited for detached from the interpreter.

use crate::errors::{poisoned, raise, to_py};
use crate::keys::{bytes_in, one_key, result_types, Context, Keys, ResultTypes};
use crate::lists::new_list;
use crate::liveness::Liveness;
use crate::policy::external::PythonPolicy;
use crate::policy::state::{state_dict, state_keys};
use crate::request::{RequestRankCell, RequestState, StateLockError};
use kvoffload_core::recycle::{self, Recycled};
use kvoffload_core::{self as core, Lookup, Manager, ManagerConfig, PolicyKind};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// Why the manager could not be locked.
enum LockError {
    /// Poisoned (only after a panic, which this crate does not raise).
    Poisoned,
    /// Called from inside its own Python policy.
    Reentrant,
    /// A request state held by this thread's call that runs a Python policy.
    StateInUse,
    /// This process is a fork's child, and another thread of the parent held the lock at the
    /// fork: that thread does not exist here, so the lock is never released.
    Orphaned,
    /// This thread holds the lock for a fork about to happen: the call comes from a fork hook
    /// that Python runs after kvoffload's.
    HeldForFork,
}

impl LockError {
    fn into_py(self, py: Python<'_>) -> PyErr {
        match self {
            LockError::Poisoned => poisoned(py),
            LockError::Reentrant => raise(
                py,
                "ReentrantCallError",
                "the manager was called from inside its own cache policy; a policy must not \
                 call the manager that drives it"
                    .into(),
            ),
            LockError::StateInUse => crate::request::in_use(py),
            LockError::Orphaned => raise(
                py,
                "ForkedWhileBusyError",
                "this process was forked while another thread was inside a call of this manager \
                 (its Python cache policy did not return in time); that call never ends in the \
                 forked child, so the manager cannot be used here"
                    .into(),
            ),
            LockError::HeldForFork => raise(
                py,
                "ReentrantCallError",
                "the manager was called from an os.register_at_fork(before=...) hook that runs \
                 while kvoffload holds its managers for the fork (hooks registered before \
                 kvoffload was imported run after its own); register the hook after importing \
                 kvoffload"
                    .into(),
            ),
        }
    }
}

/// The manager and the Python key object each resident chunk was stored under.
///
/// Evictions hand back the very objects that were stored (as vLLM does, whose policy keeps
/// them as dict keys), without building new `bytes`. `keys[c]` is `Some` exactly while chunk
/// `c` is resident. Objects leaving the table are moved out under the lock and released only
/// after it (a decref may run Python code).
struct Core {
    manager: Manager,
    keys: Vec<Option<Py<PyBytes>>>,
    /// The chunk each recently stored or loaded key object went to, by the object's address.
    memo: ChunkMemo,
    /// The events queued so far, oldest first: the manager's, moved here by
    /// [`queuing`](Core::queuing) after each call that queues them.
    events: Vec<KeptEvent>,
    /// The key objects of the [`KeptKeys::Objects`] events, one after another.
    event_objs: Vec<Py<PyBytes>>,
    /// The current call runs on this thread, attached to the interpreter, from start to end
    /// (set by the call wrappers, [`ManagerCore::policy_call`] and [`ManagerCore::borrowing`],
    /// and cleared before they release the lock).
    attached: bool,
}

/// An event of the manager with its keys as kvoffload hands them out.
struct KeptEvent {
    keys: KeptKeys,
    removed: bool,
    metadata_only: bool,
}

/// How a [`KeptEvent`] holds its keys.
enum KeptKeys {
    /// Key objects, referenced (no key copied): the next this many of [`Core::event_objs`].
    Objects(usize),
    /// The manager's copies of the keys.
    Bytes(Vec<core::KeyBuf>),
    /// A chunk of the event had no stored key object (a broken invariant, reported when the
    /// events are taken).
    Missing(core::ChunkId),
}

/// Entries of a [`ChunkMemo`] (a power of two): 32 KiB, so that the keys of a scheduler step's
/// loads and stores are mostly still there when they complete or are touched (with 1,024
/// entries, the misses cost `benches/vllm_step.py`'s replay about 1.5% of its instructions).
const MEMO_ENTRIES: usize = 4096;

/// A small direct-mapped table from a key object's address to the chunk the object was last
/// stored to or loaded from. `complete_store`, `complete_load` and `touch` usually get the
/// very objects of the `prepare_store` or `prepare_load` before them, and pass these guesses to
/// the core, which checks each against its slot's key bytes (a stale or reused address costs one
/// comparison and changes no result) instead of hashing the key and probing the index. When
/// every guessed chunk keeps the very object named (`Core::keys`), the core is told it may skip
/// even that comparison ([`Core::guesses`]).
struct ChunkMemo {
    /// `(tag, chunk)`: the tag is the address's low bits past the alignment, so two objects may
    /// share an entry's tag; a guess is only a guess either way.
    entries: Box<[(u32, core::ChunkId)]>,
}

impl ChunkMemo {
    fn new() -> Self {
        Self {
            entries: vec![(u32::MAX, 0); MEMO_ENTRIES].into_boxed_slice(),
        }
    }

    fn index(addr: usize) -> usize {
        let spread = (addr as u64 >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (spread >> (64 - MEMO_ENTRIES.trailing_zeros())) as usize
    }

    fn tag(addr: usize) -> u32 {
        (addr >> 4) as u32
    }

    /// The object at `addr` went to chunk `c`.
    fn put(&mut self, addr: usize, c: core::ChunkId) {
        self.entries[Self::index(addr)] = (Self::tag(addr), c);
    }

    /// Whether the object at `addr` has a guess.
    fn has(&self, addr: usize) -> bool {
        self.entries[Self::index(addr)].0 == Self::tag(addr)
    }

    /// The guessed chunk of the object at `addr`.
    #[inline]
    fn get(&self, addr: usize) -> Option<core::ChunkId> {
        let (t, c) = self.entries[Self::index(addr)];
        (t == Self::tag(addr)).then_some(c)
    }
}

/// The memo's guesses of a call's chunks ([`Core::guesses`]), as the core takes them.
struct Guesses {
    chunks: Recycled<Option<core::ChunkId>>,
    vouched: bool,
}

impl Guesses {
    fn hints(&self) -> core::Hints<'_> {
        core::Hints {
            chunks: &self.chunks,
            vouched: self.vouched,
        }
    }
}

/// Complete the loads of `keys` (at `addrs`), with the memo's guesses of their chunks.
fn complete_loads(m: &mut Core, keys: &[&[u8]], addrs: &[usize]) -> core::Result<()> {
    let guesses = m.guesses(addrs);
    m.complete_load_hinted(keys, guesses.hints())
}

/// Complete the stores of `keys` (at `addrs`), with the memo's guesses of their chunks; the
/// key objects of the chunks a failed store freed, for the caller to drop after the lock.
fn complete_stores(
    m: &mut Core,
    keys: &[&[u8]],
    addrs: &[usize],
    success: bool,
) -> Recycled<Option<Py<PyBytes>>> {
    let guesses = m.guesses(addrs);
    let freed = m.queuing(Some(addrs), |m| {
        m.complete_store_hinted(keys, guesses.hints(), success)
    });
    let objs = m.take_keys(&freed);
    recycle::give(freed);
    objs
}

/// Touch `keys` (at `addrs`). Guesses only when the first key has one (a touch of the keys
/// just loaded), so that a touch of other keys pays one memo read, not one per key.
fn touch_keys(m: &mut Core, keys: &[&[u8]], addrs: &[usize]) {
    if addrs.first().is_some_and(|&a| m.memo.has(a)) {
        let guesses = m.guesses(addrs);
        m.touch_hinted(keys, guesses.hints());
    } else {
        m.touch(keys);
    }
}

/// The addresses of key objects, for a [`ChunkMemo`] (the closures that may run detached
/// from the interpreter take these, not the objects).
fn addresses(objs: &[Bound<'_, PyBytes>]) -> Recycled<usize> {
    objs.iter().map(|o| o.as_ptr() as usize).collect()
}

impl Core {
    /// Run `call`, a manager call that may queue events, and move its events to
    /// [`events`](Core::events): on a thread attached for the whole call, with key objects
    /// (the manager copies no key), otherwise with the manager's copies. An event of
    /// `complete_store` gets the call's own objects, at `args` (their addresses), as vLLM's
    /// does; any other, the stored objects of its chunks. Must run before those move.
    #[inline]
    fn queuing<R>(&mut self, args: Option<&[usize]>, call: impl FnOnce(&mut Manager) -> R) -> R {
        if !self.manager.events_enabled() {
            return call(&mut self.manager);
        }
        let objects = self.attached;
        self.manager.set_event_chunks(objects);
        let out = call(&mut self.manager);
        self.manager.set_event_chunks(false);
        for e in self.manager.drain_events() {
            // Only events queued in chunk mode name chunks (older ones, of calls made
            // elsewhere, carry copies).
            let keys = if e.chunks.is_empty() {
                KeptKeys::Bytes(e.keys)
            } else {
                // SAFETY: events carry chunks only while `objects`, that is `attached`, is set:
                // this thread is attached to the interpreter for the whole call (the wrappers
                // that set it run the call without detaching), so it may take references.
                let py = unsafe { Python::assume_attached() };
                // Places ascend: the last is below the call's number of keys.
                let named = e.positions.last().map(|&i| i as usize);
                let keys = match args.filter(|a| named.is_some_and(|i| i < a.len())) {
                    Some(args) => {
                        self.event_objs.extend(e.positions.iter().map(|&i| {
                            let obj = args[i as usize] as *mut pyo3::ffi::PyObject;
                            // SAFETY: the addresses of the call's key objects (`bytes`), alive
                            // while it runs (its caller holds them).
                            unsafe {
                                Bound::from_borrowed_ptr(py, obj)
                                    .cast_into_unchecked::<PyBytes>()
                                    .unbind()
                            }
                        }));
                        KeptKeys::Objects(e.positions.len())
                    }
                    None => Self::objects_of(py, &self.keys, &e.chunks, &mut self.event_objs),
                };
                recycle::give(e.chunks);
                recycle::give(e.positions);
                keys
            };
            self.events.push(KeptEvent {
                keys,
                removed: e.removed,
                metadata_only: e.metadata_only,
            });
        }
        out
    }

    /// References to the stored key objects of `chunks`, appended to `objs`.
    fn objects_of(
        py: Python<'_>,
        stored: &[Option<Py<PyBytes>>],
        chunks: &[core::ChunkId],
        objs: &mut Vec<Py<PyBytes>>,
    ) -> KeptKeys {
        let start = objs.len();
        for &c in chunks {
            let Some(obj) = stored.get(c as usize).and_then(Option::as_ref) else {
                objs.truncate(start);
                return KeptKeys::Missing(c);
            };
            objs.push(obj.clone_ref(py));
        }
        KeptKeys::Objects(chunks.len())
    }

    /// The memo's guess of the chunk of each object at `addrs`, and whether the guesses can
    /// be vouched for: each guessed chunk keeps that very object. The object is then alive and
    /// the chunk's, so whenever the chunk holds a key, the key is the object's bytes (the rule
    /// `check_invariants` checks), and the core need not compare them.
    fn guesses(&self, addrs: &[usize]) -> Guesses {
        // The guessed chunks' entries are read only after all are prefetched: in a large
        // pool they are cold, and their misses overlap.
        let chunks: Recycled<Option<core::ChunkId>> = addrs
            .iter()
            .map(|&addr| {
                let hint = self.memo.get(addr);
                if let Some(kept) = hint.and_then(|c| self.keys.get(c as usize)) {
                    kvoffload_core::mem::prefetch(kept);
                }
                hint
            })
            .collect();
        // A key without a guess (its memo entry taken by another object) claims nothing, so
        // it does not spoil the vouch for the others: it is looked up.
        let vouched = chunks.iter().zip(addrs).all(|(&hint, &addr)| {
            hint.is_none_or(|c| {
                self.keys
                    .get(c as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|obj| obj.as_ptr() as usize == addr)
            })
        });
        Guesses { chunks, vouched }
    }

    /// Forget the key objects of `chunks`; the caller drops them once the lock is released.
    fn take_keys(&mut self, chunks: &[core::ChunkId]) -> Recycled<Option<Py<PyBytes>>> {
        self.take_keys_leaving_room(chunks, 0)
    }

    /// [`take_keys`](Self::take_keys) into a list with room for `extra` more objects.
    fn take_keys_leaving_room(
        &mut self,
        chunks: &[core::ChunkId],
        extra: usize,
    ) -> Recycled<Option<Py<PyBytes>>> {
        let mut objs = Recycled::with_capacity(chunks.len() + extra);
        objs.extend(
            chunks
                .iter()
                .map(|&c| self.keys.get_mut(c as usize).and_then(Option::take)),
        );
        objs
    }

    /// Remember `obj` as the key object of chunk `c`. Returns what the slot held before
    /// (nothing, by the invariant) for the caller to drop after the lock.
    fn put_key(&mut self, c: core::ChunkId, obj: Py<PyBytes>) -> Option<Py<PyBytes>> {
        let i = c as usize;
        if i >= self.keys.len() {
            kvoffload_core::mem::resize_huge_with(&mut self.keys, i + 1, || None);
        }
        self.keys[i].replace(obj)
    }

    /// The Python policy, when the manager drives one.
    fn python_policy(&mut self) -> Option<&mut PythonPolicy> {
        self.manager
            .policy_mut()
            .as_any_mut()?
            .downcast_mut::<PythonPolicy>()
    }

    /// Hand a Python policy the coming call's context and key objects.
    fn begin(&mut self, ctx: Option<&Bound<'_, PyAny>>, keys: &[Bound<'_, PyBytes>]) {
        if let Some(p) = self.python_policy() {
            p.begin(ctx, keys);
        }
    }

    /// End a call; the first exception a Python policy raised in it.
    fn finish(&mut self) -> Option<PyErr> {
        self.python_policy().and_then(PythonPolicy::finish)
    }

    /// Forget the key objects of chunks that are no longer resident (after a call that failed
    /// part-way); returns them for the caller to drop after the lock.
    fn forget_evicted(&mut self) -> Vec<Py<PyBytes>> {
        let mut gone = Vec::new();
        for c in 0..self.keys.len() {
            if self.keys[c].is_some() && self.manager.key_of(c as core::ChunkId).is_none() {
                gone.extend(self.keys[c].take());
            }
        }
        gone
    }
}

/// The result of a call whose Python policy may have raised: the policy's own exception first.
fn settle<T>(py: Python<'_>, result: core::Result<T>, raised: Option<PyErr>) -> PyResult<T> {
    match raised {
        Some(err) => Err(err),
        None => result.map_err(|e| to_py(py, e)),
    }
}

/// Calls with at least this many keys release the GIL while the core works (built-in policies
/// only): other Python threads run meanwhile. Smaller calls keep it, since taking it back after
/// another thread got it can cost a whole switch interval.
const DETACH_MIN_KEYS: usize = 128;

/// The context's rank cell (a new one when it has none), its rank taken up by the fresh
/// `state` when the same manager drew it in the same cache generation.
fn rank_cell(
    py: Python<'_>,
    ctx: &Context<'_>,
    state: &mut core::RequestState,
) -> PyResult<Py<RequestRankCell>> {
    if let Some(obj) = ctx.get_state(&py.get_type::<RequestRankCell>())? {
        if let Ok(cell) = obj.cast_into::<RequestRankCell>() {
            cell.get().offer_to(state);
            return Ok(cell.unbind());
        }
    }
    Py::new(py, RequestRankCell::new())
}

/// Put a fresh request state on the context, after its rank cell (when it has one). A
/// context's `set_state` may raise: this runs before the call changes anything.
fn install(ctx: &Context<'_>, state: &Bound<'_, RequestState>) -> PyResult<()> {
    if let Some(cell) = &state.get().rank_cell {
        ctx.set_state(cell.bind(state.py()).as_any())?;
    }
    ctx.set_state(state.as_any())
}

/// Renew `state` if a reset made it stale after [`ManagerCore::request_state`] checked it (another
/// thread's `reset_cache` between that check and this call's lock: the GIL no longer makes the
/// two one step). The renewed state is what `request_state` returns after a reset; the stale one
/// carries the old generation's LRU rank, which the new generation has not issued. Like a fresh
/// state, the renewed one takes up the rank in the context's rank cell (`st`'s) if it fits.
fn renew_if_stale(m: &Core, s: &mut core::RequestState, st: &RequestState) {
    if !m.is_current(s) {
        *s = m.new_request_state();
        if let Some(cell) = &st.rank_cell {
            cell.get().offer_to(s);
        }
    }
}

/// Lock one request's state for an attached call (see [`RequestState::lock_attached`]).
fn lock_state<'s>(
    py: Python<'_>,
    state: &'s RequestState,
) -> PyResult<std::sync::MutexGuard<'s, core::RequestState>> {
    state.lock_attached(py).map_err(|e| match e {
        StateLockError::Poisoned => poisoned(py),
        StateLockError::InUse => crate::request::in_use(py),
        StateLockError::Orphaned => crate::request::orphaned(py),
    })
}

impl From<StateLockError> for LockError {
    fn from(e: StateLockError) -> Self {
        match e {
            StateLockError::Poisoned => LockError::Poisoned,
            StateLockError::InUse => LockError::StateInUse,
            StateLockError::Orphaned => LockError::Orphaned,
        }
    }
}

/// How many times `on_request_finished` reads a request's positions when the request records
/// new keys meanwhile.
const FINISH_TRIES: usize = 4;

/// What `on_request_finished` read of a request before it locks the manager: the positions of
/// its seen keys, the object each was asked for with (`objs[j]` holds seen key `j`'s bytes),
/// and the state's cache generation then.
struct FinishRead<'py> {
    positions: Recycled<Option<i64>>,
    objs: Recycled<Bound<'py, PyAny>>,
    generation: u64,
}

/// A manager's lock, held by the forking thread from just before a fork to just after it.
struct ForkHold {
    /// Declared first, so dropped (the lock released) before `owner`.
    _guard: MutexGuard<'static, Core>,
    /// The manager whose mutex `_guard` locks, kept alive while the guard is.
    owner: Py<ManagerCore>,
}

thread_local! {
    /// The locks [`_managers_before_fork`] took on this thread, released after the fork.
    static FORK_HOLDS: RefCell<Vec<ForkHold>> = const { RefCell::new(Vec::new()) };
}

/// Fork hook, before a fork: lock every manager of `cores`, waiting for calls that other
/// threads are running to end, so that the child's copy of each is one no call is halfway
/// through, and unlocked. Managers with a Python policy are locked first (their policy may
/// call a built-in one), and waited for until `python_wait_s` seconds after the hook began
/// (one deadline for all of them).
#[pyfunction]
pub(crate) fn _managers_before_fork(
    py: Python<'_>,
    cores: Vec<Bound<'_, ManagerCore>>,
    python_wait_s: f64,
) {
    let wait = Duration::try_from_secs_f64(python_wait_s).unwrap_or(Duration::ZERO);
    let deadline = Instant::now()
        .checked_add(wait)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
    let mut cores = cores;
    cores.sort_by_key(|c| !c.get().python_policy);
    for c in cores {
        if held_for_fork(c.get()) {
            continue;
        }
        let owner = c.unbind();
        // SAFETY: the reference points into the Python object `owner` owns a strong reference
        // to, which stays where it is while it lives (a frozen pyclass is never moved or
        // mutably borrowed). The only borrow made from it, `guard`, is stored next to `owner`
        // in a `ForkHold`, whose field order drops the guard before the reference.
        let core: &'static ManagerCore = unsafe { &*std::ptr::from_ref(owner.get()) };
        if let Some(guard) = core.lock_for_fork(py, deadline) {
            FORK_HOLDS.with(|h| {
                h.borrow_mut().push(ForkHold {
                    _guard: guard,
                    owner,
                });
            });
        }
    }
}

/// Whether this thread holds `core`'s lock for a fork.
fn held_for_fork(core: &ManagerCore) -> bool {
    FORK_HOLDS.with(|h| {
        h.try_borrow()
            .is_ok_and(|h| h.iter().any(|f| std::ptr::eq(f.owner.get(), core)))
    })
}

/// Release what [`_managers_before_fork`] locked on this thread (each dropped outside the
/// list's borrow: a manager's last reference may go with it).
fn release_fork_holds() {
    let holds = FORK_HOLDS.with(|h| std::mem::take(&mut *h.borrow_mut()));
    drop(holds);
}

/// Fork hook, in the parent after a fork (or a failed one): unlock the managers.
#[pyfunction]
pub(crate) fn _managers_after_fork_in_parent() {
    release_fork_holds();
}

/// Fork hook, in the child: unlock the managers held through the fork; a manager of `cores`
/// whose lock another thread still held (its wait timed out, or it was made during the fork's
/// hooks) is marked orphaned, so that calls raise `ForkedWhileBusyError` instead of waiting
/// for a thread this process does not have. Counting the fork ([`FORK_EPOCH`]) does the same
/// for request states that such a call held.
///
/// [`FORK_EPOCH`]: crate::request::FORK_EPOCH
#[pyfunction]
pub(crate) fn _managers_after_fork_in_child(cores: Vec<Bound<'_, ManagerCore>>) {
    crate::request::FORK_EPOCH.fetch_add(1, Ordering::Relaxed);
    release_fork_holds();
    for c in cores {
        let core = c.get();
        if core.python_policy && core.busy.load(Ordering::Acquire) == thread_mark() {
            continue; // forked from inside its policy: this thread's call goes on
        }
        if let Err(TryLockError::WouldBlock) = core.inner.try_lock() {
            core.orphaned.store(true, Ordering::Release);
        }
    }
}

/// Wait before trying a contended lock again, detached from the interpreter (the holder may
/// need it): yield the first 63 times, then sleep 50 µs a time.
fn back_off(py: Python<'_>, spins: &mut u32) {
    *spins += 1;
    let first = *spins < 64;
    py.detach(|| {
        if first {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    });
}

/// An address unique to the calling thread while it lives.
pub(crate) fn thread_mark() -> usize {
    thread_local!(static MARK: u8 = const { 0 });
    MARK.with(|m| std::ptr::from_ref(m) as usize)
}

impl std::ops::Deref for Core {
    type Target = Manager;

    fn deref(&self) -> &Manager {
        &self.manager
    }
}

impl std::ops::DerefMut for Core {
    fn deref_mut(&mut self) -> &mut Manager {
        &mut self.manager
    }
}

/// The Rust manager; `kvoffload.CPUOffloadingManager` adapts it to vLLM's API.
#[pyclass(frozen, weakref, module = "kvoffload._native")]
pub(crate) struct ManagerCore {
    inner: Mutex<Core>,
    /// The policy's name (a Python policy's class name).
    policy: String,
    /// The policy is Python code, which runs while the manager is locked.
    python_policy: bool,
    /// With a Python policy: the thread running a call that may run the policy (0: none).
    busy: AtomicUsize,
    /// Set in a fork's child when another thread held the lock at the fork (see
    /// [`_managers_after_fork_in_child`]): calls that find the lock taken raise instead of
    /// waiting for ever.
    orphaned: AtomicBool,
    /// Whether the policy reads token positions during calls (LRU does; ARC only at finish).
    reads_positions: bool,
    /// The classes results are built from when not `kvoffload.types`' (vLLM's, say).
    types: Option<ResultTypes>,
    /// The clock of pending writes, and their expiry.
    liveness: Liveness,
    /// The manager's slot table: lookups read it, and load completions (built-in policies)
    /// release pins in it, without the lock.
    table: Arc<core::ChunkTable>,
    /// The interpreter runs with a GIL and the policy is built in: the manager's preference
    /// for pins without compare-and-swap (`Manager::set_exclusive`, set at construction and
    /// off only while a detached call runs; lock-free releases back off meanwhile, and with a
    /// GIL they rarely overlap an attached call anyway).
    exclusive_pins: bool,
}

/// The manager if its lock is free now (and not poisoned), releases applied: uncontended calls
/// that have a lock-free path take the lock instead, which costs less on one thread.
fn uncontended(inner: &Mutex<Core>) -> Option<MutexGuard<'_, Core>> {
    inner.try_lock().ok().map(applied)
}

/// A locked manager, with the releases that lock-free completions queued applied first.
fn applied(mut guard: MutexGuard<'_, Core>) -> MutexGuard<'_, Core> {
    guard.manager.apply_releases();
    guard
}

/// Whether the running interpreter has a GIL (`sys._is_gil_enabled()`, true before 3.13).
fn gil_enabled(py: Python<'_>) -> PyResult<bool> {
    let sys = py.import(intern!(py, "sys"))?;
    match sys.getattr(intern!(py, "_is_gil_enabled")) {
        Ok(f) => f.call0()?.is_truthy(),
        Err(_) => Ok(true),
    }
}

impl ManagerCore {
    /// The classes this manager builds its results from.
    fn types<'a>(&'a self, py: Python<'a>) -> PyResult<&'a ResultTypes> {
        match &self.types {
            Some(t) => Ok(t),
            None => result_types(py),
        }
    }

    /// The manager, locked. A poisoned lock's guard is dropped before the Python error is made.
    fn lock(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, Core>> {
        self.acquire(py).map_err(|e| e.into_py(py))
    }

    /// Lock the manager. A contended lock is waited for detached from the interpreter: on a
    /// free-threaded build a thread blocked while attached holds up every stop-the-world pause
    /// (the garbage collector's), and with it every thread that attaches meanwhile. With a Python
    /// policy the holder may be running Python code, and a call from inside the policy (the
    /// holder's own thread) is refused instead of deadlocking.
    fn acquire(&self, py: Python<'_>) -> Result<MutexGuard<'_, Core>, LockError> {
        if !self.python_policy {
            match self.inner.try_lock() {
                Ok(guard) => return Ok(applied(guard)),
                Err(TryLockError::Poisoned(_)) => return Err(LockError::Poisoned),
                Err(TryLockError::WouldBlock) => self.check_contended()?,
            }
            return self
                .inner
                .lock_py_attached(py)
                .map(applied)
                .map_err(|_| LockError::Poisoned);
        }
        let mut spins = 0u32;
        loop {
            match self.inner.try_lock() {
                Ok(guard) => return Ok(applied(guard)),
                Err(TryLockError::Poisoned(_)) => return Err(LockError::Poisoned),
                Err(TryLockError::WouldBlock) => {
                    if self.busy.load(Ordering::Acquire) == thread_mark() {
                        return Err(LockError::Reentrant);
                    }
                    self.check_contended()?;
                    back_off(py, &mut spins);
                }
            }
        }
    }

    /// Lock the manager from a detached call (see [`acquire`](Self::acquire)).
    fn lock_detached(&self) -> Result<MutexGuard<'_, Core>, LockError> {
        match self.inner.try_lock() {
            Ok(guard) => Ok(guard),
            Err(TryLockError::Poisoned(_)) => Err(LockError::Poisoned),
            Err(TryLockError::WouldBlock) => {
                self.check_contended()?;
                self.inner.lock().map_err(|_| LockError::Poisoned)
            }
        }
    }

    /// Why a lock found taken must not be waited for: `Orphaned` in a fork's child whose copy
    /// of the lock no thread will release, `HeldForFork` when this thread holds it for a fork.
    fn check_contended(&self) -> Result<(), LockError> {
        if self.orphaned.load(Ordering::Acquire) {
            return Err(LockError::Orphaned);
        }
        if held_for_fork(self) {
            return Err(LockError::HeldForFork);
        }
        Ok(())
    }

    /// Lock the manager for a fork, waiting (detached) for a call another thread runs to end;
    /// with a Python policy, whose code may wait on anything, at most until `deadline`. `None`:
    /// not locked (the deadline passed, the lock is poisoned, or this thread holds it: a fork
    /// from inside the policy, whose call goes on in the child as in the parent).
    fn lock_for_fork(&self, py: Python<'_>, deadline: Instant) -> Option<MutexGuard<'_, Core>> {
        if !self.python_policy {
            // No Python code runs under a built-in policy's lock, so its holder is another
            // thread, in Rust, on its way to releasing it.
            return self.inner.lock_py_attached(py).ok();
        }
        if self.busy.load(Ordering::Acquire) == thread_mark() {
            return None;
        }
        let mut spins = 0u32;
        loop {
            match self.inner.try_lock() {
                Ok(guard) => return Some(guard),
                Err(TryLockError::Poisoned(_)) => return None,
                Err(TryLockError::WouldBlock) if Instant::now() >= deadline => return None,
                Err(TryLockError::WouldBlock) => back_off(py, &mut spins),
            }
        }
    }

    /// Run `f` on the manager and one request's state, both locked. With a built-in policy
    /// nothing Python runs while they are held (errors are converted by the caller after this
    /// returns).
    fn with_state<R>(
        &self,
        py: Python<'_>,
        state: &RequestState,
        f: impl FnOnce(&mut Core, &mut core::RequestState) -> R,
    ) -> PyResult<R> {
        let mut m = self.lock(py)?;
        let mut s = lock_state(py, state)?;
        Ok(f(&mut m, &mut s))
    }

    /// Run `f` on the locked manager as a call that may run a Python policy, with the call's
    /// context and key objects; returns `f`'s result and the policy's first exception.
    ///
    /// With a built-in policy and at least [`DETACH_MIN_KEYS`] keys, `f` runs detached from the
    /// interpreter (the GIL released): it must not touch Python objects beyond moving them.
    fn policy_call<R: Send>(
        &self,
        py: Python<'_>,
        ctx: Option<&Bound<'_, PyAny>>,
        keys: &[Bound<'_, PyBytes>],
        state: Option<&RequestState>,
        f: impl FnOnce(&mut Core, Option<&mut core::RequestState>) -> R + Send,
    ) -> PyResult<(R, Option<PyErr>)> {
        if self.detaches(keys.len()) {
            let out = py.detach(|| {
                let mut m = applied(self.lock_detached()?);
                let mut s = match state {
                    Some(st) => Some(st.lock_detached().map_err(LockError::from)?),
                    None => None,
                };
                // Detached, other threads run: their completions stay lock-free meanwhile.
                m.set_exclusive(false);
                let out = f(&mut m, s.as_deref_mut());
                m.set_exclusive(self.exclusive_pins);
                Ok(out)
            });
            return out.map(|r| (r, None)).map_err(|e: LockError| e.into_py(py));
        }
        self.policy_call_attached(py, ctx, keys, state, f)
    }

    /// Whether [`policy_call`](Self::policy_call) runs a call of `n` keys detached.
    fn detaches(&self, n: usize) -> bool {
        !self.python_policy && n >= DETACH_MIN_KEYS
    }

    /// [`policy_call`](Self::policy_call) for a call that does not detach
    /// ([`detaches`](Self::detaches) is false): `f` runs attached, on this thread, so it may
    /// take references to Python objects (and need not be `Send`).
    fn policy_call_attached<R>(
        &self,
        py: Python<'_>,
        ctx: Option<&Bound<'_, PyAny>>,
        keys: &[Bound<'_, PyBytes>],
        state: Option<&RequestState>,
        f: impl FnOnce(&mut Core, Option<&mut core::RequestState>) -> R,
    ) -> PyResult<(R, Option<PyErr>)> {
        let mut m = self.lock(py)?;
        let mut s = match state {
            Some(st) => Some(lock_state(py, st)?),
            None => None,
        };
        m.attached = true;
        if !self.python_policy {
            let out = f(&mut m, s.as_deref_mut());
            m.attached = false;
            return Ok((out, None));
        }
        let mark = thread_mark();
        self.busy.store(mark, Ordering::Release);
        if let Some(st) = state {
            st.set_holder(mark);
        }
        m.begin(ctx, keys);
        let out = f(&mut m, s.as_deref_mut());
        m.attached = false;
        let raised = m.finish();
        if let Some(st) = state {
            st.set_holder(0);
        }
        self.busy.store(0, Ordering::Release);
        Ok((out, raised))
    }

    /// `f` run on the manager and the keys borrowed from the caller's list or tuple, when
    /// that is safe and the lock is free: a built-in policy, exact `bytes` keys, at most
    /// `max_keys` of them (a caller that detaches for long calls passes fewer than
    /// [`DETACH_MIN_KEYS`]), and no other thread holding the lock (a call that would wait).
    /// Otherwise `None`, and nothing ran.
    ///
    /// Taking no reference to each key object saves two calls into the interpreter a key.
    /// `f` runs with no Python code running and without detaching, so no key object can go
    /// away meanwhile; anything it returns that holds Python objects is dropped by the caller,
    /// after the keys are no longer borrowed.
    fn borrowing<R>(
        &self,
        keys: &Bound<'_, PyAny>,
        max_keys: usize,
        f: impl FnOnce(&mut Core, &[&[u8]], &[usize]) -> R,
    ) -> Option<R> {
        if self.python_policy {
            return None;
        }
        Keys::borrowed(keys, max_keys, |slices, addrs| {
            let mut m = uncontended(&self.inner)?;
            m.attached = true;
            let out = f(&mut m, slices, addrs);
            m.attached = false;
            Some(out)
        })
        .flatten()
    }

    /// The context's current state for this manager, or a fresh one to install on success.
    fn request_state<'py>(
        &self,
        py: Python<'py>,
        ctx: &Context<'py>,
    ) -> PyResult<(Bound<'py, RequestState>, bool)> {
        let cls = py.get_type::<RequestState>();
        if let Some(obj) = ctx.get_state(&cls)? {
            if let Ok(state) = obj.cast_into::<RequestState>() {
                let current = self.with_state(py, state.get(), |m, s| m.is_current(s))?;
                if current {
                    return Ok((state, false));
                }
            }
        }
        let mut fresh = self.lock(py)?.new_request_state();
        let cell = if self.reads_positions {
            Some(rank_cell(py, ctx, &mut fresh)?)
        } else {
            None
        };
        Ok((Bound::new(py, RequestState::new(fresh, cell))?, true))
    }

    /// The keys of `keys` whose residency is `resident`, in order.
    fn select_keys<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        resident: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = Keys::extract(keys)?;
        let keep: Vec<bool> = {
            let m = self.lock(py)?;
            keys.slices()
                .iter()
                .map(|k| m.is_resident(k) == resident)
                .collect()
        };
        PyList::new(
            py,
            keys.objs()
                .iter()
                .zip(keep)
                .filter(|(_, k)| *k)
                .map(|(k, _)| k),
        )
    }

    /// The body of `lookup`: one key, the context not read.
    // Inlined, with the key check and the table's probe, into the builtin that the interpreter
    // calls: one function from call to answer measured 610 -> 559 instructions a lookup
    // (callgrind, the bench's loop included).
    #[inline]
    pub(crate) fn lookup_one<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let key = one_key(key)?;
        // The table, lock-free; the lock only when that cannot answer (a long key, or a slot
        // rewritten under the probe).
        let found = match self.table.probe(key, core::hash_key(key)) {
            core::Probe::Miss => Lookup::Miss,
            core::Probe::Pending => Lookup::HitPending,
            core::Probe::Ready => Lookup::Hit,
            core::Probe::Unsure => self.lock(py)?.lookup(key),
        };
        Ok(self.types(py)?.lookup[lookup_index(found)].bind(py).clone())
    }

    /// Positions of a recording call's keys, if the policy reads them, walking the context's
    /// positions dict on from where the request's last call left it.
    fn positions<'py>(
        &self,
        ctx: &Context<'py>,
        keys: &Keys<'py>,
        state: &RequestState,
    ) -> PyResult<Option<Recycled<Option<i64>>>> {
        if !self.reads_positions {
            return Ok(None);
        }
        let mut at = state.cursor.load(Ordering::Relaxed);
        let positions = ctx.positions(keys.objs(), &mut at)?;
        state.cursor.store(at, Ordering::Relaxed);
        Ok(positions)
    }

    /// Positions of a finishing request's seen keys, asked of the context with the key object
    /// each was first offered as (a fresh `bytes` where none is kept). `None`: the state is
    /// stale or finished. The context is read while no lock is held.
    fn finish_positions<'py>(
        &self,
        py: Python<'py>,
        ctx: &Context<'_>,
        state: &Bound<'_, RequestState>,
    ) -> PyResult<Option<FinishRead<'py>>> {
        let st = state.get();
        let found = self.with_state(py, st, |m, s| {
            (m.is_current(s) && !s.is_finished()).then(|| {
                let objs = st.objs.lock().ok();
                let keys = s
                    .seen_keys()
                    .enumerate()
                    .map(|(j, key)| {
                        let kept = objs
                            .as_ref()
                            .and_then(|o| o.get(j))
                            .and_then(Option::as_ref);
                        match kept {
                            Some(obj) if bytes_in(obj.bind(py)) == key => Ok(obj.clone_ref(py)),
                            _ => Err(key.to_vec()),
                        }
                    })
                    .collect::<Recycled<_>>();
                (keys, s.generation())
            })
        })?;
        let Some((mut found, generation)) = found else {
            return Ok(None);
        };
        // Fresh objects for the keys kept as bytes, then one walk of the dict from its start.
        let objs: Recycled<Bound<'_, PyAny>> = found
            .drain(..)
            .map(|key| match key {
                Ok(obj) => obj.into_bound(py).into_any(),
                Err(bytes) => PyBytes::new(py, &bytes).into_any(),
            })
            .collect();
        let positions = ctx.positions_walking(&objs, &mut 0)?;
        Ok(Some(FinishRead {
            positions,
            objs,
            generation,
        }))
    }

    /// `prepare_store`'s answer for `out`: the keys to store (the call's objects `objs`), the
    /// spec of their chunks and the evicted keys, whose stored objects lead `evicted_objs`.
    fn store_output<'py>(
        &self,
        py: Python<'py>,
        objs: &[Bound<'py, PyBytes>],
        out: core::StoreOutcome,
        mut evicted_objs: Recycled<Option<Py<PyBytes>>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let to_store = new_list(py, out.to_store.iter().map(|&i| objs[i].clone()))?;
        // The stored objects of the victims, moved into the list (no reference count
        // traffic). Every resident chunk has its object; were one missing, the core's copy of
        // the key (kept when events are on) stands in, or the call reports the broken
        // invariant.
        let n_evicted = out.evicted_chunks.len();
        let mut missing = None;
        let evicted = new_list(
            py,
            evicted_objs.drain(..n_evicted).enumerate().map(|(i, obj)| {
                match (obj, out.evicted.get(i)) {
                    (Some(obj), _) => obj.into_bound(py),
                    (None, Some(k)) => PyBytes::new(py, k),
                    (None, None) => {
                        missing = Some(out.evicted_chunks[i]);
                        PyBytes::new(py, b"")
                    }
                }
            }),
        )?;
        if let Some(c) = missing {
            return Err(to_py(
                py,
                core::CoreError::Invariant(format!("evicted chunk {c} had no stored key object")),
            ));
        }
        let types = self.types(py)?;
        let output = types.prepare_store_output.build(
            py,
            &[
                (intern!(py, "keys_to_store"), to_store.into_any()),
                (intern!(py, "store_spec"), spec(py, types, &out.chunks)?),
                (intern!(py, "evicted_keys"), evicted.into_any()),
            ],
        )?;
        out.recycle();
        Ok(output)
    }

    /// Expire the writes older than `timeout` at `now`; their stored key objects, oldest first.
    fn expire<'py>(&self, py: Python<'py>, now: f64, timeout: f64) -> PyResult<Bound<'py, PyList>> {
        // A Python policy hears of each expiry as of a failed store (`remove`).
        let ((expired, mut objs), raised) = self.policy_call(py, None, &[], None, |m, _| {
            let expired = m.queuing(None, |m| m.expire_pending_writes(now, timeout));
            let chunks: Vec<core::ChunkId> = expired.iter().map(|&(c, _)| c).collect();
            let objs = m.take_keys(&chunks);
            (expired, objs)
        })?;
        settle(py, Ok(()), raised)?;
        PyList::new(
            py,
            expired
                .iter()
                .zip(objs.drain(..))
                .map(|((_, k), obj)| obj.map_or_else(|| PyBytes::new(py, k), |o| o.into_bound(py))),
        )
    }
}

/// A flag read as Python reads a condition (`bool(obj)`), as vLLM's `success` is used.
#[derive(Clone, Copy)]
struct Truthy(bool);

impl<'a, 'py> FromPyObject<'a, 'py> for Truthy {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        obj.is_truthy().map(Truthy)
    }
}

fn lookup_index(l: Lookup) -> usize {
    match l {
        Lookup::Miss => 0,
        Lookup::Hit => 1,
        Lookup::HitPending => 2,
    }
}

/// A `CPULoadStoreSpec` over the chunk ids (numpy int32, owned by numpy).
fn spec<'py>(
    py: Python<'py>,
    types: &ResultTypes,
    chunks: &[core::ChunkId],
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: a fresh, C-contiguous, one-dimensional int32 array of `chunks.len()` elements,
    // not yet shared: each element is written once through its data pointer before the array
    // is handed out (the ids go straight in, without a `Vec` in between).
    let array = unsafe {
        let array = PyArray1::<i32>::new(py, [chunks.len()], false);
        let data = array.data();
        for (i, &c) in chunks.iter().enumerate() {
            data.add(i).write(c as i32);
        }
        array
    };
    types
        .cpu_spec
        .build(py, &[(intern!(py, "block_ids"), array.into_any())])
}

#[pymethods]
impl ManagerCore {
    /// `policy` is a built-in policy's name, or a Python policy object (vLLM's `CachePolicy`
    /// interface) whose chunk records are built as `status_class(chunk_id)`.
    #[new]
    #[pyo3(signature = (
        num_chunks, policy, enable_events, store_threshold, max_tracker_size, result_types=None,
        admission="tracker", status_class=None, pending_write_timeout=None, clock=None
    ))]
    #[allow(clippy::too_many_arguments)] // the manager's constructor arguments, one for one
    fn new(
        py: Python<'_>,
        num_chunks: i64,
        policy: &Bound<'_, PyAny>,
        enable_events: bool,
        store_threshold: i64,
        max_tracker_size: i64,
        result_types: Option<&Bound<'_, PyAny>>,
        admission: &str,
        status_class: Option<&Bound<'_, PyAny>>,
        pending_write_timeout: Option<f64>,
        clock: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let liveness = Liveness::new(py, pending_write_timeout, clock)?;
        let admission = match admission {
            "tracker" => core::Admission::Tracker,
            "tinylfu" => core::Admission::TinyLfu,
            other => {
                return Err(raise(
                    py,
                    "InvalidArgumentError",
                    format!("admission must be 'tracker' or 'tinylfu', got {other:?}"),
                ))
            }
        };
        let types = result_types.map(ResultTypes::from_namespace).transpose()?;
        let bad = |msg: String| raise(py, "InvalidArgumentError", msg);
        let num_chunks = u32::try_from(num_chunks)
            .ok()
            .filter(|&n| i32::try_from(n).is_ok())
            .ok_or_else(|| {
                bad(format!(
                    "num_chunks must be in [0, 2**31 - 1], got {num_chunks}"
                ))
            })?;
        let store_threshold = u64::try_from(store_threshold).map_err(|_| {
            bad(format!(
                "store_threshold must be >= 0, got {store_threshold}"
            ))
        })?;
        let max_tracker_size = if store_threshold >= 2 {
            usize::try_from(max_tracker_size)
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| {
                    bad(format!(
                        "max_tracker_size must be >= 1, got {max_tracker_size}"
                    ))
                })?
        } else {
            0
        };
        let mut config = ManagerConfig {
            num_chunks,
            policy: PolicyKind::Lru,
            enable_events,
            store_threshold,
            max_tracker_size,
            admission,
        };
        let (inner, name, python_policy) = if let Ok(name) = policy.cast::<PyString>() {
            let name = name.to_str()?;
            let Some(kind) = PolicyKind::from_name(name) else {
                return Err(raise(
                    py,
                    "UnsupportedPolicyError",
                    format!("no built-in policy {name:?}"),
                ));
            };
            config.policy = kind;
            (Manager::new(&config), kind.name().to_owned(), false)
        } else {
            let Some(status_class) = status_class else {
                return Err(bad("a Python policy needs its status_class".into()));
            };
            let external = PythonPolicy::new(policy, status_class);
            let name = policy.get_type().name()?.to_string();
            (
                Manager::with_policy(&config, Box::new(external)),
                name,
                true,
            )
        };
        let mut inner = inner.map_err(|e| to_py(py, e))?;
        inner.set_clock_source(liveness.source());
        // Calls with a built-in policy pin without compare-and-swap when the interpreter has
        // a GIL; free-threaded, lock-free releases are the point of the table. Detached calls
        // turn it off for their duration (`policy_call`).
        let exclusive_pins = gil_enabled(py)? && !python_policy;
        inner.set_exclusive(exclusive_pins);
        // Evicted keys are answered with the stored objects (`Core::keys`): the core need not
        // copy them.
        inner.set_evicted_keys(false);
        let table = inner.shared_table();
        Ok(Self {
            table,
            exclusive_pins,
            inner: Mutex::new(Core {
                manager: inner,
                keys: Vec::new(),
                memo: ChunkMemo::new(),
                events: Vec::new(),
                event_objs: Vec::new(),
                attached: false,
            }),
            reads_positions: config.policy == PolicyKind::Lru && !python_policy,
            policy: name,
            python_policy,
            busy: AtomicUsize::new(0),
            orphaned: AtomicBool::new(false),
            types,
            liveness,
        })
    }

    /// `LookupResult.MISS`, `.HIT` or `.HIT_PENDING`; the context is not read.
    #[pyo3(signature = (key, req_context=None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        req_context: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = req_context;
        self.lookup_one(py, key)
    }

    /// [`lookup`](Self::lookup) bound to this core as a builtin that the interpreter calls
    /// directly (see [`crate::fastcall`]): the same answers and errors, without `PyO3`'s method
    /// wrapper around each call.
    fn fast_lookup<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        crate::fastcall::bind_lookup(slf)
    }

    /// Number of leading keys that are HIT; the context is not read.
    #[pyo3(signature = (keys, req_context=None))]
    fn lookup_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let _ = req_context;
        let keys = Keys::extract(keys)?;
        let slices = keys.slices();
        // The lock if free, else the lock-free table (a long key needs the lock after all).
        if let Some(m) = uncontended(&self.inner) {
            return Ok(m.lookup_prefix(slices));
        }
        if let Some(hits) = self.table.lookup_prefix(slices) {
            return Ok(hits);
        }
        let (hits, _) =
            self.policy_call(py, None, keys.objs(), None, |m, _| m.lookup_prefix(slices))?;
        Ok(hits)
    }

    /// Pin keys for loading; returns a `CPULoadStoreSpec` of their chunk ids.
    fn prepare_load<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let keys = Keys::extract(keys)?;
        let ctx = Context::new(req_context)?;
        let (state, fresh) = self.request_state(py, &ctx)?;
        let positions = self.positions(&ctx, &keys, state.get())?;
        // Installed first: a context's `set_state` may raise, and must do so before any change.
        if fresh {
            install(&ctx, &state)?;
        }
        let slices = keys.slices();
        let addrs = addresses(keys.objs());
        let st = state.get();
        let ((chunks, mark, added), raised): ((_, _, Recycled<u32>), _) = self.policy_call(
            py,
            Some(ctx.object()),
            keys.objs(),
            Some(state.get()),
            |m, s| {
                let s = s.expect("state given");
                renew_if_stale(m, s, st);
                let (mark, rank) = (s.seen_keys().len(), s.rank_tag());
                let chunks = m.prepare_load(slices, positions.as_deref().map(Vec::as_slice), s);
                st.keep_rank(rank, s);
                if let Ok(chunks) = &chunks {
                    for (&addr, &c) in addrs.iter().zip(chunks) {
                        m.memo.put(addr, c);
                        // `complete_load` reads the chunk's kept object to vouch for the
                        // guess: fetched now, it has arrived by then.
                        if let Some(kept) = m.keys.get(c as usize) {
                            kvoffload_core::mem::prefetch(kept);
                        }
                    }
                }
                (chunks, mark, s.last_added().iter().copied().collect())
            },
        )?;
        if fresh && raised.is_none() && chunks.is_err() {
            state.get().disown(); // an illegal call leaves the request without state
        }
        let chunks = Recycled::from(settle(py, chunks, raised)?);
        state.get().keep_objects(mark, &added, keys.objs());
        spec(py, self.types(py)?, &chunks)
    }

    /// Pin keys for a read that is no request's access (a copy to another tier: vLLM's
    /// `prepare_read`); returns a `CPULoadStoreSpec` of their chunk ids. The context is not read
    /// and no request's state changes; `complete_load` releases the pins.
    #[pyo3(signature = (keys, req_context=None))]
    fn prepare_read<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = req_context;
        let keys = Keys::extract(keys)?;
        let slices = keys.slices();
        let addrs = addresses(keys.objs());
        let (chunks, raised) = self.policy_call(py, None, keys.objs(), None, |m, _| {
            let chunks = m.prepare_read(slices);
            if let Ok(chunks) = &chunks {
                for (&addr, &c) in addrs.iter().zip(chunks) {
                    m.memo.put(addr, c);
                }
            }
            chunks
        })?;
        let chunks = Recycled::from(settle(py, chunks, raised)?);
        spec(py, self.types(py)?, &chunks)
    }

    /// Release one pin per key; the context is not read.
    #[pyo3(signature = (keys, req_context=None))]
    fn complete_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = req_context;
        // Never detached (a release is quick), whatever the number of keys.
        if let Some(done) = self.borrowing(keys, usize::MAX, complete_loads) {
            return done.map_err(|e| to_py(py, e));
        }
        let keys = Keys::extract(keys)?;
        let slices = keys.slices();
        let addrs = addresses(keys.objs());
        // With a built-in policy: the lock if free, else a lock-free release that the next
        // locked call applies. A Python policy sees ref counts mirrored at once, so its
        // manager releases under the lock.
        if !self.python_policy {
            if let Some(mut m) = uncontended(&self.inner) {
                let done = complete_loads(&mut m, slices, &addrs);
                drop(m); // the error is made unlocked
                return done.map_err(|e| to_py(py, e));
            }
            if self.table.release(slices) == core::Release::Done {
                return Ok(());
            }
        }
        let (done, raised) = self.policy_call(py, None, keys.objs(), None, |m, _| {
            complete_loads(m, slices, &addrs)
        })?;
        settle(py, done, raised)
    }

    /// Forward a touch to the policy (a Python policy gets the context).
    #[pyo3(signature = (keys, req_context=None))]
    fn touch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        if self
            .borrowing(keys, DETACH_MIN_KEYS - 1, touch_keys)
            .is_some()
        {
            return Ok(());
        }
        let keys = Keys::extract(keys)?;
        let slices = keys.slices();
        let addrs = addresses(keys.objs());
        let ((), raised) = self.policy_call(py, req_context, keys.objs(), None, |m, _| {
            touch_keys(m, slices, &addrs);
        })?;
        settle(py, Ok(()), raised)
    }

    /// A `PrepareStoreOutput`, or `None` when the offer cannot be placed.
    fn prepare_store<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        // The clock is read, and overdue writes expire, before anything else.
        let now = self.liveness.store_reading(py)?;
        if let (Some(now), Some(timeout)) = (now, self.liveness.timeout) {
            self.expire(py, now, timeout)?;
        }
        let keys = Keys::extract(keys)?;
        let ctx = Context::new(req_context)?;
        let (state, fresh) = self.request_state(py, &ctx)?;
        let positions = self.positions(&ctx, &keys, state.get())?;
        // Installed first: a context's `set_state` may raise, and must do so before any change
        // (after it, the caller would never see the keys to store: pending chunks stranded).
        if fresh {
            install(&ctx, &state)?;
        }
        let slices = keys.slices();
        // The stored keys' objects go into the table by the core call. Attached, it takes a
        // reference to each as it stores it; detached, it cannot, so a reference to every key
        // is taken beforehand (those not stored are dropped after the call).
        let objs = keys.objs();
        let detach = self.detaches(objs.len());
        let mut owned: Recycled<Option<Py<PyBytes>>> = if detach {
            objs.iter().map(|k| Some(k.clone().unbind())).collect()
        } else {
            Vec::new().into()
        };
        let st = state.get();
        let body = |m: &mut Core,
                    s: Option<&mut core::RequestState>,
                    obj: &mut dyn FnMut(usize) -> Option<Py<PyBytes>>| {
            if let Some(now) = now {
                m.set_clock(now);
            }
            let s = s.expect("state given");
            renew_if_stale(m, s, st);
            let (mark, rank) = (s.seen_keys().len(), s.rank_tag());
            let outcome = m.queuing(None, |m| {
                m.prepare_store(slices, positions.as_deref().map(Vec::as_slice), s)
            });
            st.keep_rank(rank, s);
            let mut objs = Recycled::with_capacity(0);
            let mut dropped = Vec::new();
            match &outcome {
                Ok(Some(out)) => {
                    // The victims' objects, then those the stored keys' slots held.
                    objs = m.take_keys_leaving_room(&out.evicted_chunks, out.chunks.len());
                    for (&i, &c) in out.to_store.iter().zip(&out.chunks) {
                        if let Some(o) = obj(i) {
                            m.memo.put(o.as_ptr() as usize, c);
                            objs.push(m.put_key(c, o));
                        }
                    }
                }
                // A Python policy failed after evicting: its victims are gone.
                Err(_) if self.python_policy => dropped = m.forget_evicted(),
                _ => {}
            }
            let added: Recycled<u32> = s.last_added().iter().copied().collect();
            (outcome, objs, dropped, mark, added)
        };
        let ctx_obj = Some(ctx.object());
        let ((outcome, evicted_objs, dropped, mark, added), raised) = if detach {
            self.policy_call(py, ctx_obj, objs, Some(state.get()), |m, s| {
                body(m, s, &mut |i| owned[i].take())
            })?
        } else {
            self.policy_call_attached(py, ctx_obj, objs, Some(state.get()), |m, s| {
                body(m, s, &mut |i| Some(objs[i].clone().unbind()))
            })?
        };
        drop((dropped, owned));
        if fresh && raised.is_none() && outcome.is_err() {
            state.get().disown(); // an illegal call leaves the request without state
        }
        let outcome = settle(py, outcome, raised)?;
        state.get().keep_objects(mark, &added, keys.objs());
        let Some(out) = outcome else { return Ok(None) };
        self.store_output(py, keys.objs(), out, evicted_objs)
            .map(Some)
    }

    /// Finish stores (a false `success`: drop them); the context is not read.
    #[pyo3(
        signature = (keys, req_context=None, success=Truthy(true)),
        text_signature = "($self, keys, req_context=None, success=True)"
    )]
    fn complete_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
        success: Truthy,
    ) -> PyResult<()> {
        let _ = req_context;
        let Truthy(success) = success;
        let quick = self.borrowing(keys, DETACH_MIN_KEYS - 1, |m, slices, addrs| {
            complete_stores(m, slices, addrs, success)
        });
        if let Some(dropped) = quick {
            drop(dropped);
            return Ok(());
        }
        let keys = Keys::extract(keys)?;
        let slices = keys.slices();
        let addrs = addresses(keys.objs());
        let (dropped, raised) = self.policy_call(py, None, keys.objs(), None, |m, _| {
            complete_stores(m, slices, &addrs, success)
        })?;
        drop(dropped);
        settle(py, Ok(()), raised)
    }

    /// Create current request state on the context if it has none.
    fn on_new_request(&self, py: Python<'_>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ctx = Context::new(ctx)?;
        let (state, fresh) = self.request_state(py, &ctx)?;
        if fresh {
            install(&ctx, &state)?;
        }
        Ok(())
    }

    /// Finish the request whose state the context holds (if current and unfinished).
    fn on_request_finished(&self, py: Python<'_>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        let ctx = Context::new(ctx)?;
        let Some(obj) = ctx.get_state(&py.get_type::<RequestState>())? else {
            return Ok(());
        };
        let Ok(state) = obj.cast_into::<RequestState>() else {
            return Ok(());
        };
        // Positions are read (Python) while no lock is held; should the request record new
        // keys meanwhile (another thread, or the context's own callbacks), they are read again.
        for _ in 0..FINISH_TRIES {
            let Some(read) = self.finish_positions(py, &ctx, &state)? else {
                return Ok(());
            };
            let FinishRead {
                positions,
                objs,
                generation,
            } = &read;
            let addrs: Recycled<usize> = objs.iter().map(|o| o.as_ptr() as usize).collect();
            let (done, raised) =
                self.policy_call(py, Some(ctx.object()), &[], Some(state.get()), |m, s| {
                    let s = s.expect("state given");
                    let current = m.is_current(s) && !s.is_finished();
                    // Renewed by a reset since the read, or grown: read again.
                    let moved =
                        s.generation() != *generation || s.seen_keys().len() != positions.len();
                    if current && moved {
                        return None;
                    }
                    // Seen key `j` is the one read, whose bytes `objs[j]` holds. A chunk that
                    // keeps that very object holds those bytes whenever it holds a key (the
                    // rule `Core::guesses` vouches by): its key need not be compared.
                    let Core { manager, keys, .. } = m;
                    Some(manager.on_request_finished_vouched(s, positions, |j, c| {
                        keys.get(c as usize)
                            .and_then(Option::as_ref)
                            .is_some_and(|o| o.as_ptr() as usize == addrs[j])
                    }))
                })?;
            drop(read);
            if let Some(done) = done {
                return settle(py, done, raised);
            }
        }
        Err(raise(
            py,
            "InvalidArgumentError",
            format!(
                "the request kept recording new keys while it was being finished ({FINISH_TRIES} \
                 tries); finish it once its other calls have returned"
            ),
        ))
    }

    /// Drop every chunk and the policy state.
    fn reset_cache(&self, py: Python<'_>) -> PyResult<()> {
        let (dropped, raised) = self.policy_call(py, None, &[], None, |m, _| {
            m.reset_cache();
            std::mem::take(&mut m.keys)
        })?;
        drop(dropped);
        settle(py, Ok(()), raised)
    }

    /// Whether events are queued.
    #[getter]
    fn events_enabled(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.lock(py)?.events_enabled())
    }

    /// Detach the queued events as `(keys, removed, metadata_only)` tuples.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<(Bound<'py, PyList>, bool, bool)>> {
        // The events moved out of the manager first, then any it still holds (newer).
        // The queues leave with their buffers and get kept ones in their place, so that the
        // calls queuing the next events do not grow them from nothing.
        let (mut events, mut objs) = {
            let mut m = self.lock(py)?;
            let mut events = std::mem::replace(&mut m.events, recycle::take(0));
            events.extend(m.take_events().into_iter().map(|e| KeptEvent {
                keys: KeptKeys::Bytes(e.keys),
                removed: e.removed,
                metadata_only: e.metadata_only,
            }));
            (
                events,
                std::mem::replace(&mut m.event_objs, recycle::take(0)),
            )
        };
        let mut remaining = objs.drain(..);
        let taken = events
            .drain(..)
            .map(|e| {
                let keys = match e.keys {
                    KeptKeys::Objects(n) => {
                        new_list(py, remaining.by_ref().take(n).map(|o| o.into_bound(py)))?
                    }
                    KeptKeys::Bytes(keys) => {
                        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))?
                    }
                    KeptKeys::Missing(c) => {
                        let broken = format!("the event of chunk {c} found no stored key object");
                        return Err(to_py(py, core::CoreError::Invariant(broken)));
                    }
                };
                Ok((keys, e.removed, e.metadata_only))
            })
            .collect();
        drop(remaining);
        recycle::give(objs);
        recycle::give(events);
        taken
    }

    /// The keys of `keys` that are not resident (in order).
    fn absent_keys<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.select_keys(py, keys, false)
    }

    /// The keys of `keys` that are resident: pending, ready or pinned (in order).
    fn resident_keys<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.select_keys(py, keys, true)
    }

    /// `(num_chunks, num_used, num_pending, allocation_sizes, stores_skipped or None)`.
    fn take_stats<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(u32, usize, usize, Bound<'py, PyList>, Option<u64>)> {
        let s = self.lock(py)?.take_stats();
        let sizes = PyList::new(py, &s.allocation_sizes)?;
        recycle::give(s.allocation_sizes);
        Ok((
            s.num_chunks,
            s.num_used,
            s.num_pending,
            sizes,
            s.stores_skipped,
        ))
    }

    /// The Python policy object (`None` with a built-in policy).
    #[getter]
    fn python_policy(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        if !self.python_policy {
            return Ok(None);
        }
        let mut m = self.lock(py)?;
        Ok(m.python_policy().map(|p| p.object().clone_ref(py)))
    }

    /// Raise `InvariantViolation` if any internal invariant is broken.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let core = self.lock(py)?;
        // A Python policy's statuses are read here (their ints may run Python code): a call
        // back into this manager from there is refused, as from the policy itself.
        if self.python_policy {
            self.busy.store(thread_mark(), Ordering::Release);
        }
        let checked = core.validate();
        if self.python_policy {
            self.busy.store(0, Ordering::Release);
        }
        let checked = checked.and_then(|()| {
            // Every resident chunk keeps the key object it was stored with, whose bytes are
            // the chunk's key: evicted keys are answered with these objects.
            for (key, c, _) in core.resident() {
                let kept = core.keys.get(c as usize).and_then(Option::as_ref);
                if kept.is_none_or(|obj| obj.bind(py).as_bytes() != key.as_slice()) {
                    return Err(core::CoreError::Invariant(format!(
                        "chunk {c} does not keep the key object it holds"
                    )));
                }
            }
            Ok(())
        });
        drop(core); // the error is made unlocked
        checked.map_err(|e| to_py(py, e))
    }

    /// `{key: (chunk_id, ref_cnt)}` of every resident key.
    fn resident<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let rows: Vec<(Vec<u8>, u32, i32)> = self
            .lock(py)?
            .resident()
            .into_iter()
            .map(|(k, c, r)| (k.to_vec(), c, r))
            .collect();
        let d = PyDict::new(py);
        for (k, c, r) in rows {
            d.set_item(PyBytes::new(py, &k), (c, r))?;
        }
        Ok(d)
    }

    /// The policy's order (see `CPUOffloadingManager.policy_state`).
    fn policy_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (state, keys) = {
            let m = self.lock(py)?;
            let state = m.policy_state();
            let keys = state_keys(&state, |c| {
                m.key_of(c).map(|k| k.to_vec()).unwrap_or_default()
            });
            (state, keys)
        };
        state_dict(py, &self.policy, state, &keys)
    }

    /// `[(key, count)]` oldest first, or `None` without a tracker.
    fn tracker_state<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Vec<(Bound<'py, PyBytes>, u64)>>> {
        let rows: Option<Vec<(Vec<u8>, u64)>> = self
            .lock(py)?
            .tracker()
            .map(|t| t.entries().map(|(k, c)| (k.to_vec(), c)).collect());
        Ok(rows.map(|r| {
            r.into_iter()
                .map(|(k, c)| (PyBytes::new(py, &k), c))
                .collect()
        }))
    }

    /// `(never-used ids handed out, free list with the next-popped id last)`.
    fn pool_state(&self, py: Python<'_>) -> PyResult<(u32, Vec<u32>)> {
        let m = self.lock(py)?;
        let (fresh, free) = m.pool_state();
        Ok((fresh, free.to_vec()))
    }

    /// Set ARC's target size (tests only).
    fn set_arc_target(&self, py: Python<'_>, target: f64) -> PyResult<()> {
        if !target.is_finite() || target < 0.0 {
            return Err(raise(
                py,
                "InvalidArgumentError",
                format!("target must be a finite value >= 0, got {target}"),
            ));
        }
        if self.lock(py)?.set_arc_target(target) {
            Ok(())
        } else {
            Err(raise(
                py,
                "InvalidArgumentError",
                "only the ARC policy has a target size".into(),
            ))
        }
    }
    /// Age in seconds of the oldest pending write, `None` when none is pending.
    fn oldest_pending_write(&self, py: Python<'_>) -> PyResult<Option<f64>> {
        let now = self.liveness.now(py)?;
        Ok(self.lock(py)?.oldest_pending_write(now))
    }

    /// Writes pending now.
    fn num_pending_writes(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.num_pending_writes())
    }

    /// Expire the writes older than `timeout` (default: the manager's); their keys, oldest first.
    #[pyo3(signature = (timeout=None))]
    fn expire_pending_writes<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let timeout = self.liveness.timeout_for(py, timeout)?;
        let now = self.liveness.now(py)?;
        self.expire(py, now, timeout)
    }

    /// `(pending writes, oldest one's age or None, writes expired since the last call)`.
    fn take_liveness_stats(&self, py: Python<'_>) -> PyResult<(usize, Option<f64>, u64)> {
        let now = self.liveness.now(py)?;
        let mut m = self.lock(py)?;
        let oldest = m.oldest_pending_write(now);
        Ok((m.num_pending_writes(), oldest, m.take_expired_writes()))
    }
}
