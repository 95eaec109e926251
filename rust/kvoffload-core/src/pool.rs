//! `ChunkPool`: which chunk slots of the host pool are free.
//!
//! An allocation first hands out the never-used ids that remain, ascending, then pops freed ids,
//! last-freed first. This is vLLM's order, so chunk ids match id for id.

use crate::error::{ensure, Result};

/// Index of one slot of the host pool, `0..num_chunks`.
pub type ChunkId = u32;

/// Free-slot bookkeeping for `num_chunks` slots.
#[derive(Debug, Clone)]
pub struct ChunkPool {
    num_chunks: u32,
    /// Ids `0..next_fresh` have been handed out at least once since the last reset.
    next_fresh: u32,
    /// Freed ids; the last element is handed out next.
    free: Vec<ChunkId>,
}

impl ChunkPool {
    /// A pool of `num_chunks` never-used slots.
    #[must_use]
    pub fn new(num_chunks: u32) -> Self {
        Self {
            num_chunks,
            next_fresh: 0,
            free: Vec::new(),
        }
    }

    /// Total number of slots.
    #[must_use]
    pub fn num_chunks(&self) -> u32 {
        self.num_chunks
    }

    /// Slots that an allocation can hand out now.
    #[must_use]
    pub fn num_free(&self) -> usize {
        self.free.len() + (self.num_chunks - self.next_fresh) as usize
    }

    /// Slots currently handed out (allocated and not freed).
    #[must_use]
    pub fn num_used(&self) -> usize {
        self.next_fresh as usize - self.free.len()
    }

    /// Hand out `n` slots into `out`: never-used ids ascending, then freed ids last-freed first.
    /// Returns `false` (and hands out nothing) if fewer than `n` slots are free.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<ChunkId>) -> bool {
        if n > self.num_free() {
            return false;
        }
        let fresh = n.min((self.num_chunks - self.next_fresh) as usize) as u32;
        out.extend(self.next_fresh..self.next_fresh + fresh);
        self.next_fresh += fresh;
        let reused = n - fresh as usize;
        let split = self.free.len() - reused;
        out.extend(self.free.drain(split..).rev());
        true
    }

    /// Take back the slots of the last [`allocate`](Self::allocate), which handed out `chunks`
    /// when `state().0` was `fresh_before`: the pool is as it was before that call.
    pub fn undo_allocate(&mut self, chunks: &[ChunkId], fresh_before: u32) {
        let fresh = (self.next_fresh - fresh_before) as usize;
        self.next_fresh = fresh_before;
        self.free.extend(chunks[fresh..].iter().rev());
    }

    /// Return a handed-out slot; it is the next one reused.
    pub fn free(&mut self, id: ChunkId) {
        debug_assert!(id < self.next_fresh, "freeing a never-used chunk {id}");
        self.free.push(id);
    }

    /// Forget every allocation: the next one starts at id 0 again.
    pub fn reset(&mut self) {
        self.next_fresh = 0;
        self.free.clear();
    }

    /// `(number of never-used ids handed out, free list with the next-popped id last)`.
    #[must_use]
    pub fn state(&self) -> (u32, &[ChunkId]) {
        (self.next_fresh, &self.free)
    }

    /// Check that the free list holds distinct ids that were handed out.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.next_fresh <= self.num_chunks,
            "pool: next fresh id past num_chunks"
        );
        let mut seen = vec![false; self.next_fresh as usize];
        for &id in &self.free {
            ensure!(
                id < self.next_fresh,
                "pool: free id {id} was never handed out"
            );
            ensure!(
                !seen[id as usize],
                "pool: id {id} is on the free list twice"
            );
            seen[id as usize] = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(p: &mut ChunkPool, n: usize) -> Vec<ChunkId> {
        let mut v = Vec::new();
        assert!(p.allocate(n, &mut v));
        p.validate().unwrap();
        v
    }

    #[test]
    fn fresh_ids_then_last_freed_first() {
        let mut p = ChunkPool::new(4);
        assert_eq!(alloc(&mut p, 3), vec![0, 1, 2]);
        p.free(0);
        p.free(1);
        // One never-used id (3) left: it comes first, then 1 (freed last), then 0.
        assert_eq!(alloc(&mut p, 3), vec![3, 1, 0]);
        assert_eq!(p.num_free(), 0);
        assert_eq!(p.num_used(), 4);
        p.validate().unwrap();
    }

    #[test]
    fn refuses_over_allocation_without_change() {
        let mut p = ChunkPool::new(2);
        let mut v = Vec::new();
        assert!(!p.allocate(3, &mut v));
        assert!(v.is_empty());
        assert_eq!(p.num_free(), 2);
        assert_eq!(alloc(&mut p, 2), vec![0, 1]);
    }

    #[test]
    fn reset_restarts_at_zero() {
        let mut p = ChunkPool::new(3);
        alloc(&mut p, 2);
        p.free(1);
        p.reset();
        assert_eq!(alloc(&mut p, 3), vec![0, 1, 2]);
    }

    #[test]
    fn validate_catches_double_free() {
        let mut p = ChunkPool::new(3);
        alloc(&mut p, 2);
        p.free.push(1);
        p.free.push(1);
        assert!(p.validate().is_err());
    }

    #[test]
    fn undo_allocate_restores_the_pool() {
        let mut p = ChunkPool::new(4);
        let a = alloc(&mut p, 3);
        p.free(a[0]);
        p.free(a[2]);
        let before = p.state().0;
        let snapshot = (p.state().0, p.state().1.to_vec());
        let b = alloc(&mut p, 3); // fresh 3, then 2 and 0, last freed first
        assert_eq!(b, vec![3, 2, 0]);
        p.undo_allocate(&b, before);
        assert_eq!((p.state().0, p.state().1.to_vec()), snapshot);
        assert_eq!(alloc(&mut p, 3), vec![3, 2, 0]);
        p.validate().unwrap();
    }
}
