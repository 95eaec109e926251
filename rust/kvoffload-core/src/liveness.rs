//! `PendingWrites`: the pending stores (ref count -1, between `prepare_store` and
//! `complete_store`) in the order they started, with their start times, so that the oldest one
//! is found and overdue ones are expired in O(1) amortised per write.
//!
//! A FIFO with lazy deletion. Completing or failing a store never touches the queue: an entry is
//! live while its chunk is pending with the sequence number the chunk's slot had when the write
//! started (the table changes a slot's number whenever its key changes, so a later write to the
//! same chunk has another number, and nothing per chunk is kept here). Dead entries are dropped
//! when they reach the front; when a batch of writes would bring the queue
//! to `2 * pending + SLACK` entries, the dead ones at the front go, and if that is not enough the
//! whole queue is compacted (removing at least half of what it reads: amortised O(1) per write). So it never holds more than twice the chunks in
//! use, plus `SLACK`.
//!
//! Times are seconds on a monotonic clock: readings the caller gives (`set_now`), or, with a
//! clock source set, [`monotonic_seconds`] read once per batch of writes (so a call that starts
//! no write reads no clock). The clock only moves forward: a reading below the latest one counts
//! as the latest one (as does a reading below 0 at the start), so start times never decrease
//! along the queue and the front is the oldest live write.

use crate::error::{ensure, Result};
use crate::pool::ChunkId;
use crate::table::Slots;
use std::sync::OnceLock;
use std::time::Instant;

/// Dead entries tolerated beyond the live ones before a compaction.
const SLACK: usize = 64;

#[derive(Debug, Clone, Copy)]
struct Entry {
    start: f64,
    chunk: ChunkId,
    /// The slot's sequence number when the write started ([`Slots::pending_seq`]).
    seq: u32,
}

/// Seconds since the first call in this process, on `std::time::Instant` (monotonic).
#[must_use]
pub fn monotonic_seconds() -> f64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// A first-in first-out queue on one vector: entries leave the front by moving a start index,
/// and the vector drops its left part once that is at least half of it (moving no more entries
/// than have left: amortised O(1)). Adding is a plain vector push, without a ring's index
/// arithmetic (it measured 24 instructions a write in `VecDeque`).
#[derive(Debug, Clone, Default)]
struct Fifo {
    items: Vec<Entry>,
    /// The front's index in `items`.
    head: usize,
}

impl Fifo {
    fn len(&self) -> usize {
        self.items.len() - self.head
    }

    fn front(&self) -> Option<&Entry> {
        self.items.get(self.head)
    }

    fn pop_front(&mut self) {
        if self.head < self.items.len() {
            self.head += 1;
            if self.head == self.items.len() {
                self.clear();
            }
        }
    }

    fn iter(&self) -> std::slice::Iter<'_, Entry> {
        self.items[self.head..].iter()
    }

    /// Drop the entries that left, if they are at least half of the vector.
    fn reclaim(&mut self) {
        if self.head > 0 && 2 * self.head >= self.items.len() {
            self.items.drain(..self.head);
            self.head = 0;
        }
    }

    fn extend(&mut self, entries: impl Iterator<Item = Entry>) {
        self.reclaim();
        self.items.extend(entries);
    }

    fn retain(&mut self, keep: impl FnMut(&Entry) -> bool) {
        self.items.drain(..self.head);
        self.head = 0;
        self.items.retain(keep);
    }

    fn clear(&mut self) {
        self.items.clear();
        self.head = 0;
    }
}

/// Start times of the pending writes, oldest first. See the module docs.
#[derive(Debug, Clone, Default)]
pub struct PendingWrites {
    /// Read when writes start; `None`: only `set_now` moves the clock.
    source: Option<fn() -> f64>,
    queue: Fifo,
    /// The latest clock reading, in seconds.
    now: f64,
    /// Writes expired since the last `take_expired`.
    expired: u64,
}

impl PendingWrites {
    /// No pending writes; the clock at 0.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Read `source` whenever writes start (`None`: only `set_now` moves the clock).
    pub fn set_source(&mut self, source: Option<fn() -> f64>) {
        self.source = source;
    }

    /// Move the clock to `now` if that is later (an earlier or NaN reading changes nothing).
    pub fn set_now(&mut self, now: f64) {
        if now > self.now {
            self.now = now;
        }
    }

    /// The latest clock reading.
    #[must_use]
    pub fn now(&self) -> f64 {
        self.now
    }

    /// The writes to `chunks` started now (they are pending in `refs` already).
    ///
    /// A dead entry passes for live only if its slot's sequence number has come round to the
    /// same value while the entry waits: 2^31 writes to that one chunk, each adding an entry,
    /// when a queue of more than `2 * pending + SLACK` entries is compacted.
    pub fn started(&mut self, chunks: &[ChunkId], refs: &Slots) {
        if let (Some(source), false) = (self.source, chunks.is_empty()) {
            self.set_now(source());
        }
        let bound = 2 * refs.num_pending() + SLACK;
        if self.queue.len() + chunks.len() >= bound {
            // Writes mostly end in the order they started: the dead ones are at the front.
            self.prune_front(refs);
            if self.queue.len() + chunks.len() >= bound {
                self.compact(refs);
            }
        }
        let start = self.now;
        self.queue.extend(chunks.iter().filter_map(|&c| {
            let seq = refs.pending_seq(c);
            debug_assert!(
                seq.is_some(),
                "a write started at chunk {c}, which is not pending"
            );
            seq.map(|seq| Entry {
                start,
                chunk: c,
                seq,
            })
        }));
    }

    /// Whether `e` is the write in flight at its chunk (the chunk is pending since it).
    fn is_live(e: &Entry, refs: &Slots) -> bool {
        refs.pending_seq(e.chunk) == Some(e.seq)
    }

    /// Drop every dead entry.
    fn compact(&mut self, refs: &Slots) {
        self.queue.retain(|e| Self::is_live(e, refs));
    }

    /// Drop dead entries at the front; the front (if any) is then the oldest live write.
    fn prune_front(&mut self, refs: &Slots) {
        while let Some(e) = self.queue.front() {
            if Self::is_live(e, refs) {
                break;
            }
            self.queue.pop_front();
        }
    }

    /// `(start time, chunk)` of the oldest pending write.
    pub fn oldest(&mut self, refs: &Slots) -> Option<(f64, ChunkId)> {
        self.prune_front(refs);
        self.queue.front().map(|e| (e.start, e.chunk))
    }

    /// Take the pending writes older than `timeout` seconds now (`now - start > timeout`),
    /// oldest first, and count them as expired. The caller ends them (they are still pending).
    pub fn take_overdue(&mut self, timeout: f64, refs: &Slots) -> Vec<ChunkId> {
        let mut overdue = Vec::new();
        loop {
            self.prune_front(refs);
            match self.queue.front() {
                Some(e) if self.now - e.start > timeout => {
                    overdue.push(e.chunk);
                    self.queue.pop_front();
                }
                _ => break,
            }
        }
        self.expired += overdue.len() as u64;
        overdue
    }

    /// Writes expired since the last call; the count restarts.
    pub fn take_expired(&mut self) -> u64 {
        std::mem::take(&mut self.expired)
    }

    /// Forget every write (the cache was reset); the clock and the expired count stay.
    pub fn clear(&mut self) {
        self.queue.clear();
    }

    /// Entries held, live and dead.
    #[must_use]
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Every pending chunk of `refs` has exactly one live entry, start times never decrease,
    /// none is later than the clock, and the queue is within its bound (twice the slots in use,
    /// plus `SLACK`).
    pub fn validate(&self, refs: &Slots) -> Result<()> {
        let mut live = 0;
        let mut last = f64::NEG_INFINITY;
        for e in self.queue.iter() {
            ensure!(
                e.start >= last && e.start <= self.now,
                "liveness: start {} out of order (previous {last}, now {})",
                e.start,
                self.now
            );
            last = e.start;
            live += usize::from(Self::is_live(e, refs));
        }
        ensure!(
            live == refs.num_pending(),
            "liveness: {live} live entries for {} pending chunks",
            refs.num_pending()
        );
        ensure!(
            self.queue.len() <= 2 * refs.used() + SLACK,
            "liveness: {} entries for {} slots in use",
            self.queue.len(),
            refs.used()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(n: u32) -> Slots {
        let mut refs = Slots::new(n).unwrap();
        refs.grow(n as usize);
        refs
    }

    fn start(w: &mut PendingWrites, refs: &mut Slots, c: ChunkId) {
        crate::key::test_util::pend(refs, c);
        w.started(&[c], refs);
    }

    #[test]
    fn oldest_is_the_first_still_pending() {
        let mut refs = table(4);
        let mut w = PendingWrites::new();
        assert_eq!(w.oldest(&refs), None);
        w.set_now(1.0);
        start(&mut w, &mut refs, 0);
        w.set_now(2.0);
        start(&mut w, &mut refs, 1);
        start(&mut w, &mut refs, 2);
        assert_eq!(w.oldest(&refs), Some((1.0, 0)));
        refs.complete_store(0);
        assert_eq!(w.oldest(&refs), Some((2.0, 1)));
        refs.remove(1);
        assert_eq!(w.oldest(&refs), Some((2.0, 2)));
        w.validate(&refs).unwrap();
        refs.complete_store(2);
        assert_eq!(w.oldest(&refs), None);
        assert_eq!(w.queued(), 0);
    }

    #[test]
    fn a_chunk_written_again_counts_from_its_new_start() {
        let mut refs = table(2);
        let mut w = PendingWrites::new();
        start(&mut w, &mut refs, 0);
        refs.remove(0); // the write failed; chunk 0 is reused later
        w.set_now(5.0);
        start(&mut w, &mut refs, 1);
        start(&mut w, &mut refs, 0);
        assert_eq!(w.oldest(&refs), Some((5.0, 1)));
        w.set_now(9.0);
        assert_eq!(w.take_overdue(3.0, &refs), vec![1, 0]);
        w.validate(&refs).unwrap_err(); // still pending in `refs`: the caller ends them
    }

    #[test]
    fn overdue_is_strictly_older_than_the_timeout() {
        let mut refs = table(3);
        let mut w = PendingWrites::new();
        for (c, t) in [(0, 1.0), (1, 2.0), (2, 3.0)] {
            w.set_now(t);
            start(&mut w, &mut refs, c);
        }
        w.set_now(4.0);
        let overdue = w.take_overdue(2.0, &refs);
        assert_eq!(overdue, vec![0]); // age 3; chunk 1's age is exactly 2
        for c in overdue {
            refs.remove(c);
        }
        w.validate(&refs).unwrap();
        assert_eq!(w.take_expired(), 1);
        assert_eq!(w.take_expired(), 0);
        assert_eq!(w.oldest(&refs), Some((2.0, 1)));
    }

    #[test]
    #[allow(clippy::float_cmp)] // the readings are set, not computed: equal to the bit
    fn the_clock_never_runs_backwards() {
        let mut w = PendingWrites::new();
        w.set_now(-1.0);
        assert_eq!(w.now(), 0.0);
        w.set_now(3.0);
        w.set_now(2.0);
        w.set_now(f64::NAN);
        assert_eq!(w.now(), 3.0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "too slow under Miri (over 4 minutes)")]
    fn dead_entries_stay_bounded_behind_a_stuck_write() {
        let mut refs = table(2);
        let mut w = PendingWrites::new();
        start(&mut w, &mut refs, 0); // never completes
        for i in 0..10_000 {
            start(&mut w, &mut refs, 1);
            if i % 2 == 0 {
                refs.complete_store(1);
                refs.remove(1);
            } else {
                refs.remove(1);
            }
            assert!(w.queued() <= 2 * 2 + SLACK);
            w.validate(&refs).unwrap();
        }
        assert_eq!(w.oldest(&refs), Some((0.0, 0)));
    }

    #[test]
    fn a_clock_source_is_read_when_writes_start() {
        fn ten() -> f64 {
            10.0
        }
        let mut refs = table(2);
        let mut w = PendingWrites::new();
        w.set_source(Some(ten));
        w.started(&[], &refs);
        assert!(w.now() < 10.0); // no write, no reading
        start(&mut w, &mut refs, 0);
        assert_eq!(w.oldest(&refs), Some((10.0, 0)));
        let t = monotonic_seconds();
        assert!(t >= 0.0 && monotonic_seconds() >= t);
    }

    /// A chunk written again and again: only its latest write is live, whichever way the
    /// earlier ones ended, and the dead entries never pass for it.
    #[test]
    fn only_a_chunks_latest_write_is_live() {
        let mut refs = table(2);
        let mut w = PendingWrites::new();
        for round in 0..50 {
            w.set_now(f64::from(round));
            start(&mut w, &mut refs, 0);
            if round % 3 == 0 {
                refs.complete_store(0);
                refs.remove(0);
            } else {
                refs.remove(0);
            }
        }
        w.set_now(100.0);
        start(&mut w, &mut refs, 0);
        assert_eq!(w.oldest(&refs), Some((100.0, 0)));
        w.validate(&refs).unwrap();
        assert_eq!(w.take_overdue(-1.0, &refs), vec![0]);
        assert_eq!(w.oldest(&refs), None);
    }

    #[test]
    fn clear_forgets_every_write() {
        let mut refs = table(2);
        let mut w = PendingWrites::new();
        start(&mut w, &mut refs, 0);
        start(&mut w, &mut refs, 1);
        refs.clear();
        refs.grow(2);
        w.clear();
        assert_eq!(w.oldest(&refs), None);
        w.validate(&refs).unwrap();
        start(&mut w, &mut refs, 0);
        assert_eq!(w.oldest(&refs), Some((0.0, 0)));
    }

    /// The front leaves (the oldest write ended), then a write starts: the entries that left
    /// are dropped from the vector, and the queue still starts at the oldest live write.
    #[test]
    fn a_write_started_after_the_front_left_keeps_the_oldest() {
        let mut refs = table(3);
        let mut w = PendingWrites::new();
        w.set_now(1.0);
        start(&mut w, &mut refs, 0);
        w.set_now(2.0);
        start(&mut w, &mut refs, 1);
        refs.complete_store(0);
        assert_eq!(w.oldest(&refs), Some((2.0, 1)));
        w.set_now(3.0);
        start(&mut w, &mut refs, 2);
        assert_eq!(w.queued(), 2);
        w.validate(&refs).unwrap();
        assert_eq!(w.oldest(&refs), Some((2.0, 1)));
        refs.complete_store(1);
        assert_eq!(w.oldest(&refs), Some((3.0, 2)));
        w.set_now(10.0);
        assert_eq!(w.take_overdue(5.0, &refs), vec![2]);
    }

    /// As `dead_entries_stay_bounded_behind_a_stuck_write`, with an ended write ahead of the
    /// stuck one: the compactions happen after the front has left.
    #[test]
    fn compacting_after_the_front_left_keeps_every_live_write() {
        let mut refs = table(3);
        let mut w = PendingWrites::new();
        start(&mut w, &mut refs, 1);
        refs.complete_store(1); // ends first: left at the front of the queue
        w.set_now(1.0);
        start(&mut w, &mut refs, 0); // never completes
        for i in 0..500 {
            w.set_now(f64::from(i) + 2.0);
            start(&mut w, &mut refs, 2);
            refs.remove(2);
            assert!(w.queued() <= 2 * 3 + SLACK);
            w.validate(&refs).unwrap();
        }
        assert_eq!(w.oldest(&refs), Some((1.0, 0)));
    }
}
