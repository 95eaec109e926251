//! Block transfers between a caller's buffer and a region's chunks.
//!
//! The caller's buffer is a run of `block_bytes`-sized blocks; block `blocks[i]` pairs with chunk
//! `chunks[i]`, at byte `chunk_offset` inside the chunk. [`plan`] checks every id and size before
//! anything moves, so an `Err` means nothing was written; [`Plan::execute`] then only copies.

use super::region::Region;
use super::ChunkLayout;
use crate::error::{CoreError, Result};
use rayon::prelude::*;

/// Which way the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Buffer blocks into chunks (a store: device cache to host).
    Gather,
    /// Chunks into buffer blocks (a load: host back to the device cache).
    Scatter,
}

/// A caller's buffer as a raw pointer and a length; whoever builds one vouches for its validity.
#[derive(Debug, Clone, Copy)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `RawBuf` is only an address; the unsafe functions that read or write through it
// carry the obligation that the memory is valid and not written concurrently.
unsafe impl Send for RawBuf {}
// SAFETY: as above; shared references to it only copy the address.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// A buffer of `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for `len` bytes (reads, and writes when used as a scatter target) for
    /// as long as any transfer using this `RawBuf` runs.
    #[must_use]
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        Self { ptr, len }
    }

    /// A read-only slice's bytes (only for gathers, which never write to the buffer).
    #[must_use]
    pub fn from_slice(s: &[u8]) -> Self {
        Self {
            ptr: s.as_ptr().cast_mut(),
            len: s.len(),
        }
    }

    /// A mutable slice's bytes.
    #[must_use]
    pub fn from_mut_slice(s: &mut [u8]) -> Self {
        Self {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What to copy: `blocks[i]` of the buffer pairs with `chunks[i]` of the pool.
#[derive(Debug, Clone, Copy)]
pub struct TransferSpec<'a> {
    /// Bytes per buffer block (the buffer holds `len / block_bytes` blocks).
    pub block_bytes: usize,
    /// Where inside each chunk the block goes (`chunk_offset + block_bytes <= chunk_bytes`).
    pub chunk_offset: usize,
    /// Buffer block ids.
    pub blocks: &'a [i64],
    /// Chunk ids, one per block id.
    pub chunks: &'a [i64],
}

/// Largest piece one thread copies at a time; bigger blocks are split so threads share them.
/// (Under Miri 32 KiB, so that its runs split blocks and copy on threads at sizes it can
/// afford; still above [`STREAMING_MIN_BYTES`].)
const PIECE_BYTES: usize = if cfg!(miri) { 32 << 10 } else { 1 << 20 };
/// Blocks at least this long are copied in source address order; below it, sorting the pieces
/// would cost a noticeable part of copying them.
const SORT_MIN_BYTES: usize = 16 << 10;
/// Below this many bytes a transfer runs on the calling thread: waking workers costs more.
const PARALLEL_MIN_BYTES: usize = 4 * PIECE_BYTES;

/// A validated transfer: byte offsets only, every one in bounds.
#[derive(Debug)]
pub struct Plan {
    direction: Direction,
    buf: RawBuf,
    region_ptr: *mut u8,
    /// (offset in the buffer, offset in the region, length); destinations never overlap.
    pieces: Vec<(usize, usize, usize)>,
    total_bytes: usize,
    /// The destination is the region on base (4 KiB) pages: see [`DEST_WARM_BYTES`].
    warm_dest_pages: bool,
}

// SAFETY: `region_ptr` points into a `Region` that the plan's user keeps alive (an `Arc` clone
// travels with every queued job); the plan itself is plain offsets.
unsafe impl Send for Plan {}
// SAFETY: as above; `execute` takes `&self` and its threads write disjoint pieces only.
unsafe impl Sync for Plan {}

fn id_in(id: i64, bound: usize, what: &str, pos: usize) -> Result<usize> {
    match usize::try_from(id) {
        Ok(i) if i < bound => Ok(i),
        _ => Err(CoreError::OutOfRange(format!(
            "{what} id {id} at position {pos} is out of range 0..{bound}"
        ))),
    }
}

/// Destination ids seen so far: a bitset when it is small next to the number of ids, else the
/// ids themselves, sorted at the end (so a 32-block transfer into a million-chunk pool does not
/// clear a 128 KiB bitset).
enum Destinations {
    Bits(Vec<u64>),
    Sorted(Vec<usize>),
}

impl Destinations {
    fn new(bound: usize, n: usize) -> Self {
        if bound.div_ceil(64) <= n.saturating_mul(4) {
            Self::Bits(vec![0; bound.div_ceil(64)])
        } else {
            Self::Sorted(Vec::with_capacity(n.min(bound)))
        }
    }

    fn twice(what: &str, d: usize) -> CoreError {
        CoreError::InvalidArgument(format!(
            "{what} id {d} is a destination twice; the copies would race"
        ))
    }

    fn insert(&mut self, d: usize, pos: usize, what: &str) -> Result<()> {
        match self {
            Self::Bits(seen) => {
                let (word, bit) = (d / 64, 1u64 << (d % 64));
                if seen[word] & bit != 0 {
                    return Err(CoreError::InvalidArgument(format!(
                        "{what} id {d} is a destination twice (again at position {pos}); the \
                         copies would race"
                    )));
                }
                seen[word] |= bit;
            }
            Self::Sorted(ids) => ids.push(d),
        }
        Ok(())
    }

    fn finish(self, what: &str) -> Result<()> {
        if let Self::Sorted(mut ids) = self {
            ids.sort_unstable();
            if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
                return Err(Self::twice(what, w[0]));
            }
        }
        Ok(())
    }
}

/// Check a transfer against the region and the buffer; `Err` means nothing will be copied.
pub fn plan(
    region: &Region,
    layout: ChunkLayout,
    direction: Direction,
    buf: RawBuf,
    spec: &TransferSpec<'_>,
) -> Result<Plan> {
    let bb = spec.block_bytes;
    if bb == 0 {
        return Err(CoreError::InvalidArgument(
            "block_bytes must be at least 1".into(),
        ));
    }
    if buf.len % bb != 0 {
        return Err(CoreError::InvalidArgument(format!(
            "the buffer's {} bytes are not a whole number of {bb}-byte blocks",
            buf.len
        )));
    }
    let cb = layout.chunk_bytes();
    if spec.chunk_offset.checked_add(bb).is_none_or(|end| end > cb) {
        return Err(CoreError::InvalidArgument(format!(
            "a {bb}-byte block at offset {} does not fit in a {cb}-byte chunk",
            spec.chunk_offset
        )));
    }
    if spec.blocks.len() != spec.chunks.len() {
        return Err(CoreError::InvalidArgument(format!(
            "{} block ids but {} chunk ids",
            spec.blocks.len(),
            spec.chunks.len()
        )));
    }
    let region_start = region.as_ptr() as usize;
    let region_end = region_start + region.mapped_len();
    let buf_start = buf.ptr as usize;
    if buf.len > 0 && buf_start < region_end && region_start < buf_start + buf.len {
        return Err(CoreError::InvalidArgument(
            "the buffer overlaps the pool's own memory; copy between chunks through a separate \
             buffer"
                .into(),
        ));
    }
    let num_blocks = buf.len / bb;
    // Destinations must be distinct, or two threads would write the same bytes.
    let (dest_bound, dest_what) = match direction {
        Direction::Gather => (layout.num_chunks(), "chunk"),
        Direction::Scatter => (num_blocks, "block"),
    };
    let n = spec.blocks.len();
    // A valid plan has at most `dest_bound` pairs: bound the allocation before validating.
    let mut pieces = Vec::with_capacity(n.min(dest_bound) * bb.div_ceil(PIECE_BYTES));
    let mut dests = Destinations::new(dest_bound, n);
    for (pos, (&b, &c)) in spec.blocks.iter().zip(spec.chunks).enumerate() {
        let b = id_in(b, num_blocks, "block", pos)?;
        let c = id_in(c, layout.num_chunks(), "chunk", pos)?;
        dests.insert(
            if direction == Direction::Gather { c } else { b },
            pos,
            dest_what,
        )?;
        let (boff, coff) = (b * bb, c * cb + spec.chunk_offset);
        let mut done = 0;
        while done < bb {
            let len = PIECE_BYTES.min(bb - done);
            pieces.push((boff + done, coff + done, len));
            done += len;
        }
    }
    dests.finish(dest_what)?;
    // Copy in source order: the order is unobservable (destinations are distinct, sources are
    // only read), and a source read front to back keeps the hardware prefetcher and the DRAM
    // rows warm across blocks where a random block table would restart them every block.
    if bb >= SORT_MIN_BYTES {
        match direction {
            Direction::Gather => pieces.sort_unstable_by_key(|&(boff, _, _)| boff),
            Direction::Scatter => pieces.sort_unstable_by_key(|&(_, coff, _)| coff),
        }
    }
    Ok(Plan {
        direction,
        buf,
        region_ptr: region.as_ptr(),
        total_bytes: n * bb,
        pieces,
        warm_dest_pages: direction == Direction::Gather && !region.info().huge_pages,
    })
}

impl Plan {
    /// Bytes this plan copies.
    #[must_use]
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }

    /// Copy, on the calling thread or on up to `threads` threads of `pool`.
    ///
    /// # Safety
    /// The region the plan was made for is still mapped, and the buffer is still valid (for
    /// writes when scattering) and not written by anyone else during the call.
    pub unsafe fn execute(&self, pool: &rayon::ThreadPool, threads: usize) {
        let copy = |&(boff, coff, n): &(usize, usize, usize)| {
            // SAFETY: `plan` checked every piece lies inside the buffer and the region, the two
            // do not overlap, and no two pieces share a destination byte; the caller keeps both
            // memories valid.
            unsafe {
                let b = self.buf.ptr.add(boff);
                let c = self.region_ptr.add(coff);
                match self.direction {
                    Direction::Gather => copy_block(b.cast_const(), c, n),
                    Direction::Scatter => copy_block(c.cast_const(), b, n),
                }
            }
        };
        let run = |group: &[(usize, usize, usize)]| {
            for (i, piece) in group.iter().enumerate() {
                if let Some(&(boff, coff, n)) = group.get(i + 1) {
                    let b = self.buf.ptr.wrapping_add(boff).cast_const();
                    let c = self.region_ptr.wrapping_add(coff).cast_const();
                    let (src, dst) = match self.direction {
                        Direction::Gather => (b, c),
                        Direction::Scatter => (c, b),
                    };
                    prefetch(src, NEXT_PIECE_PREFETCH, 64);
                    if self.warm_dest_pages {
                        prefetch(dst, n.min(DEST_WARM_BYTES), BASE_PAGE_BYTES);
                    }
                }
                copy(piece);
            }
            store_fence();
        };
        if threads <= 1 || self.total_bytes < PARALLEL_MIN_BYTES || self.pieces.len() < 2 {
            run(&self.pieces);
        } else {
            // Groups of a few MiB: big enough to amortise the fence, small enough to balance.
            let per_group = (4 * PIECE_BYTES / self.pieces[0].2.max(1))
                .clamp(1, self.pieces.len().div_ceil(threads));
            pool.install(|| self.pieces.par_chunks(per_group).for_each(run));
        }
    }
}

/// Pieces at least this long are copied with non-temporal (streaming) stores: the copy's target
/// is not read again soon, and streaming skips the read-for-ownership of every target line, which
/// is what a large `memcpy` does too.
pub const STREAMING_MIN_BYTES: usize = 16 << 10;

/// How far ahead of the copy the source is prefetched (a hint: past the end is harmless).
const PREFETCH_AHEAD: usize = 512;

/// How much of the next piece's source is prefetched while the current piece is copied.
const NEXT_PIECE_PREFETCH: usize = 512;

/// How much of the next piece's destination has one line per 4 KiB page prefetched, when that
/// destination is the region on base pages (all of the piece): each block starts page walks on
/// page-table lines that a random block order leaves cold (a sequential copy finds them cached),
/// and the prefetches let those walks overlap the current copy. Paired probes, gathers into a
/// 4 KiB-page pool against `memcpy` into it: 64 KiB blocks 0.97-0.99 -> 1.01, 256 KiB 0.97 ->
/// 1.05, 1 MiB 1.00 -> 1.09. On huge pages (and for scatters into a caller's buffer, which numpy
/// puts on huge pages) the walks are rare and the extra line reads cost 2-3%: off there.
const DEST_WARM_BYTES: usize = PIECE_BYTES;

/// x86-64's base page.
const BASE_PAGE_BYTES: usize = 4 << 10;

/// Copy `n` bytes; streaming stores for large pieces on x86-64, `memcpy` otherwise. The caller
/// runs [`store_fence`] on this thread before publishing that the copy is done.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `n` bytes, and the ranges do not overlap.
pub unsafe fn copy_block(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= STREAMING_MIN_BYTES {
        // SAFETY: forwarded from the caller.
        unsafe { stream_copy(src, dst, n) };
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

/// `memcpy` with streaming stores, a whole 64-byte target line per step: AVX2 where the CPU has
/// it (as glibc's large-copy loop does; in paired runs here, gathers 5-9% and scatters 0-6%
/// faster than with SSE2's twice as many 16-byte stores), SSE2 (part of x86-64) otherwise. Not fenced: see [`store_fence`].
///
/// # Safety
/// As for [`copy_block`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, n: usize) {
    // Plain copy up to the first 64-byte aligned target byte: each step then fills exactly one
    // cache line, so the write-combining buffer goes out whole (a target 16 bytes off a line,
    // as a `malloc`-ed scatter target is, otherwise splits every step across two lines).
    let head = dst.align_offset(64).min(n);
    let lines = (n - head) / 64;
    let tail = head + lines * 64;
    // SAFETY: `head <= tail <= n`; the caller guarantees both ranges; `dst + head` is 64-byte
    // aligned; the line loops read and write `[head, tail)` only.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        if std::is_x86_feature_detected!("avx2") {
            stream_lines_avx2(src.add(head), dst.add(head), lines);
        } else {
            stream_lines_sse2(src.add(head), dst.add(head), lines);
        }
        std::ptr::copy_nonoverlapping(src.add(tail), dst.add(tail), n - tail);
    }
}

/// Stream `lines` 64-byte lines with SSE2 (four 16-byte streaming stores per line).
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `lines * 64` bytes, not overlapping; `dst`
/// is 64-byte aligned.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment)] // loads are unaligned (loadu); stores are 64-aligned
unsafe fn stream_lines_sse2(src: *const u8, dst: *mut u8, lines: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128};
    // Miri runs no inline assembly, which the streaming store is made of: there, the aligned
    // store of the same width, which Miri checks as strictly (bounds, 16-byte alignment).
    #[cfg(miri)]
    use std::arch::x86_64::_mm_store_si128 as _mm_stream_si128;
    #[cfg(not(miri))]
    use std::arch::x86_64::_mm_stream_si128;
    for line in 0..lines {
        prefetch_ahead(src, line);
        // SAFETY: line `line < lines` lies inside both ranges; the target line is aligned.
        unsafe {
            let from = src.add(line * 64).cast::<__m128i>();
            let to = dst.add(line * 64).cast::<__m128i>();
            let parts = [
                _mm_loadu_si128(from),
                _mm_loadu_si128(from.add(1)),
                _mm_loadu_si128(from.add(2)),
                _mm_loadu_si128(from.add(3)),
            ];
            for (k, part) in parts.into_iter().enumerate() {
                _mm_stream_si128(to.add(k), part);
            }
        }
    }
}

/// Stream `lines` 64-byte lines with AVX2 (two 32-byte streaming stores per line).
///
/// # Safety
/// As for [`stream_lines_sse2`], and the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::cast_ptr_alignment)] // loads are unaligned (loadu); stores are 64-aligned
unsafe fn stream_lines_avx2(src: *const u8, dst: *mut u8, lines: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256};
    // Under Miri the aligned store of the same width, as in `stream_lines_sse2`.
    #[cfg(miri)]
    use std::arch::x86_64::_mm256_store_si256 as _mm256_stream_si256;
    #[cfg(not(miri))]
    use std::arch::x86_64::_mm256_stream_si256;
    for line in 0..lines {
        prefetch_ahead(src, line);
        // SAFETY: line `line < lines` lies inside both ranges; the target line is aligned.
        unsafe {
            let from = src.add(line * 64).cast::<__m256i>();
            let to = dst.add(line * 64).cast::<__m256i>();
            let (a, b) = (_mm256_loadu_si256(from), _mm256_loadu_si256(from.add(1)));
            _mm256_stream_si256(to, a);
            _mm256_stream_si256(to.add(1), b);
        }
    }
}

/// Hint the source a few lines ahead of line `line`: the hardware prefetcher stops at each page.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(src: *const u8, line: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(line * 64 + PREFETCH_AHEAD).cast()) };
}

/// Hint that the `bytes` from `ptr` will be used soon (the start of the next piece, which the
/// hardware prefetcher cannot guess), one line every `step` bytes. Prefetches never fault, so
/// any address is fine.
fn prefetch(ptr: *const u8, bytes: usize, step: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..bytes).step_by(step) {
        // SAFETY: a prefetch is a hint; it never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_NTA }>(
                ptr.wrapping_add(off).cast(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ptr, bytes, step);
}

/// Order the streaming stores made so far by this thread before any later store (such as the
/// one that reports the copy done). Every thread that called [`copy_block`] calls this before
/// its work counts as finished.
pub fn store_fence() {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: sfence has no preconditions (SSE is part of x86-64).
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
    // Miri has no `sfence` (its streaming stores are plain stores): a fence of its own, so
    // that what it checks is ordered at least as strongly.
    #[cfg(miri)]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::RegionOptions;

    fn region(layout: ChunkLayout) -> Region {
        Region::new(layout, &RegionOptions::default()).unwrap()
    }

    fn spec<'a>(bb: usize, off: usize, blocks: &'a [i64], chunks: &'a [i64]) -> TransferSpec<'a> {
        TransferSpec {
            block_bytes: bb,
            chunk_offset: off,
            blocks,
            chunks,
        }
    }

    #[test]
    fn rejects_bad_sizes_and_ids() {
        let layout = ChunkLayout::new(4, 64).unwrap();
        let r = region(layout);
        let src = [0u8; 128];
        let buf = RawBuf::from_slice(&src);
        let g = Direction::Gather;
        let err = |s: &TransferSpec<'_>| plan(&r, layout, g, buf, s).unwrap_err();
        assert!(matches!(
            err(&spec(0, 0, &[], &[])),
            CoreError::InvalidArgument(_)
        ));
        assert!(matches!(
            err(&spec(48, 0, &[], &[])),
            CoreError::InvalidArgument(_)
        ));
        assert!(matches!(
            err(&spec(32, 40, &[0], &[0])),
            CoreError::InvalidArgument(_)
        ));
        assert!(matches!(
            err(&spec(32, 0, &[0], &[])),
            CoreError::InvalidArgument(_)
        ));
        assert!(matches!(
            err(&spec(32, 0, &[4], &[0])),
            CoreError::OutOfRange(_)
        ));
        assert!(matches!(
            err(&spec(32, 0, &[-1], &[0])),
            CoreError::OutOfRange(_)
        ));
        assert!(matches!(
            err(&spec(32, 0, &[0], &[4])),
            CoreError::OutOfRange(_)
        ));
        assert!(matches!(
            err(&spec(32, 0, &[0, 1], &[2, 2])),
            CoreError::InvalidArgument(_)
        ));
        // The same source block twice is fine on a gather; the same target block is not on a
        // scatter.
        assert!(plan(&r, layout, g, buf, &spec(32, 0, &[1, 1], &[0, 1])).is_ok());
        let s = Direction::Scatter;
        assert!(plan(&r, layout, s, buf, &spec(32, 0, &[1, 1], &[0, 1])).is_err());
    }

    #[test]
    fn copy_block_handles_every_alignment_and_length() {
        let src: Vec<u8> = (0..(STREAMING_MIN_BYTES * 2 + 200))
            .map(|i| (i * 7 % 253) as u8)
            .collect();
        for n in [
            0,
            1,
            63,
            STREAMING_MIN_BYTES - 1,
            STREAMING_MIN_BYTES,
            STREAMING_MIN_BYTES + 77,
        ] {
            for (so, d_off) in [(0, 0), (1, 0), (0, 5), (3, 15), (17, 9)] {
                let mut dst = vec![0u8; n + 32];
                // SAFETY: both ranges are inside their vectors and distinct allocations.
                unsafe { copy_block(src.as_ptr().add(so), dst.as_mut_ptr().add(d_off), n) };
                store_fence();
                assert_eq!(
                    &dst[d_off..d_off + n],
                    &src[so..so + n],
                    "n={n} so={so} do={d_off}"
                );
                assert!(dst[..d_off]
                    .iter()
                    .chain(&dst[d_off + n..])
                    .all(|&b| b == 0));
            }
        }
    }

    /// `copy_block` takes one of the two line loops; each is checked here on its own.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_streaming_line_loops_copy_whole_lines() {
        let src: Vec<u8> = (0..64 * 40 + 3).map(|i| (i * 11 % 251) as u8).collect();
        let mut kernels: Vec<unsafe fn(*const u8, *mut u8, usize)> = vec![stream_lines_sse2];
        if std::is_x86_feature_detected!("avx2") {
            kernels.push(|s, d, lines| {
                // SAFETY: AVX2 was detected; the caller's obligations are forwarded.
                unsafe { stream_lines_avx2(s, d, lines) }
            });
        }
        for kernel in kernels {
            for (lines, so) in [(0, 0), (1, 0), (7, 3), (40, 1)] {
                let mut dst = vec![0u8; 64 * 42];
                let at = dst.as_ptr().align_offset(64);
                // SAFETY: `lines * 64` bytes from `so` and from the aligned `at` lie inside the
                // two distinct vectors.
                unsafe { kernel(src.as_ptr().add(so), dst.as_mut_ptr().add(at), lines) };
                store_fence();
                let n = lines * 64;
                assert_eq!(&dst[at..at + n], &src[so..so + n], "lines={lines} so={so}");
                assert!(dst[..at].iter().chain(&dst[at + n..]).all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn duplicate_destinations_are_found_in_small_and_large_pools() {
        // 64 chunks: a bitset; 1 << 20 chunks and 3 ids: sorted ids.
        for num_chunks in [64, 1 << 20] {
            let layout = ChunkLayout::new(num_chunks, 8).unwrap();
            let r = region(layout);
            let src = [7u8; 24];
            let buf = RawBuf::from_slice(&src);
            let g = Direction::Gather;
            let dup = spec(8, 0, &[0, 1, 2], &[5, 9, 5]);
            let err = plan(&r, layout, g, buf, &dup).unwrap_err();
            assert!(
                err.to_string()
                    .contains("chunk id 5 is a destination twice"),
                "{err}"
            );
            assert!(plan(&r, layout, g, buf, &spec(8, 0, &[0, 1, 2], &[5, 9, 6])).is_ok());
        }
    }

    #[test]
    fn large_blocks_copy_in_source_order() {
        let layout = ChunkLayout::new(4, SORT_MIN_BYTES).unwrap();
        let r = region(layout);
        let buf: Vec<u8> = (0..4 * SORT_MIN_BYTES).map(|i| (i % 249) as u8).collect();
        let s = spec(SORT_MIN_BYTES, 0, &[2, 0, 3, 1], &[0, 3, 1, 2]);
        let g = plan(&r, layout, Direction::Gather, RawBuf::from_slice(&buf), &s).unwrap();
        let by_buf: Vec<usize> = g.pieces.iter().map(|p| p.0 / SORT_MIN_BYTES).collect();
        assert_eq!(by_buf, [0, 1, 2, 3]);
        let sc = plan(&r, layout, Direction::Scatter, RawBuf::from_slice(&buf), &s).unwrap();
        let by_chunk: Vec<usize> = sc.pieces.iter().map(|p| p.1 / SORT_MIN_BYTES).collect();
        assert_eq!(by_chunk, [0, 1, 2, 3]);
        // The pairs survive the sort: block 2 still goes to chunk 0.
        assert_eq!(sc.pieces[0].0, 2 * SORT_MIN_BYTES);
        // A gather into base pages warms the next destination's pages; a scatter does not.
        assert!(g.warm_dest_pages && !sc.warm_dest_pages);
    }

    #[test]
    fn rejects_a_buffer_inside_the_region() {
        let layout = ChunkLayout::new(4, 64).unwrap();
        let r = region(layout);
        // SAFETY: the pointer is only compared, never dereferenced (the plan is refused).
        let inside = unsafe { RawBuf::new(r.as_ptr().add(64), 64) };
        let s = spec(64, 0, &[0], &[0]);
        assert!(plan(&r, layout, Direction::Gather, inside, &s).is_err());
    }

    #[test]
    fn large_blocks_split_into_pieces_and_copy_on_threads() {
        // Blocks of three pieces (1 MiB each; 32 KiB under Miri).
        let bb = 3 * PIECE_BYTES;
        let layout = ChunkLayout::new(3, bb).unwrap();
        let r = region(layout);
        let src: Vec<u8> = (0..2 * bb).map(|i| (i % 251) as u8).collect();
        let s = spec(bb, 0, &[1, 0], &[0, 2]);
        let p = plan(&r, layout, Direction::Gather, RawBuf::from_slice(&src), &s).unwrap();
        assert_eq!(p.pieces.len(), 6);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        // SAFETY: `r` and `src` outlive the call.
        unsafe { p.execute(&pool, 2) };
        // SAFETY: the region is mapped and no transfer runs.
        let mem = unsafe { std::slice::from_raw_parts(r.as_ptr(), 3 * bb) };
        assert_eq!(&mem[..bb], &src[bb..]);
        assert!(mem[bb..2 * bb].iter().all(|&b| b == 0));
        assert_eq!(&mem[2 * bb..], &src[..bb]);
    }

    #[test]
    fn rejects_a_buffer_that_runs_into_the_region_from_below() {
        let layout = ChunkLayout::new(4, 64).unwrap();
        let r = region(layout);
        let s = spec(64, 0, &[0], &[0]);
        let g = Direction::Gather;
        let below = r.as_ptr().wrapping_sub(64);
        // SAFETY: the pointers are only compared, never dereferenced (no plan is executed).
        let (into, around, next_to) = unsafe {
            (
                RawBuf::new(below, 128),
                RawBuf::new(below, 64 * 6 + 128),
                RawBuf::new(below, 64),
            )
        };
        assert!(plan(&r, layout, g, into, &s).is_err());
        assert!(plan(&r, layout, g, around, &s).is_err());
        // Ending where the region starts is no overlap.
        assert!(plan(&r, layout, g, next_to, &s).is_ok());
    }

    #[test]
    fn blocks_go_to_their_offset_in_chunks_of_another_size() {
        // 32-byte blocks at byte 16 of 64-byte chunks: the block stride is not the chunk's.
        let layout = ChunkLayout::new(4, 64).unwrap();
        let r = region(layout);
        let src: Vec<u8> = (1..=96).collect();
        let s = spec(32, 16, &[2, 0], &[1, 3]);
        let p = plan(&r, layout, Direction::Gather, RawBuf::from_slice(&src), &s).unwrap();
        assert_eq!(p.total_bytes(), 64);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        // SAFETY: `r` and `src` outlive the call.
        unsafe { p.execute(&pool, 1) };
        let mut want = vec![0u8; 4 * 64];
        want[64 + 16..64 + 48].copy_from_slice(&src[64..96]);
        want[3 * 64 + 16..3 * 64 + 48].copy_from_slice(&src[..32]);
        // SAFETY: the region is mapped and no transfer runs.
        let mem = unsafe { std::slice::from_raw_parts(r.as_ptr(), 4 * 64) };
        assert_eq!(mem, want.as_slice());
        // And back: chunk 3's block into buffer block 1, chunk 1's into block 2.
        let mut dst = vec![0u8; 96];
        let back = spec(32, 16, &[1, 2], &[3, 1]);
        let p = plan(
            &r,
            layout,
            Direction::Scatter,
            RawBuf::from_mut_slice(&mut dst),
            &back,
        );
        // SAFETY: `r` and `dst` outlive the call; nothing else touches them.
        unsafe { p.unwrap().execute(&pool, 1) };
        assert!(dst[..32].iter().all(|&b| b == 0));
        assert_eq!(&dst[32..64], &src[..32]);
        assert_eq!(&dst[64..], &src[64..]);
    }

    #[test]
    fn a_scatter_may_target_more_blocks_than_the_pool_has_chunks() {
        // 4 chunks, 200 buffer blocks: target block ids run past the number of chunks.
        let layout = ChunkLayout::new(4, 8).unwrap();
        let r = region(layout);
        let mut dst = vec![0u8; 200 * 8];
        let s = spec(8, 0, &[150, 199, 3, 70], &[0, 1, 2, 3]);
        let buf = RawBuf::from_mut_slice(&mut dst);
        assert!(plan(&r, layout, Direction::Scatter, buf, &s).is_ok());
        let dup = spec(8, 0, &[150, 199, 150], &[0, 1, 2]);
        let err = plan(&r, layout, Direction::Scatter, buf, &dup).unwrap_err();
        assert!(err.to_string().contains("block id 150"), "{err}");
    }
}
