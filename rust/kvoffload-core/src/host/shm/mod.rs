//! Named shared regions: `/dev/shm/kvoffload.<name>`, one header page then the data.
//!
//! The protocol, and why nothing is left behind:
//! - **Every process using a region holds a shared `flock` on it**, taken before it looks at the
//!   region. The kernel drops the lock when the process exits or is killed (the mapping holds the
//!   open file, so the lock lasts exactly as long as the memory is mapped).
//! - **Publication is atomic**: the creator builds an unnamed file (`O_TMPFILE`), locks it, sizes
//!   it, writes the header (state `INIT`) and only then links the name; so a named region always
//!   has a lock holder, and a second creator fails at the link and attaches instead.
//! - **Whoever can take the lock exclusively is the last user**: on release a process unlocks,
//!   tries `LOCK_EX | LOCK_NB`, and on success unlinks the name (if it still names the same
//!   inode). A region whose holders were all killed is found stale the same way by the next
//!   opener, and by the creator's janitor process, which polls for the exclusive lock and unlinks
//!   the name as soon as every holder is gone.
//! - **Failures are visible**: the creator sets the header to `READY`, or to `FAILED` with a
//!   message (and unlinks the name); attachers wait for either, and give up with an error when the
//!   creator's pid is gone or the timeout passes. No one waits forever.

mod attach;

use super::region::{last_os_error, Region, RegionInfo, RegionOptions, SharedMode, SharedOptions};
use super::ChunkLayout;
use crate::error::{CoreError, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, TryLockError, Weak};
use std::time::{Duration, Instant};

/// Where shared regions live.
pub(crate) const SHM_DIR: &str = "/dev/shm";
/// File-name prefix of every region.
pub(crate) const PREFIX: &str = "kvoffload.";
const MAGIC: u64 = u64::from_le_bytes(*b"KVOFFLD1");
const INIT: u32 = 0;
const READY: u32 = 1;
const FAILED: u32 = 2;
const MSG_OFFSET: usize = 64;
const MSG_CAP: usize = 2048;

/// The first bytes of the header page (the failure message follows at `MSG_OFFSET`).
#[repr(C)]
struct Header {
    magic: AtomicU64,
    state: AtomicU32,
    creator_pid: AtomicI32,
    num_chunks: AtomicU64,
    chunk_bytes: AtomicU64,
    msg_len: AtomicU32,
}

/// The open file of a shared region; `release` runs when its `Region` is unmapped.
pub(crate) struct ShmFile(Arc<Hold>);

/// A process's hold on a region: an open file of its own, and so a lock of its own (a `flock`
/// belongs to the open file, which a forked child would share with its parent: see
/// [`before_fork`]).
struct Hold {
    fd: AtomicI32,
    /// Between [`before_fork`] and the end of the fork: a second open file of the region, locked
    /// shared, for the child to keep as its own (-1: none).
    spare: AtomicI32,
    path: CString,
    /// The process holding the lock; a forked child without a hold of its own leaves the
    /// parent's lock and name alone.
    pid: AtomicI32,
    dev: u64,
    ino: u64,
}

impl Drop for Hold {
    fn drop(&mut self) {
        close_own(self.fd.load(Ordering::Acquire));
        close_own(self.spare.load(Ordering::Acquire));
    }
}

/// Close `fd` (-1: none), a descriptor a hold owned and no longer stores.
fn close_own(fd: i32) {
    if fd >= 0 {
        // SAFETY: the caller took `fd` out of its hold, so it is closed once.
        unsafe { libc::close(fd) };
    }
}

/// Every shared region's hold in this process, for the fork hooks.
static HOLDS: Mutex<Vec<Weak<Hold>>> = Mutex::new(Vec::new());

impl ShmFile {
    /// This process's hold on the region open at `fd` (locked shared), named `path`.
    fn new(fd: OwnedFd, path: CString, st: &libc::stat) -> Self {
        let hold = Arc::new(Hold {
            fd: AtomicI32::new(fd.into_raw_fd()),
            spare: AtomicI32::new(-1),
            path,
            // SAFETY: getpid has no preconditions.
            pid: AtomicI32::new(unsafe { libc::getpid() }),
            dev: st.st_dev,
            ino: st.st_ino,
        });
        let mut holds = HOLDS.lock().unwrap_or_else(PoisonError::into_inner);
        holds.retain(|h| h.strong_count() > 0);
        holds.push(Arc::downgrade(&hold));
        Self(hold)
    }

    /// Drop this process's hold; unlink the name if no one else holds the region.
    pub(crate) fn release(self) {
        let hold = &self.0;
        // SAFETY: getpid has no preconditions.
        if unsafe { libc::getpid() } != hold.pid.load(Ordering::Acquire) {
            return;
        }
        let fd = hold.fd.load(Ordering::Acquire);
        // SAFETY: flock on our own open descriptor.
        unsafe {
            libc::flock(fd, libc::LOCK_UN);
            if libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) == 0 {
                unlink_if_same(&hold.path, hold.dev, hold.ino);
            }
        }
    }
}

impl Hold {
    /// Open the region again and lock it shared, as the spare a child will keep.
    fn open_spare(&self) {
        // SAFETY: `path` is NUL-terminated.
        let raw = unsafe { libc::open(self.path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return; // the name is gone: a child keeps its memory, unshared
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let same = fstat(&fd)
            .is_ok_and(|st| st.st_dev == self.dev && st.st_ino == self.ino && st.st_nlink > 0);
        // SAFETY: flock on our own descriptor. It fails only while a last user is removing the
        // name, which then names no region a child could share.
        if same && unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            // A spare left by an earlier fork that did not end goes.
            close_own(self.spare.swap(fd.into_raw_fd(), Ordering::AcqRel));
        }
    }

    /// In the child: the spare becomes its hold; the parent's open file, inherited, is closed
    /// (the parent's lock stays: the parent keeps that open file).
    fn adopt_spare(&self, me: i32) {
        let spare = self.spare.swap(-1, Ordering::AcqRel);
        if spare < 0 || self.pid.load(Ordering::Acquire) == me {
            return;
        }
        close_own(self.fd.swap(spare, Ordering::AcqRel)); // the inherited one
        self.pid.store(me, Ordering::Release);
    }

    /// In the parent: close the spare (the child's copy keeps its lock).
    fn drop_spare(&self) {
        close_own(self.spare.swap(-1, Ordering::AcqRel));
    }
}

/// The holds alive in this process (in a child, `None` if another thread held the list at the
/// moment of the fork: it was copied locked for good).
fn live_holds(child: bool) -> Option<Vec<Arc<Hold>>> {
    let holds = if child {
        match HOLDS.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        }
    } else {
        HOLDS.lock().unwrap_or_else(PoisonError::into_inner)
    };
    Some(holds.iter().filter_map(Weak::upgrade).collect())
}

/// Fork hook, in the parent just before a fork: a second open file of each shared region this
/// process holds (views of one included), locked shared, for the child to keep as its own.
///
/// A `flock` belongs to an open file, and a forked child shares its parent's: without a hold of
/// its own, the parent's release would find itself the last user and remove the name while the
/// child still mapped the region (a later attacher would make a new, empty one). Taken before the
/// fork, the child's hold exists from its first instant, whatever the parent does next.
pub fn before_fork() {
    for hold in live_holds(false).unwrap_or_default() {
        hold.open_spare();
    }
}

/// Fork hook, in the parent after the fork: close the spares (the child has its copies).
pub fn after_fork_in_parent() {
    for hold in live_holds(false).unwrap_or_default() {
        hold.drop_spare();
    }
}

/// Fork hook, in the child: each spare becomes this process's hold on its region, so that the
/// name lasts while the child maps it and the child's release does what any user's does.
pub fn after_fork_in_child() {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    for hold in live_holds(true).unwrap_or_default() {
        hold.adopt_spare(me);
    }
}

/// Unlink `path` if it still names inode (`dev`, `ino`).
fn unlink_if_same(path: &CString, dev: u64, ino: u64) {
    // SAFETY: an all-zero `stat` is a valid value for stat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated; `st` is writable.
    if unsafe { libc::stat(path.as_ptr(), &raw mut st) } == 0
        && st.st_dev == dev
        && st.st_ino == ino
    {
        // SAFETY: `path` is NUL-terminated.
        unsafe { libc::unlink(path.as_ptr()) };
    }
}

fn fstat(fd: &OwnedFd) -> Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on our own descriptor.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
        return Err(last_os_error("fstat of a shared region"));
    }
    Ok(st)
}

/// The path of region `name`, after checking the name is a plain file name.
pub(crate) fn region_path(name: &str) -> Result<String> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !ok {
        return Err(CoreError::InvalidArgument(format!(
            "shared_name must be 1-200 characters of A-Z a-z 0-9 _ - . not starting with '.' (got \
             {name:?})"
        )));
    }
    Ok(format!("{SHM_DIR}/{PREFIX}{name}"))
}

enum Step {
    Done(Region),
    Exists,
    Missing,
    Retry,
}

/// Create or attach region `shared.name` for `layout`.
pub(crate) fn open(
    layout: ChunkLayout,
    data_len: usize,
    page: usize,
    shared: &SharedOptions,
    options: &RegionOptions,
) -> Result<Region> {
    let path = region_path(&shared.name)?;
    let cpath = CString::new(path.clone()).map_err(|_| CoreError::InvalidArgument(path.clone()))?;
    // A timeout past what the clock can add (`attach_timeout=2**63`) waits a century instead.
    let deadline = Instant::now()
        .checked_add(shared.attach_timeout)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(100 * 365 * 86_400));
    let ctx = Ctx {
        layout,
        data_len,
        page,
        path: &path,
        cpath: &cpath,
        shared,
        options,
        deadline,
    };
    loop {
        if shared.mode != SharedMode::Attach {
            match ctx.create()? {
                Step::Done(r) => return Ok(r),
                Step::Exists if shared.mode == SharedMode::Create => {
                    return Err(CoreError::SharedRegion(format!(
                        "shared region {path} already exists"
                    )))
                }
                _ => {}
            }
        }
        match ctx.attach()? {
            Step::Done(r) => return Ok(r),
            Step::Missing if shared.mode == SharedMode::Attach => {
                return Err(CoreError::SharedRegion(format!(
                    "no shared region {path} to attach to"
                )))
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(CoreError::SharedRegion(format!(
                "could not create or attach {path} before the timeout"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

struct Ctx<'a> {
    layout: ChunkLayout,
    data_len: usize,
    page: usize,
    path: &'a str,
    cpath: &'a CString,
    shared: &'a SharedOptions,
    options: &'a RegionOptions,
    deadline: Instant,
}

/// Map `len` bytes of `fd`, shared.
fn map_shared(fd: &OwnedFd, len: usize) -> Result<NonNull<u8>> {
    // SAFETY: a fresh shared mapping of our own descriptor; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(last_os_error("mmap of a shared region"));
    }
    NonNull::new(p.cast()).ok_or_else(|| CoreError::Os("mmap returned null".into()))
}

/// The header at the start of a shared region's mapping.
///
/// # Safety
/// `map` is a live, page-aligned mapping at least one page long that stays mapped for `'r`.
#[allow(clippy::cast_ptr_alignment)] // mmap returns page-aligned addresses
unsafe fn header<'r>(map: NonNull<u8>) -> &'r Header {
    // SAFETY: the caller's mapping holds a page at `map`; the header is made of atomics, so
    // shared access from several processes is sound.
    unsafe { &*map.as_ptr().cast::<Header>() }
}

impl Ctx<'_> {
    fn info(&self, creator: bool) -> RegionInfo {
        RegionInfo {
            prefault_method: "",
            prefault_seconds: 0.0,
            locked: false,
            huge_pages: false,
            shared_path: Some(self.path.to_string()),
            creator,
        }
    }

    fn create(&self) -> Result<Step> {
        let dir = CString::new(SHM_DIR).expect("no NUL");
        // SAFETY: open with a NUL-terminated path; the result is checked.
        let raw = unsafe {
            libc::open(
                dir.as_ptr(),
                libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if raw < 0 {
            return Err(last_os_error(
                "creating an unnamed file in /dev/shm (O_TMPFILE)",
            ));
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let total = self.page + self.data_len;
        super::region::check_available(total)?;
        let size = libc::off_t::try_from(total)
            .map_err(|_| CoreError::InvalidArgument("region too large".into()))?;
        // SAFETY: lock and size our own descriptor. fallocate reserves the memory now, so a full
        // /dev/shm is an error here rather than a SIGBUS at first touch.
        unsafe {
            if libc::flock(fd.as_raw_fd(), libc::LOCK_SH) != 0 {
                return Err(last_os_error("flock of a new shared region"));
            }
            if libc::fallocate(fd.as_raw_fd(), 0, 0, size) != 0 {
                return Err(CoreError::Os(format!(
                    "reserving {total} bytes in /dev/shm failed: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
        let map = map_shared(&fd, total)?;
        // SAFETY: `map` maps `total > page` bytes, page-aligned; it is unmapped below only on
        // an error return, after the last use of `h`, or by the region made of it.
        let h = unsafe { header(map) };
        // SAFETY: getpid has no preconditions.
        h.creator_pid
            .store(unsafe { libc::getpid() }, Ordering::Relaxed);
        h.num_chunks
            .store(self.layout.num_chunks() as u64, Ordering::Relaxed);
        h.chunk_bytes
            .store(self.layout.chunk_bytes() as u64, Ordering::Relaxed);
        h.state.store(INIT, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        let proc_path = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL");
        // SAFETY: both paths are NUL-terminated; linkat publishes the file under its name, or
        // fails with EEXIST when the name is taken.
        let rc = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                proc_path.as_ptr(),
                libc::AT_FDCWD,
                self.cpath.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            // SAFETY: unmap the mapping made above; nothing else refers to it.
            unsafe { libc::munmap(map.as_ptr().cast(), total) };
            if err.raw_os_error() == Some(libc::EEXIST) {
                return Ok(Step::Exists);
            }
            return Err(CoreError::Os(format!(
                "publishing {} failed: {err}",
                self.path
            )));
        }
        let st = fstat(&fd)?;
        let file = ShmFile::new(fd, self.cpath.clone(), &st);
        // SAFETY: `map` is this call's own mapping of `total = page + data_len` bytes, and the
        // layout's bytes fit in `data_len`.
        let mut region = unsafe {
            Region::from_mapping(
                map,
                total,
                self.page,
                self.layout.total_bytes(),
                self.data_len,
                self.info(true),
                file,
            )
        };
        let result = self
            .spawn_janitor(st.st_dev, st.st_ino)
            .and_then(|()| self.test_stall())
            .and_then(|()| region.setup(self.options, true));
        match result {
            Ok(()) => {
                h.state.store(READY, Ordering::Release);
                Ok(Step::Done(region))
            }
            Err(e) => {
                let msg = e.to_string();
                let n = msg.len().min(MSG_CAP);
                // SAFETY: the message area lies inside the header page; attachers read it only
                // after seeing FAILED, which is stored with Release after this write.
                unsafe {
                    std::ptr::copy_nonoverlapping(msg.as_ptr(), map.as_ptr().add(MSG_OFFSET), n);
                }
                h.msg_len.store(n as u32, Ordering::Relaxed);
                h.state.store(FAILED, Ordering::Release);
                unlink_if_same(self.cpath, st.st_dev, st.st_ino);
                Err(e)
            }
        }
    }

    fn test_stall(&self) -> Result<()> {
        if let Some((pause, fail)) = self.options.test_creator_stall {
            std::thread::sleep(pause);
            if fail {
                return Err(CoreError::SharedRegion(
                    "injected creator failure (test)".into(),
                ));
            }
        }
        Ok(())
    }

    fn spawn_janitor(&self, dev: u64, ino: u64) -> Result<()> {
        use std::os::unix::process::CommandExt;
        use std::process::{Command, Stdio};
        let Some(argv) = self.shared.janitor.as_ref().filter(|a| !a.is_empty()) else {
            return Ok(());
        };
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .arg(self.path)
            .arg(dev.to_string())
            .arg(ino.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| {
                CoreError::Os(format!(
                    "starting the janitor of {} ({:?}) failed: {e}",
                    self.path, argv[0]
                ))
            })?;
        // Reap it whenever it exits, so it never lingers as a zombie.
        std::thread::Builder::new()
            .name("kvoffload-janitor-reaper".into())
            .spawn(move || child.wait())
            .map_err(|e| CoreError::Os(format!("starting the janitor reaper failed: {e}")))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn shared(name: &str, mode: SharedMode) -> RegionOptions {
        RegionOptions {
            shared: Some(SharedOptions {
                name: name.to_string(),
                mode,
                attach_timeout: Duration::from_secs(5),
                janitor: None,
            }),
            ..RegionOptions::default()
        }
    }

    fn unique(tag: &str) -> String {
        // SAFETY: getpid has no preconditions.
        format!("coretest-{tag}-{}", unsafe { libc::getpid() })
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no shared memory files")]
    fn create_attach_share_bytes_and_clean_up() {
        let name = unique("share");
        let path = region_path(&name).unwrap();
        let layout = ChunkLayout::new(3, 5000).unwrap();
        let a = Region::new(layout, &shared(&name, SharedMode::Create)).unwrap();
        assert!(a.info().creator);
        assert!(Path::new(&path).exists());
        assert!(Region::new(layout, &shared(&name, SharedMode::Create)).is_err());
        let b = Region::new(layout, &shared(&name, SharedMode::CreateOrAttach)).unwrap();
        assert!(!b.info().creator);
        assert_eq!(b.len(), 15000);
        // SAFETY: one write through `a`, then a read through `b`; nothing runs concurrently.
        unsafe {
            a.as_ptr().add(14999).write(42);
            assert_eq!(b.as_ptr().add(14999).read(), 42);
        }
        let wrong = ChunkLayout::new(5, 3000).unwrap();
        let err = Region::new(wrong, &shared(&name, SharedMode::Attach))
            .err()
            .unwrap();
        assert!(matches!(err, CoreError::SharedRegion(_)), "{err}");
        drop(a);
        assert!(Path::new(&path).exists(), "b still holds it");
        drop(b);
        assert!(!Path::new(&path).exists());
        let err = Region::new(layout, &shared(&name, SharedMode::Attach))
            .err()
            .unwrap();
        assert!(err.to_string().contains("no shared region"), "{err}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot spawn processes")]
    fn zombies_are_not_alive() {
        use super::attach::process_alive;
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        std::thread::sleep(Duration::from_millis(200)); // it exits; we have not reaped it
        assert!(!process_alive(pid));
        child.wait().unwrap();
        // SAFETY: getpid has no preconditions.
        assert!(process_alive(unsafe { libc::getpid() }));
    }

    #[test]
    fn bad_names_are_refused() {
        for bad in ["", ".x", "a/b", "a b", &"x".repeat(201)] {
            assert!(region_path(bad).is_err(), "{bad:?}");
        }
    }
}
