//! An asynchronous job queue shaped like vLLM's `OffloadingWorker`: submit jobs by id, collect
//! `(job_id, success)` pairs, wait for given ids. Jobs run on a rayon pool; a job that panics (a
//! bug) or is cancelled before it starts reports `false`.

use crate::error::{CoreError, Result};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

/// A caller-chosen job id.
pub type JobId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobState {
    Queued,
    Cancelled,
    Running,
}

#[derive(Default)]
struct Inner {
    /// Jobs submitted and not finished yet.
    active: HashMap<JobId, JobState>,
    /// Finished jobs not yet taken, in finishing order.
    finished: Vec<(JobId, bool)>,
}

#[derive(Default)]
struct Shared {
    inner: Mutex<Inner>,
    /// Signalled whenever a job finishes.
    done: Condvar,
}

impl Shared {
    /// The state; a poisoned lock is recovered (the state is updated in single statements, so
    /// a panic cannot leave it half-changed).
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The queue; cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct JobQueue {
    shared: Arc<Shared>,
    /// The process that made the queue (and the threads that run its jobs).
    pid: u32,
}

impl Default for JobQueue {
    fn default() -> Self {
        Self {
            shared: Arc::default(),
            pid: std::process::id(),
        }
    }
}

impl JobQueue {
    /// An empty queue.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether this is a child forked after the queue was made: the jobs it inherited in flight
    /// have no thread here to finish them (a fork copies only the forking thread), so waiting
    /// for them would never end. In a child the waits return at once and those jobs stay in
    /// flight, abandoned; no thread of the child writes through their buffers.
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// The state, locked; `None` in a forked child, whose queue is empty: the jobs and their
    /// results are the parent's (its threads run them and it reports them), and the lock may have
    /// been copied taken for good (by a parent's thread at the moment of the fork).
    fn state(&self) -> Option<MutexGuard<'_, Inner>> {
        (!self.forked()).then(|| self.shared.lock())
    }

    /// Queue `work` as job `id` on `pool`. An id may be reused once its result was taken.
    pub fn submit(
        &self,
        id: JobId,
        pool: &rayon::ThreadPool,
        work: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        {
            let mut inner = self.shared.lock();
            if inner.active.contains_key(&id) || inner.finished.iter().any(|&(j, _)| j == id) {
                return Err(CoreError::InvalidArgument(format!(
                    "job id {id} is already in flight or its result has not been taken"
                )));
            }
            inner.active.insert(id, JobState::Queued);
        }
        let shared = Arc::clone(&self.shared);
        pool.spawn(move || {
            let start = {
                let mut inner = shared.lock();
                let state = inner.active.get_mut(&id);
                match state {
                    Some(s) if *s == JobState::Queued => {
                        *s = JobState::Running;
                        true
                    }
                    _ => false,
                }
            };
            // A cancelled job's work (and the memory it holds on to) is dropped before it is
            // reported: whoever waited for it may then release that memory at once.
            let ok = if start {
                catch_unwind(AssertUnwindSafe(work)).is_ok()
            } else {
                drop(work);
                false
            };
            let mut inner = shared.lock();
            inner.active.remove(&id);
            inner.finished.push((id, ok));
            drop(inner);
            shared.done.notify_all();
        });
        Ok(())
    }

    /// Cancel job `id` if it has not started: it will report `false` and copy nothing. Returns
    /// whether it was cancelled (false: unknown, running or finished).
    #[must_use]
    pub fn cancel(&self, id: JobId) -> bool {
        let Some(mut inner) = self.state() else {
            return false;
        };
        match inner.active.get_mut(&id) {
            Some(s) if *s == JobState::Queued => {
                *s = JobState::Cancelled;
                true
            }
            _ => false,
        }
    }

    /// Take the results of the jobs finished since the last call, in finishing order.
    #[must_use]
    pub fn take_finished(&self) -> Vec<(JobId, bool)> {
        self.state()
            .map(|mut inner| std::mem::take(&mut inner.finished))
            .unwrap_or_default()
    }

    /// Block until none of `ids` is in flight (ids not in flight are already done); in a
    /// forked child, return at once (see [`forked`](Self::forked)).
    pub fn wait(&self, ids: &[JobId]) {
        if self.forked() {
            return;
        }
        let mut inner = self.shared.lock();
        while ids.iter().any(|id| inner.active.contains_key(id)) {
            inner = self
                .shared
                .done
                .wait(inner)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Block until no job is in flight; in a forked child, return at once.
    pub fn wait_all(&self) {
        if self.forked() {
            return;
        }
        let mut inner = self.shared.lock();
        while !inner.active.is_empty() {
            inner = self
                .shared
                .done
                .wait(inner)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Jobs submitted and not finished (0 in a forked child; see [`state`](Self::state)).
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.state().map_or(0, |inner| inner.active.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A pool of one worker thread: a job that blocks it keeps the next one queued.
    fn one_thread() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
    }

    #[test]
    fn results_wait_cancel_and_duplicate_ids() {
        let pool = one_thread();
        let q = JobQueue::new();
        let (tx, rx) = mpsc::channel::<()>();
        // Job 1 blocks the only worker until we let it go, so job 2 is still queued.
        q.submit(1, &pool, move || rx.recv().unwrap()).unwrap();
        q.submit(2, &pool, || {}).unwrap();
        q.submit(3, &pool, || panic!("a job bug")).unwrap();
        assert!(q.submit(2, &pool, || {}).is_err());
        assert_eq!(q.in_flight(), 3);
        assert!(q.cancel(2));
        assert!(!q.cancel(2));
        assert!(!q.cancel(77));
        tx.send(()).unwrap();
        q.wait(&[1, 2, 3, 77]);
        q.wait_all();
        let mut got = q.take_finished();
        got.sort_unstable();
        assert_eq!(got, vec![(1, true), (2, false), (3, false)]);
        assert!(q.take_finished().is_empty());
        q.submit(2, &pool, || {}).unwrap(); // taken ids may be reused
        q.wait_all();
        assert_eq!(q.take_finished(), vec![(2, true)]);
    }

    #[test]
    fn a_cancelled_job_lets_go_of_what_it_holds_before_it_is_reported() {
        let pool = one_thread();
        let q = JobQueue::new();
        for round in 0..200 {
            let held = Arc::new(round);
            let (tx, rx) = mpsc::channel::<()>();
            q.submit(1, &pool, move || rx.recv().unwrap()).unwrap();
            let mine = Arc::clone(&held);
            q.submit(2, &pool, move || drop(mine)).unwrap();
            assert!(q.cancel(2));
            tx.send(()).unwrap();
            q.wait(&[1, 2]);
            // Reported finished: the cancelled work, and the Arc it captured, are gone.
            assert_eq!(Arc::strong_count(&held), 1, "round {round}");
            let mut got = q.take_finished();
            got.sort_unstable();
            assert_eq!(got, vec![(1, true), (2, false)]);
        }
    }

    #[test]
    fn a_running_job_is_not_cancelled() {
        // Only a queued job can be cancelled: one already running copies to the end and
        // reports its own result (cancelling it would not stop the copy).
        let pool = one_thread();
        let q = JobQueue::new();
        let (started_tx, started_rx) = mpsc::channel::<()>();
        let (tx, rx) = mpsc::channel::<()>();
        q.submit(1, &pool, move || {
            started_tx.send(()).unwrap();
            rx.recv().unwrap();
        })
        .unwrap();
        started_rx.recv().unwrap();
        assert!(!q.cancel(1));
        tx.send(()).unwrap();
        q.wait_all();
        assert_eq!(q.take_finished(), vec![(1, true)]);
    }

    #[test]
    fn an_id_is_refused_until_its_result_is_taken() {
        // A finished job's id stays taken until its result is: reused before, the results
        // would name one id twice.
        let pool = one_thread();
        let q = JobQueue::new();
        q.submit(4, &pool, || {}).unwrap();
        q.wait_all();
        assert!(q.submit(4, &pool, || {}).is_err());
        assert_eq!(q.take_finished(), vec![(4, true)]);
        q.submit(4, &pool, || {}).unwrap();
        q.wait_all();
        assert_eq!(q.take_finished(), vec![(4, true)]);
    }
}
