//! Memory helpers: the atomics the shared tables use (loom's under `--cfg loom`), cache
//! prefetch hints, and large zero-filled arrays whose pages are mapped only when first touched.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Back off before retrying an optimistic read that a writer disturbed (under loom: let the
/// model schedule the writer).
#[inline]
pub(crate) fn backoff() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Hint the CPU to bring the cache line holding `x` in; changes nothing.
#[inline]
pub fn prefetch<T>(x: &T) {
    prefetch_addr(std::ptr::from_ref(x).cast());
}

/// Hint the CPU to bring the cache line of address `p` in. Any address is fine: a prefetch
/// never faults and never reads memory into the program, so `p` need not be valid.
#[inline]
pub fn prefetch_addr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch only hints the cache: it never faults, whatever the address, and
        // SSE (which provides the instruction) is part of the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `v` resized to `n` elements, the new ones made by `f`, as [`Vec::resize_with`] does, except
/// that a vector of 2 MiB or more grows into a fresh buffer that asks for transparent huge pages
/// (`MADV_HUGEPAGE`, on Linux) before anything is written to it. The per-chunk arrays of the
/// policies and of the binding (nodes, list places, flags, the kept key objects) grow through
/// this: they are read at random by chunk id, and on 4 KiB pages a pool of millions of chunks
/// would miss the TLB on most of those reads. They grow by doubling, so the copy a growth makes
/// is amortised O(1) per element, as `Vec`'s own growth is.
pub fn resize_huge_with<T>(v: &mut Vec<T>, n: usize, f: impl FnMut() -> T) {
    reserve_huge(v, n.saturating_sub(v.len()));
    v.resize_with(n, f);
}

/// Make room for `additional` more elements in `v`, as [`Vec::reserve`] does, except that a
/// vector that grows to 2 MiB or more grows as [`resize_huge_with`] does.
pub fn reserve_huge<T>(v: &mut Vec<T>, additional: usize) {
    // Under loom (whose models never grow this large) the plain reservation alone.
    #[cfg(not(loom))]
    let n = v.len().saturating_add(additional);
    #[cfg(not(loom))]
    if n > v.capacity() && n.saturating_mul(std::mem::size_of::<T>()) >= HUGE_PAGE {
        let cap = n.max(v.capacity().saturating_mul(2));
        let mut grown: Vec<T> = Vec::with_capacity(cap);
        advise_huge_fresh(
            grown.as_mut_ptr().cast(),
            grown.capacity() * std::mem::size_of::<T>(),
        );
        grown.append(v);
        *v = grown;
    }
    v.reserve(additional);
}

/// [`resize_huge_with`] with copies of `value`.
pub fn resize_huge<T: Clone>(v: &mut Vec<T>, n: usize, value: T) {
    resize_huge_with(v, n, || value.clone());
}

/// Ask the kernel to back the whole 2 MiB pages inside `bytes` bytes from `p`, a fresh
/// allocation that holds nothing yet, with transparent huge pages. A hint that may be refused;
/// a no-op off Linux.
///
/// The C heap serves a request of a few MiB from memory it had handed out and taken back
/// before, whose pages are already mapped as 4 KiB pages: the advice alone would leave them so
/// (at 10^6 chunks, a policy's node array stayed on 4 KiB pages and a load round ran 6%
/// slower for the TLB misses). So the pages inside are also dropped (`MADV_DONTNEED`): the
/// first writes then fault in huge pages.
#[cfg(not(loom))]
fn advise_huge_fresh(p: *mut u8, bytes: usize) {
    let start = (p as usize).div_ceil(HUGE_PAGE) * HUGE_PAGE;
    let end = (p as usize).saturating_add(bytes) / HUGE_PAGE * HUGE_PAGE;
    #[cfg(all(target_os = "linux", not(miri)))]
    if end > start {
        // SAFETY: `start..end` lies inside the caller's allocation of `bytes` bytes from `p`,
        // which holds no value yet (the caller writes every element it later reads), and is
        // page-aligned. The first advice only changes how the kernel backs those pages; the
        // second drops their contents (private anonymous memory, as every allocator's heap is,
        // reads as zeros afterwards), which nothing reads before writing. Neither touches
        // memory outside the range, and failure of either is harmless.
        unsafe {
            let at = start as *mut libc::c_void;
            libc::madvise(at, end - start, libc::MADV_HUGEPAGE);
            libc::madvise(at, end - start, libc::MADV_DONTNEED);
        }
    }
    #[cfg(any(not(target_os = "linux"), miri))]
    let _ = (start, end);
}

/// A type whose all-zero bytes are a valid value (the atomics and structs of them).
///
/// # Safety
/// Implementors guarantee that a value made of zero bytes is valid, and that the type needs no
/// drop.
pub(crate) unsafe trait Zeroable: Sized {
    /// The all-zero value (used where arrays are built element by element, under loom).
    fn zero() -> Self;
}

// SAFETY: `AtomicU32`/`AtomicU64` have the layout of `u32`/`u64` (std documents it), for which
// zero is valid, and they have no drop.
#[cfg(not(loom))]
unsafe impl Zeroable for AtomicU32 {
    fn zero() -> Self {
        Self::new(0)
    }
}
// SAFETY: as above.
#[cfg(not(loom))]
unsafe impl Zeroable for AtomicU64 {
    fn zero() -> Self {
        Self::new(0)
    }
}
// SAFETY: under loom arrays are built with `zero()` (never from zero bytes); loom's atomics
// need no drop of ours.
#[cfg(loom)]
unsafe impl Zeroable for AtomicU32 {
    fn zero() -> Self {
        Self::new(0)
    }
}
// SAFETY: as above.
#[cfg(loom)]
unsafe impl Zeroable for AtomicU64 {
    fn zero() -> Self {
        Self::new(0)
    }
}

// SAFETY: zero is a valid `u8`, which has no drop.
unsafe impl Zeroable for u8 {
    fn zero() -> Self {
        0
    }
}

/// The size of a transparent huge page on x86-64 and arm64 (4 KiB base pages). Under Miri,
/// which has no pages to advise and runs a few thousand times slower, one base page, so that
/// its runs take the huge-array paths at sizes it can afford.
pub(crate) const HUGE_PAGE: usize = if cfg!(miri) { 4096 } else { 2 << 20 };

/// `len` zero values of `T`. Large arrays are anonymous mappings: their pages are the kernel's
/// shared zero page until written, so an array sized for a pool of 10^7 chunks costs memory
/// only for the chunks used.
pub(crate) struct ZeroArray<T: Zeroable> {
    #[cfg(not(loom))]
    ptr: std::ptr::NonNull<T>,
    #[cfg(not(loom))]
    len: usize,
    #[cfg(not(loom))]
    mapped: usize,
    #[cfg(loom)]
    items: Vec<T>,
}

// SAFETY: a `ZeroArray<T>` owns its `T`s as a `Box<[T]>` would; sending or sharing it is
// sending or sharing them.
unsafe impl<T: Zeroable + Send> Send for ZeroArray<T> {}
// SAFETY: as above.
unsafe impl<T: Zeroable + Sync> Sync for ZeroArray<T> {}

impl<T: Zeroable> ZeroArray<T> {
    /// `len` zeros; `None` if the memory cannot be had.
    #[cfg(not(loom))]
    pub(crate) fn new(len: usize) -> Option<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        if bytes == 0 {
            return Some(Self {
                ptr: std::ptr::NonNull::dangling(),
                len,
                mapped: 0,
            });
        }
        // Page-aligned (or 2 MiB-aligned), which satisfies `T`'s alignment (at most 64 here).
        debug_assert!(std::mem::align_of::<T>() <= 4096);
        Some(Self {
            ptr: std::ptr::NonNull::new(map_zeroed(bytes)?.cast())?,
            len,
            mapped: bytes,
        })
    }

    /// `len` zeros, made one by one (loom's atomics are not plain memory).
    #[cfg(loom)]
    pub(crate) fn new(len: usize) -> Option<Self> {
        Some(Self {
            items: (0..len).map(|_| T::zero()).collect(),
        })
    }
}

impl<T: Zeroable> std::ops::Deref for ZeroArray<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        #[cfg(not(loom))]
        {
            // SAFETY: `ptr` points at `len` values of `T` (zero bytes, valid by `Zeroable`) in
            // a mapping this array owns until it drops; a zero `len` takes a dangling pointer,
            // which is valid for an empty slice.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
        }
        #[cfg(loom)]
        {
            &self.items
        }
    }
}

impl<T: Zeroable> std::ops::DerefMut for ZeroArray<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        #[cfg(not(loom))]
        {
            // SAFETY: as in `deref`; `&mut self` makes this the only reference into the array.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
        }
        #[cfg(loom)]
        {
            &mut self.items
        }
    }
}

/// A fresh private anonymous read-write mapping of `bytes` (more than zero) bytes, whose pages
/// read as zeros: page-aligned, or on a huge-page boundary when `huge_aligned` (a huge page more
/// is mapped and both ends trimmed). `noreserve`: no swap is set aside for it
/// (`MAP_NORESERVE`). `Err`: the length overflows (`InvalidInput`) or the kernel's refusal.
/// Release with `munmap` of `bytes` bytes.
#[cfg(not(miri))]
pub(crate) fn map_anonymous(
    bytes: usize,
    huge_aligned: bool,
    noreserve: bool,
) -> std::io::Result<*mut u8> {
    let extra = if huge_aligned { HUGE_PAGE } else { 0 };
    let map_len = bytes
        .checked_add(extra)
        .ok_or(std::io::ErrorKind::InvalidInput)?;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let flags = if noreserve {
        flags | libc::MAP_NORESERVE
    } else {
        flags
    };
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let mut start = p.cast::<u8>();
    if huge_aligned {
        let head = (HUGE_PAGE - start as usize % HUGE_PAGE) % HUGE_PAGE;
        let tail = map_len - head - bytes;
        // SAFETY: `head` and `tail` lie inside the mapping just made, hold nothing, and are
        // unmapped once; what remains is `bytes` long and starts on a huge-page boundary.
        unsafe {
            if head > 0 {
                libc::munmap(start.cast(), head);
            }
            start = start.add(head);
            if tail > 0 {
                libc::munmap(start.add(bytes).cast(), tail);
            }
        }
    }
    Ok(start)
}

/// `bytes` (more than zero) zero bytes, page-aligned, as a fresh private anonymous mapping: its
/// pages are the kernel's shared zero page until written. Mappings of 2 MiB or more sit on
/// 2 MiB boundaries and ask for transparent huge pages: the arrays are read at random (hash
/// buckets, slots by chunk id), and with 4 KiB pages most of those reads would also miss the
/// TLB. `None` if the kernel refuses. Release with [`unmap`].
#[cfg(all(not(loom), not(miri)))]
pub(crate) fn map_zeroed(bytes: usize) -> Option<*mut u8> {
    let huge = bytes >= HUGE_PAGE;
    let start = map_anonymous(bytes, huge, true).ok()?;
    if huge {
        // SAFETY: advice on the mapping just made; it only changes how the kernel backs its
        // pages (it may refuse; nothing depends on it).
        unsafe { libc::madvise(start.cast(), bytes, libc::MADV_HUGEPAGE) };
    }
    Some(start)
}

/// Release what [`map_zeroed`] returned for `bytes`.
///
/// # Safety
/// `p` came from `map_zeroed(bytes)` and is released once; nothing refers into it any more.
#[cfg(all(not(loom), not(miri)))]
pub(crate) unsafe fn unmap(p: *mut u8, bytes: usize) {
    // SAFETY: the caller's contract: `p..p + bytes` is a mapping of ours, unmapped once.
    unsafe { libc::munmap(p.cast(), bytes) };
}

/// The layout [`map_zeroed`] asks the allocator for under Miri (which has no `mmap` of this
/// kind): page-aligned, as the mapping is.
#[cfg(all(not(loom), miri))]
fn zeroed_layout(bytes: usize) -> Option<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(bytes, 4096).ok()
}

/// Under Miri, the same zero bytes from the global allocator, so that Miri checks everything
/// built on them.
#[cfg(all(not(loom), miri))]
pub(crate) fn map_zeroed(bytes: usize) -> Option<*mut u8> {
    // SAFETY: the layout has a non-zero size (callers never ask for zero bytes).
    let p = unsafe { std::alloc::alloc_zeroed(zeroed_layout(bytes)?) };
    (!p.is_null()).then_some(p)
}

/// Under Miri, free what [`map_zeroed`] allocated.
///
/// # Safety
/// As for the mapping: `p` came from `map_zeroed(bytes)` and is released once.
#[cfg(all(not(loom), miri))]
pub(crate) unsafe fn unmap(p: *mut u8, bytes: usize) {
    if let Some(layout) = zeroed_layout(bytes) {
        // SAFETY: `p` was allocated by `alloc_zeroed` with this very layout (the caller's
        // contract) and is freed once.
        unsafe { std::alloc::dealloc(p, layout) };
    }
}

#[cfg(not(loom))]
impl<T: Zeroable> Drop for ZeroArray<T> {
    fn drop(&mut self) {
        if self.mapped > 0 {
            // SAFETY: the memory was made by `map_zeroed` with this length (in `new`) and is
            // released once; `T` needs no drop (`Zeroable`), and no reference into it outlives
            // `self`.
            unsafe { unmap(self.ptr.as_ptr().cast(), self.mapped) };
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn zero_arrays_read_zero_and_take_writes() {
        let a: ZeroArray<AtomicU64> = ZeroArray::new(1 << 20).unwrap();
        assert_eq!(a.len(), 1 << 20);
        assert!(a
            .iter()
            .step_by(4096)
            .all(|x| x.load(Ordering::Relaxed) == 0));
        a[12345].store(7, Ordering::Relaxed);
        assert_eq!(a[12345].load(Ordering::Relaxed), 7);
        let empty: ZeroArray<AtomicU32> = ZeroArray::new(0).unwrap();
        assert!(empty.is_empty());
        assert!(ZeroArray::<AtomicU64>::new(usize::MAX).is_none());
    }

    #[test]
    fn resizing_keeps_the_elements_and_fills_the_rest_small_and_huge() {
        // Small steps below a huge page, one growth across it, then steps inside the huge
        // buffer and another growth of it; a shrink at the end. The sizes are in u64 elements
        // and scale with the huge page (2 MiB; one 4 KiB page under Miri).
        let h = HUGE_PAGE / 8;
        let mut v: Vec<u64> = Vec::new();
        let mut next = 0u64;
        for n in [10, h / 262, h * 3 / 4, h * 8 / 7, h * 8 / 7 + 1, h * 8, 5] {
            let before = v.clone();
            resize_huge_with(&mut v, n, || {
                next += 1;
                next
            });
            assert_eq!(v.len(), n);
            let kept = before.len().min(n);
            assert_eq!(v[..kept], before[..kept], "elements kept at n = {n}");
            assert!(
                v[kept..].windows(2).all(|w| w[1] == w[0] + 1),
                "new elements made in order at n = {n}"
            );
        }
        // A huge growth into memory the heap may have handed out before (written, freed, then
        // dropped from the new buffer before use): every element is what was written, none
        // stale. (The first free raises glibc's mmap threshold, so the second block, and then
        // the grown vector, come from the heap.)
        for _ in 0..2 {
            drop(vec![0xabu8; 3 * HUGE_PAGE]);
        }
        let mut w: Vec<u64> = vec![1; 1 << 10];
        resize_huge(&mut w, h * 5 / 2, 7);
        assert!(w[..1 << 10].iter().all(|&x| x == 1) && w[1 << 10..].iter().all(|&x| x == 7));
        let mut flags = vec![true; 3];
        resize_huge(&mut flags, HUGE_PAGE * 3 / 2, false);
        assert!(flags[..3].iter().all(|&f| f) && !flags[3..].iter().any(|&f| f));
        // A huge growth takes at least double the capacity (amortised O(1) growth).
        let cap = flags.capacity();
        resize_huge(&mut flags, cap + 1, true);
        assert!(flags.capacity() >= 2 * cap);
    }
}
