//! The one error type of the core crate. Every fallible call checks its whole input before it
//! changes anything, so an `Err` always means "nothing happened".

use std::fmt::{self, Write as _};

/// Why a manager call was refused. Each variant maps to one Python exception class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A constructor or call argument has an illegal value.
    InvalidArgument(String),
    /// A key is missing or in the wrong state for the call (absent or pending on load,
    /// not pinned on load completion).
    KeyState(String),
    /// The same key appears twice where each key may appear once.
    DuplicateKey(String),
    /// A finished request tried to record a key it had not seen before it finished.
    RequestFinished(String),
    /// A ref count would leave its representable range.
    Overflow(String),
    /// `validate()` found a broken invariant (a bug in this crate).
    Invariant(String),
    /// A block or chunk id lies outside its buffer or pool.
    OutOfRange(String),
    /// An operating-system call on host memory failed (mmap, madvise, shared-memory files).
    Os(String),
    /// Page locking (mlock) failed; the message names `RLIMIT_MEMLOCK`.
    PageLock(String),
    /// A named shared-memory region cannot be created or attached (its creator failed or died,
    /// its size differs, the attach timed out).
    SharedRegion(String),
    /// The host pool was closed.
    Closed(String),
    /// An external (plug-in) policy raised or broke its contract; the manager undid the call
    /// as far as the policy allowed (see `Manager::with_policy`).
    Policy(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidArgument(m)
            | CoreError::KeyState(m)
            | CoreError::DuplicateKey(m)
            | CoreError::RequestFinished(m)
            | CoreError::Overflow(m)
            | CoreError::Invariant(m)
            | CoreError::OutOfRange(m)
            | CoreError::Os(m)
            | CoreError::PageLock(m)
            | CoreError::SharedRegion(m)
            | CoreError::Closed(m)
            | CoreError::Policy(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for CoreError {}

/// Shorthand for results of this crate.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;

/// Format a key for an error message: printable ASCII as is, other bytes as `\xNN`.
#[must_use]
pub fn show_key(key: &[u8]) -> String {
    let mut out = String::from("b'");
    for &b in key {
        if (0x20..0x7f).contains(&b) && b != b'\'' && b != b'\\' {
            out.push(b as char);
        } else {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out.push('\'');
    out
}

/// Return `Err(CoreError::Invariant)` with a formatted message unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::error::CoreError::Invariant(format!($($arg)+)));
        }
    };
}
pub(crate) use ensure;
