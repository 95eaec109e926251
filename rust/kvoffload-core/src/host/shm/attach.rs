//! The attaching side of the shared-region protocol (see the parent module): open the name,
//! tell a stale region from a live one, wait for the creator's `READY` or `FAILED` (or its
//! death, or the timeout), and check the sizes.

use super::{
    fstat, header, map_shared, unlink_if_same, Ctx, Header, ShmFile, Step, FAILED, MAGIC, MSG_CAP,
    MSG_OFFSET, READY,
};
use crate::error::{CoreError, Result};
use crate::host::region::{last_os_error, Region};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Ctx<'_> {
    pub(super) fn attach(&self) -> Result<Step> {
        // Not through a symbolic link: the name must be the region file itself.
        // SAFETY: open with a NUL-terminated path; the result is checked.
        let raw = unsafe {
            libc::open(
                self.cpath.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            )
        };
        if raw < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOENT) {
                return Ok(Step::Missing);
            }
            return Err(CoreError::Os(format!(
                "opening {} failed: {err}",
                self.path
            )));
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let st = fstat(&fd)?;
        self.check_ours(&st)?;
        // SAFETY: flock on our own descriptor.
        if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            // No one holds it: every user is gone (killed). Remove it and start over.
            unlink_if_same(self.cpath, st.st_dev, st.st_ino);
            return Ok(Step::Missing);
        }
        self.lock_shared(&fd)?;
        let st = fstat(&fd)?;
        if st.st_nlink == 0 {
            return Ok(Step::Retry); // unlinked while we waited for the lock
        }
        let size = usize::try_from(st.st_size).unwrap_or(0);
        if size < self.page {
            return Err(CoreError::SharedRegion(format!(
                "{} is not a kvoffload region ({size} bytes)",
                self.path
            )));
        }
        let map = map_shared(&fd, size)?;
        let file = ShmFile::new(fd, self.cpath.clone(), &st);
        // SAFETY: `map` is the fresh mapping of all `size >= page` bytes of the file, owned by
        // nothing else; `layout.total_bytes() <= size - page` is checked below before any use.
        let mut region = unsafe {
            Region::from_mapping(
                map,
                size,
                self.page,
                self.layout.total_bytes(),
                size - self.page,
                self.info(false),
                file,
            )
        };
        // From here on, dropping `region` unmaps and releases.
        // SAFETY: `region` keeps `map` (at least a page, page-aligned) mapped while `h` is used.
        let h = unsafe { header(map) };
        self.wait_ready(h, map)?;
        let (n, cb) = (
            h.num_chunks.load(Ordering::Relaxed),
            h.chunk_bytes.load(Ordering::Relaxed),
        );
        if n != self.layout.num_chunks() as u64
            || cb != self.layout.chunk_bytes() as u64
            || size != self.page + self.data_len
        {
            return Err(CoreError::SharedRegion(format!(
                "{} holds {n} chunks of {cb} bytes ({size} bytes mapped); asked for {} chunks of \
                 {} bytes",
                self.path,
                self.layout.num_chunks(),
                self.layout.chunk_bytes()
            )));
        }
        region.setup(self.options, false)?;
        Ok(Step::Done(region))
    }

    fn wait_ready(&self, h: &Header, map: NonNull<u8>) -> Result<()> {
        if h.magic.load(Ordering::Acquire) != MAGIC {
            return Err(CoreError::SharedRegion(format!(
                "{} is not a kvoffload region (bad magic)",
                self.path
            )));
        }
        let mut pause = Duration::from_micros(200);
        loop {
            match h.state.load(Ordering::Acquire) {
                READY => return Ok(()),
                FAILED => {
                    let n = (h.msg_len.load(Ordering::Relaxed) as usize).min(MSG_CAP);
                    // SAFETY: the creator wrote `n` bytes there before storing FAILED (Release,
                    // read above with Acquire).
                    let bytes =
                        unsafe { std::slice::from_raw_parts(map.as_ptr().add(MSG_OFFSET), n) };
                    return Err(CoreError::SharedRegion(format!(
                        "the creator of {} failed: {}",
                        self.path,
                        String::from_utf8_lossy(bytes)
                    )));
                }
                _ => {}
            }
            let pid = h.creator_pid.load(Ordering::Relaxed);
            if !process_alive(pid) {
                return Err(CoreError::SharedRegion(format!(
                    "the creator of {} (pid {pid}) exited before the region was ready",
                    self.path
                )));
            }
            self.pause_before_deadline(&mut pause, || {
                format!(
                    "timed out waiting for the creator of {} (pid {pid}) to finish setting it up",
                    self.path
                )
            })?;
        }
    }

    /// Refuse a file at the region's name that another user could have made or could change:
    /// not a regular file, owned by another user, or writable by others (kvoffload makes its
    /// regions 0600). Another local user could otherwise plant a file there, read and write this
    /// process's KV cache through it, or shrink it under the mapping (SIGBUS).
    fn check_ours(&self, st: &libc::stat) -> Result<()> {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let kind = st.st_mode & libc::S_IFMT;
        if kind != libc::S_IFREG || st.st_uid != me || st.st_mode & 0o022 != 0 {
            return Err(CoreError::SharedRegion(format!(
                "{} is not a region of this user's (owner uid {}, mode {:o}; this process runs \
                 as uid {me}): refusing to attach",
                self.path,
                st.st_uid,
                st.st_mode & 0o7777,
            )));
        }
        Ok(())
    }

    /// Take a shared lock on the region, waiting no later than the deadline (a releaser holds
    /// the exclusive lock for a moment; a process stopped while holding it would otherwise
    /// keep this one waiting forever).
    fn lock_shared(&self, fd: &OwnedFd) -> Result<()> {
        let mut pause = Duration::from_micros(100);
        loop {
            // SAFETY: flock on our own descriptor.
            if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
                return Ok(());
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(last_os_error("flock of a shared region"));
            }
            self.pause_before_deadline(&mut pause, || {
                format!(
                    "timed out waiting for a lock on {} (another process holds it exclusively)",
                    self.path
                )
            })?;
        }
    }

    /// Sleep `pause`, doubled for the next time (up to 20 ms); past the deadline, the error
    /// `timed_out` describes instead.
    fn pause_before_deadline(
        &self,
        pause: &mut Duration,
        timed_out: impl FnOnce() -> String,
    ) -> Result<()> {
        if Instant::now() > self.deadline {
            return Err(CoreError::SharedRegion(timed_out()));
        }
        std::thread::sleep(*pause);
        *pause = (*pause * 2).min(Duration::from_millis(20));
        Ok(())
    }
}

/// Whether process `pid` exists and has not exited (a zombie, not yet reaped by its parent,
/// counts as exited).
pub(super) fn process_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let exists = unsafe { libc::kill(pid, 0) } == 0
        || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    if !exists {
        return false;
    }
    // /proc/<pid>/stat: "pid (comm) S ..."; the state follows the last ')'.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => true, // no /proc: trust kill
    }
}
