//! Page-aligned host memory: an anonymous mapping or a named `/dev/shm` region (see `shm`),
//! pre-faulted on creation, optionally on transparent huge pages and page-locked.
//!
//! A [`Region`] owns its mapping: dropping it unmaps (and, for a shared region, leaves it the
//! way `shm` describes). The usable bytes are exactly `num_chunks * chunk_bytes`; the mapping is
//! that rounded up to the page, never more.

use super::shm::{self, ShmFile};
use super::ChunkLayout;
use crate::error::{CoreError, Result};
use std::ffi::OsString;
use std::io;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

/// Bytes in a transparent huge page on x86-64 and arm64 (4 KiB base pages): the core's
/// `mem::HUGE_PAGE`, one base page under Miri (no pages to advise, thousands of times
/// slower), with the size below scaled alike, so that its runs take the multi-part and
/// multi-thread paths at sizes it can afford.
pub const HUGE_PAGE_BYTES: usize = crate::mem::HUGE_PAGE;
/// The least a pre-fault thread takes: below it, starting the thread costs more than it saves.
pub const PREFAULT_MIN_PART_BYTES: usize = if cfg!(miri) { 128 << 10 } else { 64 << 20 };

/// How a shared region is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SharedMode {
    /// Create it, or attach if another process created it first.
    #[default]
    CreateOrAttach,
    /// Create it; fail if it exists.
    Create,
    /// Attach to an existing one; fail if there is none.
    Attach,
}

/// A named shared region.
#[derive(Debug, Clone)]
pub struct SharedOptions {
    /// The name; the file is `/dev/shm/kvoffload.<name>`.
    pub name: String,
    /// Create, attach, or either.
    pub mode: SharedMode,
    /// How long an attacher waits for the creator to finish setting the region up.
    pub attach_timeout: Duration,
    /// Command (argv) that removes the name once no process holds the region, run by the
    /// creator with the path, device and inode appended; see `shm`.
    pub janitor: Option<Vec<OsString>>,
}

/// How to map a region.
#[derive(Debug, Clone, Default)]
pub struct RegionOptions {
    /// Lock the pages in memory (mlock).
    pub lock_pages: bool,
    /// Ask for transparent huge pages (`MADV_HUGEPAGE`).
    pub huge_pages: bool,
    /// Back the region by a named `/dev/shm` file instead of anonymous memory.
    pub shared: Option<SharedOptions>,
    /// Pre-fault by touching each page even where `MADV_POPULATE_WRITE` exists (for tests).
    pub force_touch_prefault: bool,
    /// Threads that pre-fault the memory together (0 or 1: the calling thread alone); each
    /// takes a run of at least [`PREFAULT_MIN_PART_BYTES`].
    pub prefault_threads: usize,
    /// For tests of the shared protocol: the creator of a shared region sleeps this long after
    /// publishing it, then fails if `.1` (so attachers see a slow, failed or killed creator).
    pub test_creator_stall: Option<(Duration, bool)>,
}

/// What happened while mapping.
#[derive(Debug, Clone, PartialEq)]
pub struct RegionInfo {
    /// `"madv-populate-write"` or `"touch"` (the fallback for kernels before 5.14).
    pub prefault_method: &'static str,
    /// Seconds the pre-fault took.
    pub prefault_seconds: f64,
    /// Whether the pages are locked (mlock succeeded).
    pub locked: bool,
    /// Whether `MADV_HUGEPAGE` was applied.
    pub huge_pages: bool,
    /// For a shared region: its path, and whether this process created it.
    pub shared_path: Option<String>,
    /// Whether this process created the shared region (always true for anonymous memory).
    pub creator: bool,
}

/// A mapping; the usable bytes start at `data` (page-aligned).
pub struct Region {
    /// The whole mapping (a shared region's header page included).
    map: NonNull<u8>,
    map_len: usize,
    /// First usable byte: `map` for anonymous memory, one page in for a shared region.
    data: NonNull<u8>,
    len: usize,
    data_len: usize,
    info: RegionInfo,
    shm: Option<ShmFile>,
}

// SAFETY: a `Region` owns plain bytes (no value in them has a validity invariant) and hands
// out only raw pointers to them, never references; the transfer code makes sure no two of its
// own threads write the same bytes within one transfer. Two transfers that touch the same chunk
// at the same time (from two threads, a queued job, a view, or another process mapping a shared
// region, which no Rust type can rule out) race on those bytes as any shared-memory writers do:
// the chunk's contents are then unspecified, and nothing outside the region is touched. The
// manager never asks for that, and the README states it as a limit.
unsafe impl Send for Region {}
// SAFETY: as above; no method takes `&self` and writes through it.
unsafe impl Sync for Region {}

/// The page size.
#[must_use]
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096)
}

/// Refuse to pre-fault more memory than the kernel reports available: touching it all would
/// summon the OOM killer instead of returning an error.
pub(crate) fn check_available(bytes: usize) -> Result<()> {
    let Ok(info) = std::fs::read_to_string("/proc/meminfo") else {
        return Ok(()); // no /proc: let the kernel decide
    };
    let available = info.lines().find_map(|l| {
        let kib = l
            .strip_prefix("MemAvailable:")?
            .trim()
            .strip_suffix("kB")?
            .trim();
        kib.parse::<u64>().ok().map(|k| k.saturating_mul(1024))
    });
    match available {
        Some(avail) if bytes as u64 > avail => Err(CoreError::Os(format!(
            "a pool of {bytes} bytes does not fit in the {avail} bytes of memory available (MemAvailable); ask for fewer or smaller chunks"
        ))),
        _ => Ok(()),
    }
}

/// `errno` of the last failed call, as an error.
pub(crate) fn last_os_error(what: &str) -> CoreError {
    CoreError::Os(format!("{what} failed: {}", io::Error::last_os_error()))
}

impl Region {
    /// Map, pre-fault, and apply the options. Fails with nothing left mapped or created.
    pub fn new(layout: ChunkLayout, options: &RegionOptions) -> Result<Self> {
        let len = layout.total_bytes();
        let page = page_size();
        let data_len = len.div_ceil(page) * page;
        match &options.shared {
            None => {
                check_available(data_len)?;
                let mut region = Self::anonymous(len, data_len, options.huge_pages)?;
                region.setup(options, true)?;
                Ok(region)
            }
            Some(shared) => shm::open(layout, data_len, page, shared, options),
        }
    }

    fn anonymous(len: usize, data_len: usize, huge: bool) -> Result<Self> {
        #[cfg(not(miri))]
        let start = Self::map_anonymous(data_len, huge)?;
        // Under Miri (no `mmap` of this kind): zeroed memory from the allocator, page-aligned,
        // never huge (the tests that ask for huge pages do not run there).
        #[cfg(miri)]
        let start = {
            let _ = huge;
            crate::mem::map_zeroed(data_len)
                .ok_or_else(|| CoreError::Os(format!("allocating {data_len} bytes failed")))?
        };
        let map = NonNull::new(start).ok_or_else(|| CoreError::Os("mmap".into()))?;
        Ok(Self {
            map,
            map_len: data_len,
            data: map,
            len,
            data_len,
            info: RegionInfo {
                prefault_method: "",
                prefault_seconds: 0.0,
                locked: false,
                huge_pages: false,
                shared_path: None,
                creator: true,
            },
            shm: None,
        })
    }

    /// A fresh private anonymous mapping of `data_len` bytes (on a 2 MiB boundary if `huge`):
    /// its address.
    #[cfg(not(miri))]
    fn map_anonymous(data_len: usize, huge: bool) -> Result<*mut u8> {
        // Huge pages need 2 MiB alignment: map a little more and trim both ends.
        let extra = if huge { HUGE_PAGE_BYTES } else { 0 };
        let Some(want) = data_len.checked_add(extra) else {
            return Err(CoreError::InvalidArgument("region too large".into()));
        };
        crate::mem::map_anonymous(data_len, huge, false)
            .map_err(|e| CoreError::Os(format!("mmap of {want} bytes failed: {e}")))
    }

    /// A region over an existing mapping (for `shm`), with the data one `data_offset` in.
    ///
    /// # Safety
    /// `map` is a live mapping of `map_len >= data_offset + data_len` bytes that nothing else
    /// owns (the region unmaps it when dropped), and `len <= data_len` holds before the region
    /// is used for anything but dropping.
    pub(crate) unsafe fn from_mapping(
        map: NonNull<u8>,
        map_len: usize,
        data_offset: usize,
        len: usize,
        data_len: usize,
        info: RegionInfo,
        shm: ShmFile,
    ) -> Self {
        // SAFETY: the caller mapped `map_len >= data_offset + data_len` bytes at `map`.
        let data = unsafe { map.add(data_offset) };
        Self {
            map,
            map_len,
            data,
            len,
            data_len,
            info,
            shm: Some(shm),
        }
    }

    /// Huge pages, pre-fault, lock. `write_touch`: the fallback pre-fault may write zeros (the
    /// memory is fresh); attachers of a shared region only read.
    pub(crate) fn setup(&mut self, options: &RegionOptions, write_touch: bool) -> Result<()> {
        let (ptr, len) = (self.data.as_ptr().cast::<libc::c_void>(), self.data_len);
        if options.huge_pages {
            thp_enabled(self.shm.is_some())?;
            // SAFETY: advice on our own mapping; it changes no contents.
            if unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) } != 0 {
                return Err(last_os_error(
                    "madvise(MADV_HUGEPAGE) (transparent huge pages unavailable?)",
                ));
            }
            self.info.huge_pages = true;
        }
        let t0 = Instant::now();
        // SAFETY: `data_len` bytes at `data` are this region's mapping, written by no one while
        // it is set up (an attacher only reads).
        self.info.prefault_method = unsafe { prefault(self.data, len, write_touch, options) }?;
        self.info.prefault_seconds = t0.elapsed().as_secs_f64();
        if options.lock_pages {
            // SAFETY: locks pages of our own mapping; no contents change.
            if unsafe { libc::mlock(ptr, len) } != 0 {
                return Err(CoreError::PageLock(mlock_message(
                    len,
                    &io::Error::last_os_error(),
                )));
            }
            self.info.locked = true;
        }
        Ok(())
    }

    /// First usable byte (page-aligned).
    #[must_use]
    pub fn as_ptr(&self) -> *mut u8 {
        self.data.as_ptr()
    }

    /// Usable bytes: exactly `num_chunks * chunk_bytes`.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: layouts have at least one byte).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Mapped data bytes: `len` rounded up to the page.
    #[must_use]
    pub fn mapped_len(&self) -> usize {
        self.data_len
    }

    /// What happened while mapping.
    #[must_use]
    pub fn info(&self) -> &RegionInfo {
        &self.info
    }

    /// The region's bytes.
    ///
    /// # Safety
    /// No one may write to the region while the slice lives.
    #[must_use]
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes from `data` are mapped for the region's lifetime; the caller
        // rules out concurrent writes.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this region made; no pointer into it outlives the
        // region (views and jobs hold the region itself). munmap also drops any mlock.
        #[cfg(not(miri))]
        unsafe {
            libc::munmap(self.map.as_ptr().cast(), self.map_len);
        }
        // SAFETY: under Miri the region's memory came from `mem::map_zeroed(map_len)` (shared
        // regions do not run there) and is released once.
        #[cfg(miri)]
        unsafe {
            crate::mem::unmap(self.map.as_ptr(), self.map_len);
        }
        if let Some(shm) = self.shm.take() {
            shm.release();
        }
    }
}

/// Refuse huge pages where the kernel's setting means `MADV_HUGEPAGE` would be silently ignored
/// (`never`, or `deny` for shared memory).
fn thp_enabled(shared: bool) -> Result<()> {
    let knob = if shared {
        "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
    } else {
        "/sys/kernel/mm/transparent_hugepage/enabled"
    };
    let Ok(text) = std::fs::read_to_string(knob) else {
        return Err(CoreError::Os(format!(
            "huge_pages=True but transparent huge pages are unavailable ({knob} cannot be read)"
        )));
    };
    let mode = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
        .unwrap_or("");
    if matches!(mode, "never" | "deny") {
        return Err(CoreError::Os(format!(
            "huge_pages=True but {knob} is [{mode}]: the kernel would ignore MADV_HUGEPAGE"
        )));
    }
    Ok(())
}

/// Fault every page in: `MADV_POPULATE_WRITE` (Linux 5.14+), else touch one byte per page; on
/// up to `options.prefault_threads` threads (the kernel's zeroing of fresh pages is CPU work).
///
/// # Safety
/// `len` bytes at `data` are a mapping the caller owns; with `write_touch`, one whose contents
/// no one relies on (zeros may be written into it).
unsafe fn prefault(
    data: NonNull<u8>,
    len: usize,
    write_touch: bool,
    options: &RegionOptions,
) -> Result<&'static str> {
    let threads = options.prefault_threads;
    // Under Miri, which has no `madvise`, always by touch.
    if !options.force_touch_prefault && !cfg!(miri) {
        let results = for_each_part(data, len, threads, |ptr, part| {
            // SAFETY: populating a part of our own mapping changes no contents.
            let rc = unsafe { libc::madvise(ptr.cast(), part, libc::MADV_POPULATE_WRITE) };
            if rc == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        });
        // EINVAL: a kernel without MADV_POPULATE_WRITE; fall back. Anything else is real
        // (ENOMEM: no memory to back the region; EFAULT/EIO: the pages cannot be populated).
        match results.into_iter().find_map(std::result::Result::err) {
            None => return Ok("madv-populate-write"),
            Some(err) if err.raw_os_error() == Some(libc::EINVAL) => {}
            Some(err) => {
                return Err(CoreError::Os(format!(
                    "pre-faulting {len} bytes (madvise(MADV_POPULATE_WRITE)) failed: {err}"
                )))
            }
        }
    }
    for_each_part(data, len, threads, |ptr, part| {
        // SAFETY: `ptr..ptr + part` is a part of the caller's mapping, and a part is touched by
        // one thread only.
        unsafe { touch_pages(NonNull::new_unchecked(ptr), part, write_touch) };
    });
    Ok("touch")
}

/// Run `f(start, len)` over `[data, data + len)` cut into up to `threads` runs of whole huge
/// pages (at least [`PREFAULT_MIN_PART_BYTES`] each), one thread a run, the first on the
/// calling thread; the results in order.
fn for_each_part<T: Send>(
    data: NonNull<u8>,
    len: usize,
    threads: usize,
    f: impl Fn(*mut u8, usize) -> T + Sync,
) -> Vec<T> {
    let parts = threads.min(len / PREFAULT_MIN_PART_BYTES).max(1);
    let step = len.div_ceil(parts).next_multiple_of(HUGE_PAGE_BYTES);
    // An address, not a pointer, so that it can cross to the other threads.
    let base = data.as_ptr() as usize;
    // Addresses only: `f` is the one to dereference them (`run` is called with `i < count`,
    // so `start < len`).
    let run = |i: usize| {
        let start = i * step;
        f((base as *mut u8).wrapping_add(start), step.min(len - start))
    };
    let count = len.div_ceil(step.max(1)).max(1);
    if count == 1 {
        return vec![f(data.as_ptr(), len)];
    }
    std::thread::scope(|s| {
        let others: Vec<_> = (1..count)
            .map(|i| {
                let thread = std::thread::Builder::new().name(format!("kvoffload-prefault-{i}"));
                (i, thread.spawn_scoped(s, move || run(i)).ok())
            })
            .collect();
        let mut out = vec![run(0)];
        // A thread that could not start, or (never expected: a syscall or page touches) that
        // panicked, has its run redone here: nothing unwinds into the caller.
        for (i, handle) in others {
            out.push(match handle.map(std::thread::ScopedJoinHandle::join) {
                Some(Ok(r)) => r,
                _ => run(i),
            });
        }
        out
    })
}

/// Touch one byte per page: write a zero (fresh memory) or read (memory with contents).
///
/// # Safety
/// `len` bytes at `data` are mapped, and writable when `write` (a zero is written into the
/// first byte of each page).
unsafe fn touch_pages(data: NonNull<u8>, len: usize, write: bool) {
    let page = page_size();
    let mut off = 0;
    while off < len {
        // SAFETY: `off < len` lies inside the mapping; volatile so the access is not elided.
        unsafe {
            let p = data.as_ptr().add(off);
            if write {
                p.write_volatile(0);
            } else {
                p.read_volatile();
            }
        }
        off += page;
    }
}

/// The error message for a failed mlock, naming `RLIMIT_MEMLOCK` and its values.
#[must_use]
pub fn mlock_message(len: usize, err: &io::Error) -> String {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    let limits = if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &raw mut lim) } == 0 {
        let show = |v: libc::rlim_t| {
            if v == libc::RLIM_INFINITY {
                "unlimited".to_string()
            } else {
                format!("{v} bytes")
            }
        };
        format!(
            "RLIMIT_MEMLOCK is {} (hard limit {})",
            show(lim.rlim_cur),
            show(lim.rlim_max)
        )
    } else {
        "RLIMIT_MEMLOCK could not be read".to_string()
    };
    format!(
        "locking {len} bytes of host memory (mlock) failed: {err}; {limits}. Raise the limit \
         (ulimit -l, LimitMEMLOCK= in systemd, docker --ulimit memlock=-1) or pass \
         lock_pages=False"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> RegionOptions {
        RegionOptions::default()
    }

    #[test]
    fn exact_size_page_aligned() {
        let page = page_size();
        let r = Region::new(ChunkLayout::new(3, 1000).unwrap(), &opts()).unwrap();
        assert_eq!(r.len(), 3000);
        assert_eq!(r.mapped_len(), page);
        assert_eq!(r.as_ptr() as usize % page, 0);
        // SAFETY: nothing writes meanwhile.
        assert!(unsafe { r.as_slice() }.iter().all(|&b| b == 0));
        let method = if cfg!(miri) {
            "touch"
        } else {
            "madv-populate-write"
        };
        assert_eq!(r.info().prefault_method, method);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no madvise")]
    fn touch_fallback_and_huge_pages() {
        let o = RegionOptions {
            force_touch_prefault: true,
            huge_pages: true,
            ..opts()
        };
        let r = match Region::new(ChunkLayout::new(5, HUGE_PAGE_BYTES).unwrap(), &o) {
            Ok(r) => r,
            Err(e) => {
                // A kernel with THP off: the refusal must say so, not pass silently.
                assert!(e.to_string().contains("huge_pages=True"), "{e}");
                return;
            }
        };
        assert_eq!(r.info().prefault_method, "touch");
        assert!(r.info().huge_pages);
        assert_eq!(r.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert_eq!(r.mapped_len(), 5 * HUGE_PAGE_BYTES);
    }

    #[test]
    fn prefault_parts_cover_the_region_once_in_huge_page_runs() {
        let len = PREFAULT_MIN_PART_BYTES * 25 / 8 + 123;
        let mem = vec![0u8; len]; // never touched: `alloc_zeroed` maps it lazily
        let data = NonNull::new(mem.as_ptr().cast_mut()).unwrap();
        let base = data.as_ptr() as usize;
        for threads in [0, 1, 2, 4, 64] {
            let runs = for_each_part(data, len, threads, |p, n| (p as usize - base, n));
            assert_eq!(runs.len(), threads.clamp(1, 3), "{threads} threads");
            let mut next = 0;
            for &(start, n) in &runs {
                assert_eq!(start, next);
                assert!(start % HUGE_PAGE_BYTES == 0 && n > 0);
                next = start + n;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn prefault_on_threads_gives_zeroed_memory() {
        for force_touch_prefault in [false, true] {
            let o = RegionOptions {
                prefault_threads: 2,
                force_touch_prefault,
                ..opts()
            };
            let chunk = PREFAULT_MIN_PART_BYTES / 64;
            let r = Region::new(ChunkLayout::new(130, chunk).unwrap(), &o).unwrap();
            // SAFETY: nothing writes meanwhile.
            assert!(unsafe { r.as_slice() }.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn more_than_the_machine_has_is_an_error_not_an_oom_kill() {
        let huge = ChunkLayout::new(1 << 20, 1 << 30).unwrap(); // 1 PiB
        let err = Region::new(huge, &opts()).err().unwrap();
        assert!(matches!(err, CoreError::Os(_)), "{err}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mlock")]
    fn small_lock_succeeds_and_message_names_the_limit() {
        let o = RegionOptions {
            lock_pages: true,
            ..opts()
        };
        let r = Region::new(ChunkLayout::new(2, 4096).unwrap(), &o).unwrap();
        assert!(r.info().locked);
        let msg = mlock_message(1 << 30, &io::Error::from_raw_os_error(libc::ENOMEM));
        assert!(msg.contains("RLIMIT_MEMLOCK"), "{msg}");
        assert!(msg.contains("lock_pages=False"), "{msg}");
    }
}
