//! Host memory behind the manager's chunk ids: a [`Region`] of page-aligned memory cut into
//! `num_chunks` chunks of `chunk_bytes` ([`ChunkLayout`]), block transfers between a caller's
//! buffer and the chunks ([`transfer`]), and an asynchronous job queue for them ([`jobs`]).
//! [`HostPool`] composes the three.
//!
//! Ownership: the pool holds its region in an `Arc`; every queued job holds a clone, so the
//! memory outlives the jobs that copy into it. Bindings hand out further clones to the owners
//! of zero-copy views.

pub mod jobs;
pub mod region;
mod shm;
pub use shm::{after_fork_in_child, after_fork_in_parent, before_fork};
pub mod transfer;

use crate::error::{CoreError, Result};
pub use jobs::{JobId, JobQueue};
pub use region::{Region, RegionInfo, RegionOptions, SharedMode, SharedOptions};
use std::sync::Arc;
pub use transfer::{Direction, RawBuf, TransferSpec};

/// How a pool's bytes are cut into chunks: `num_chunks` chunks of `chunk_bytes`, back to back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLayout {
    num_chunks: usize,
    chunk_bytes: usize,
}

impl ChunkLayout {
    /// A layout of `num_chunks * chunk_bytes` bytes; both at least 1, the product addressable.
    pub fn new(num_chunks: usize, chunk_bytes: usize) -> Result<Self> {
        if num_chunks == 0 || chunk_bytes == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "num_chunks and chunk_bytes must be at least 1 (got {num_chunks} and {chunk_bytes})"
            )));
        }
        match num_chunks.checked_mul(chunk_bytes) {
            Some(n) if isize::try_from(n).is_ok() => Ok(Self {
                num_chunks,
                chunk_bytes,
            }),
            _ => Err(CoreError::InvalidArgument(format!(
                "{num_chunks} chunks of {chunk_bytes} bytes do not fit in the address space"
            ))),
        }
    }

    /// Number of chunks.
    #[must_use]
    pub fn num_chunks(&self) -> usize {
        self.num_chunks
    }

    /// Bytes per chunk.
    #[must_use]
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Total bytes: `num_chunks * chunk_bytes` (no overflow: checked in `new`).
    #[must_use]
    pub fn total_bytes(&self) -> usize {
        self.num_chunks * self.chunk_bytes
    }
}

/// How to build a [`HostPool`].
#[derive(Debug, Clone, Default)]
pub struct HostPoolOptions {
    /// The memory: anonymous or shared, locked, huge pages.
    pub region: RegionOptions,
    /// Worker threads for transfers and jobs; 0 means 1.
    pub num_threads: usize,
}

/// A region cut into chunks, with block transfers in and out and a job queue.
pub struct HostPool {
    region: Arc<Region>,
    layout: ChunkLayout,
    threads: Arc<rayon::ThreadPool>,
    num_threads: usize,
    jobs: JobQueue,
    /// The process that made the pool: a forked child has the memory but not the threads.
    pid: u32,
}

impl HostPool {
    /// Map, pre-fault (and lock, register huge pages) the memory and start the worker threads.
    pub fn new(layout: ChunkLayout, options: &HostPoolOptions) -> Result<Self> {
        let num_threads = options.num_threads.max(1);
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(num_threads)
            .thread_name(|i| format!("kvoffload-copy-{i}"))
            .build()
            .map_err(|e| CoreError::Os(format!("cannot start {num_threads} copy threads: {e}")))?;
        let region = Arc::new(Region::new(layout, &options.region)?);
        Ok(Self {
            region,
            layout,
            threads: Arc::new(threads),
            num_threads,
            jobs: JobQueue::new(),
            pid: std::process::id(),
        })
    }

    /// The memory; clones of the `Arc` keep it mapped.
    #[must_use]
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// The chunk layout.
    #[must_use]
    pub fn layout(&self) -> ChunkLayout {
        self.layout
    }

    /// Worker threads.
    #[must_use]
    pub fn num_threads(&self) -> usize {
        self.num_threads
    }

    /// Whether this process is a fork of the one that made the pool.
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// The job queue (results and waits).
    #[must_use]
    pub fn jobs(&self) -> &JobQueue {
        &self.jobs
    }

    /// Copy blocks of `buf` into chunks (`Gather`) or chunks into blocks of `buf` (`Scatter`),
    /// on up to `threads` threads (0: the pool's). Everything is validated before a byte moves.
    ///
    /// # Safety
    /// `buf` must be valid for reads (and for writes when scattering) of `buf.len()` bytes for
    /// the duration of the call, and nothing else may write to it meanwhile.
    pub unsafe fn transfer(
        &self,
        direction: Direction,
        buf: RawBuf,
        spec: &TransferSpec<'_>,
        threads: usize,
    ) -> Result<()> {
        let plan = transfer::plan(&self.region, self.layout, direction, buf, spec)?;
        let threads = if self.forked() {
            1 // the worker threads stayed in the parent
        } else if threads == 0 {
            self.num_threads
        } else {
            threads.min(self.num_threads)
        };
        // SAFETY: the plan was validated against this region and `buf`; the caller guarantees
        // `buf` stays valid for the call.
        unsafe { plan.execute(&self.threads, threads) };
        Ok(())
    }

    /// Safe gather from a slice (for Rust callers and tests).
    pub fn gather(&self, src: &[u8], spec: &TransferSpec<'_>) -> Result<()> {
        // SAFETY: `src` is borrowed for the whole call; a gather only reads it.
        unsafe { self.transfer(Direction::Gather, RawBuf::from_slice(src), spec, 0) }
    }

    /// Safe scatter into a slice (for Rust callers and tests).
    pub fn scatter(&self, dst: &mut [u8], spec: &TransferSpec<'_>) -> Result<()> {
        // SAFETY: `dst` is borrowed exclusively for the whole call.
        unsafe { self.transfer(Direction::Scatter, RawBuf::from_mut_slice(dst), spec, 0) }
    }

    /// Validate a transfer now and queue it as job `job_id`; its result comes from
    /// [`JobQueue::take_finished`]. Nothing is queued when validation fails.
    ///
    /// # Safety
    /// `buf` must stay valid (and written by no one else) until the job is reported finished.
    pub unsafe fn submit(
        &self,
        job_id: JobId,
        direction: Direction,
        buf: RawBuf,
        spec: &TransferSpec<'_>,
    ) -> Result<()> {
        if self.forked() {
            return Err(CoreError::InvalidArgument(
                "this pool was made before a fork: its job threads are in the parent process; \
                 use gather/scatter here, or make or attach a pool in this process"
                    .into(),
            ));
        }
        let plan = transfer::plan(&self.region, self.layout, direction, buf, spec)?;
        let threads = self.num_threads;
        let region = Arc::clone(&self.region);
        let pool = Arc::clone(&self.threads);
        self.jobs.submit(job_id, &self.threads, move || {
            // The job's clone keeps the memory mapped while it copies.
            let _region = region;
            // SAFETY: validated above; the caller keeps `buf` valid until the job is reported.
            unsafe { plan.execute(&pool, threads) };
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_rejects_zero_and_overflow() {
        assert!(ChunkLayout::new(0, 1).is_err());
        assert!(ChunkLayout::new(1, 0).is_err());
        assert!(ChunkLayout::new(usize::MAX, 2).is_err());
        assert_eq!(ChunkLayout::new(3, 5).unwrap().total_bytes(), 15);
    }

    #[test]
    fn pool_round_trip_and_jobs() {
        let layout = ChunkLayout::new(4, 64).unwrap();
        let pool = HostPool::new(
            layout,
            &HostPoolOptions {
                num_threads: 2,
                ..HostPoolOptions::default()
            },
        )
        .unwrap();
        let src: Vec<u8> = (0..=255).collect(); // 8 blocks of 32
        let spec = TransferSpec {
            block_bytes: 32,
            chunk_offset: 16,
            blocks: &[7, 0],
            chunks: &[2, 3],
        };
        pool.gather(&src, &spec).unwrap();
        let mut back = vec![0u8; 256];
        pool.scatter(&mut back, &spec).unwrap();
        assert_eq!(&back[7 * 32..8 * 32], &src[7 * 32..8 * 32]);
        assert_eq!(&back[..32], &src[..32]);
        assert!(back[32..7 * 32].iter().all(|&b| b == 0));

        let mut dst = vec![0u8; 256];
        // SAFETY: `dst` outlives the job: we wait for it before reading or dropping `dst`.
        unsafe {
            pool.submit(
                9,
                Direction::Scatter,
                RawBuf::from_mut_slice(&mut dst),
                &spec,
            )
            .unwrap();
        }
        pool.jobs().wait(&[9]);
        assert_eq!(pool.jobs().take_finished(), vec![(9, true)]);
        assert_eq!(dst, back);
    }
}
