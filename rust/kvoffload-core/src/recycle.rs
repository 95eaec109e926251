//! Vector buffers reused from call to call, per thread: a call takes the buffers of its key
//! lists, chunk ids and other per-call vectors here ([`take`]) and hands them back when done
//! ([`give`]), so a steady stream of calls allocates nothing for them.
//!
//! Buffers are kept by element layout (size and alignment), not by type: an empty `Vec<T>`'s
//! buffer serves any element type of the same size and alignment, which is what
//! `Vec::from_raw_parts` requires. Each thread keeps at most [`PER_CLASS`] buffers of each of
//! the [`CLASSES`] layouts, each of at most [`MAX_BYTES`]; any other buffer is freed as usual.
//! A thread's buffers are freed when it exits.

use std::alloc::Layout;
use std::cell::UnsafeCell;

/// Element layouts (size, alignment) whose buffers are kept; other element types simply
/// allocate.
const CLASSES: [(usize, usize); 9] = [
    (4, 4),
    (8, 4),
    (8, 8),
    (16, 8),
    (24, 8),
    (32, 8),
    (48, 8),
    (56, 8),
    (64, 8),
];
/// Buffers kept per layout: enough for the vectors one call holds at once (the manager's
/// per-call scratch lists included), so a store with eviction allocates none. A thread keeps
/// at most 16 x 9 x 64 KiB (9 MiB) this way, and a few KiB for batches of scheduler size.
const PER_CLASS: usize = 16;
/// The largest buffer kept (larger ones are freed: a rare huge call does not pin its memory).
pub const MAX_BYTES: usize = 64 * 1024;

/// One kept buffer: its allocation, and its capacity in elements of its class.
#[derive(Clone, Copy)]
struct Raw {
    ptr: *mut u8,
    cap: usize,
}

/// The buffers one thread keeps, by class: a stack each, `kept[class][..len[class]]`, the
/// last buffer given back on top.
struct Pool {
    kept: [[Raw; PER_CLASS]; CLASSES.len()],
    len: [usize; CLASSES.len()],
}

impl Drop for Pool {
    fn drop(&mut self) {
        for (class, (kept, &len)) in self.kept.iter().zip(&self.len).enumerate() {
            let (size, align) = CLASSES[class];
            for raw in &kept[..len] {
                // The layout the buffer was allocated with: `cap` elements of `size` bytes,
                // aligned to `align` (a `Vec` of such elements allocated it).
                if let Ok(layout) = Layout::from_size_align(raw.cap * size, align) {
                    // SAFETY: `raw.ptr` came from the global allocator with this layout (a
                    // non-empty `Vec`'s buffer) and is owned by the pool alone.
                    unsafe { std::alloc::dealloc(raw.ptr, layout) };
                }
            }
        }
    }
}

const NO_BUFFER: Raw = Raw {
    ptr: std::ptr::null_mut(),
    cap: 0,
};

thread_local! {
    static POOL: UnsafeCell<Pool> = const {
        UnsafeCell::new(Pool {
            kept: [[NO_BUFFER; PER_CLASS]; CLASSES.len()],
            len: [0; CLASSES.len()],
        })
    };
}

/// The class of element type `T`, if its buffers are kept.
const fn class_of<T>() -> Option<usize> {
    let (size, align) = (size_of::<T>(), align_of::<T>());
    let mut i = 0;
    while i < CLASSES.len() {
        if CLASSES[i].0 == size && CLASSES[i].1 == align {
            return Some(i);
        }
        i += 1;
    }
    None
}

/// An empty vector with room for at least `n` elements: the buffer of `T`'s layout this thread
/// gave back last (grown if too small), else a new one.
#[inline]
#[must_use]
pub fn take<T>(n: usize) -> Vec<T> {
    let mut v = class_of::<T>()
        .and_then(|class| {
            POOL.try_with(|pool| {
                // SAFETY: this thread's pool, referred to only here and in `give`, each of
                // which holds the reference for a few loads and stores that run no other code
                // (no allocation, no drop): no other reference to it exists meanwhile.
                let pool = unsafe { &mut *pool.get() };
                // The last buffer given back is the first taken (most likely in cache).
                let top = pool.len[class].checked_sub(1)?;
                pool.len[class] = top;
                let raw = pool.kept[class][top];
                // SAFETY: `raw` is the buffer of an empty `Vec` whose element type had `T`'s
                // size and alignment (its class), allocated by the global allocator for
                // exactly `raw.cap` such elements: the layout `Vec<T>` with capacity
                // `raw.cap` frees. The pool gave up ownership of it just above.
                Some(unsafe { Vec::from_raw_parts(raw.ptr.cast::<T>(), 0, raw.cap) })
            })
            .ok()
            .flatten()
        })
        .unwrap_or_default();
    v.reserve(n);
    v
}

/// Empty `v` (dropping its elements) and keep its buffer for a later [`take`] on this thread,
/// when its layout is kept, it is not too large and the thread keeps fewer than
/// [`PER_CLASS`] of its class; else free it.
#[inline]
pub fn give<T>(mut v: Vec<T>) {
    let Some(class) = class_of::<T>() else { return };
    // Elements first, outside the pool's borrow: dropping one may run code that calls here.
    v.clear();
    let cap = v.capacity();
    if cap == 0 || cap * size_of::<T>() > MAX_BYTES {
        return;
    }
    let mut v = std::mem::ManuallyDrop::new(v);
    let raw = Raw {
        ptr: v.as_mut_ptr().cast::<u8>(),
        cap,
    };
    let kept = POOL
        .try_with(|pool| {
            // SAFETY: as in `take`: the only reference to this thread's pool meanwhile.
            let pool = unsafe { &mut *pool.get() };
            let top = pool.len[class];
            if top == PER_CLASS {
                return false;
            }
            pool.kept[class][top] = raw;
            pool.len[class] = top + 1;
            true
        })
        .unwrap_or(false);
    if !kept {
        // SAFETY: not kept, so still ours: drop the (empty) vector as it was.
        unsafe { std::mem::ManuallyDrop::drop(&mut v) };
    }
}

/// A vector that hands its buffer back ([`give`]) when dropped.
pub struct Recycled<T>(Vec<T>);

impl<T> Recycled<T> {
    /// An empty vector with room for at least `n` elements ([`take`]).
    #[inline]
    #[must_use]
    pub fn with_capacity(n: usize) -> Self {
        Self(take(n))
    }

    /// The vector itself, no longer handed back when dropped (a caller that returns it hands
    /// it back, or lets it go, as with any vector from [`take`]).
    #[inline]
    #[must_use]
    pub fn into_vec(mut self) -> Vec<T> {
        std::mem::take(&mut self.0)
    }
}

impl<T> From<Vec<T>> for Recycled<T> {
    fn from(v: Vec<T>) -> Self {
        Self(v)
    }
}

impl<T> Drop for Recycled<T> {
    #[inline]
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

impl<T> std::ops::Deref for Recycled<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T> std::ops::DerefMut for Recycled<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

impl<T> FromIterator<T> for Recycled<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut v = Self::with_capacity(iter.size_hint().0);
        v.extend(iter);
        v
    }
}

impl<'a, T> IntoIterator for &'a Recycled<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    #[inline]
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<'a, T> IntoIterator for &'a mut Recycled<T> {
    type Item = &'a mut T;
    type IntoIter = std::slice::IterMut<'a, T>;
    #[inline]
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_across_types_of_one_layout() {
        let mut a: Vec<u64> = take(10);
        a.extend(0..10);
        let ptr = a.as_ptr() as usize;
        let cap = a.capacity();
        give(a);
        // Same layout, another type: the same buffer, empty.
        let b: Vec<usize> = take(5);
        assert_eq!((b.as_ptr() as usize, b.capacity(), b.len()), (ptr, cap, 0));
        give(b);
        // More room than kept: the buffer grows (and is then kept grown).
        let c: Vec<i64> = take(cap + 100);
        assert!(c.capacity() >= cap + 100 && c.is_empty());
        give(c);
    }

    #[test]
    fn the_managers_vectors_are_kept() {
        assert!(class_of::<crate::KeyBuf>().is_some());
        assert!(class_of::<Option<crate::ChunkId>>().is_some());
        assert!(class_of::<Option<i64>>().is_some());
        assert!(class_of::<&[u8]>().is_some());
        assert!(class_of::<crate::policy::FinishedKey<'_>>().is_some());
        let mut r: Recycled<u64> = (0..5).collect();
        r.push(5);
        let ptr = r.as_ptr() as usize;
        drop(r);
        let again: Vec<u64> = take(0);
        assert_eq!(again.as_ptr() as usize, ptr);
        give(again);
    }

    #[test]
    fn elements_are_dropped_when_given_back() {
        use std::rc::Rc;
        let x = Rc::new(());
        let mut v: Vec<Rc<()>> = take(4);
        v.extend((0..4).map(|_| Rc::clone(&x)));
        assert_eq!(Rc::strong_count(&x), 5);
        give(v);
        assert_eq!(Rc::strong_count(&x), 1);
    }

    #[test]
    fn at_most_per_class_buffers_are_kept_and_large_ones_are_freed() {
        // Several buffers at once (a call holding many vectors): all usable, and given back.
        let held: Vec<Vec<u32>> = (0..PER_CLASS + 3).map(|_| take::<u32>(8)).collect();
        let ptrs: std::collections::HashSet<usize> =
            held.iter().map(|v| v.as_ptr() as usize).collect();
        assert_eq!(ptrs.len(), PER_CLASS + 3);
        for v in held {
            give(v);
        }
        let again: Vec<Vec<u32>> = (0..PER_CLASS).map(|_| take::<u32>(1)).collect();
        assert!(again.iter().all(|v| v.capacity() >= 8 && v.is_empty()));
        for v in again {
            give(v);
        }
        let big: Vec<u8> = take(MAX_BYTES + 1);
        give(big); // u8 is not a kept layout; and too large anyway
        let big: Vec<u32> = take(MAX_BYTES / 4 + 1);
        let ptr = big.as_ptr() as usize;
        give(big);
        let next: Vec<u32> = take(1);
        assert_ne!(next.as_ptr() as usize, ptr);
        give(next);
    }

    #[test]
    fn the_last_buffer_given_back_is_taken_first_and_lists_iterate_as_vectors() {
        let (a, b): (Vec<u64>, Vec<u64>) = (take(4), take(4));
        let (pa, pb) = (a.as_ptr() as usize, b.as_ptr() as usize);
        give(a);
        give(b);
        let (first, second): (Vec<u64>, Vec<u64>) = (take(1), take(1));
        assert_eq!(
            (first.as_ptr() as usize, second.as_ptr() as usize),
            (pb, pa)
        );
        give(second);
        give(first);
        let mut r: Recycled<u64> = (1..=4).collect();
        for x in &mut r {
            *x *= 10;
        }
        assert_eq!((&r).into_iter().sum::<u64>(), 100);
        assert_eq!(r.as_slice(), [10, 20, 30, 40]);
    }

    #[test]
    fn other_layouts_and_other_threads_allocate() {
        let v: Vec<[u8; 3]> = take(2);
        assert!(v.capacity() >= 2);
        give(v);
        let mut a: Vec<u64> = take(3);
        a.push(1);
        give(a);
        std::thread::spawn(|| {
            let v: Vec<u64> = take(3);
            assert!(v.is_empty() && v.capacity() >= 3);
            give(v);
        })
        .join()
        .unwrap();
    }
}
