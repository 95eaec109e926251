//! `AdmissionTracker`: a bounded table from key to the number of times it was offered for
//! storing, oldest entry first. A key is admitted once its count reaches the threshold.
//!
//! Counting an offer takes two passes. Pass 1: every tracked key of the offer gets +1 (per
//! occurrence) and moves to the newest end. Pass 2: every key still untracked is added with
//! count 1 at the newest end; when the table is full the oldest entry is dropped first, but
//! never an entry that belongs to this offer. When only such entries are left, the key is not
//! tracked.

use crate::error::{ensure, Result};
use crate::key::{key_buf, KeyBuf, KeyHasher};
use hashlink::LinkedHashMap;

/// Offer counts of recently offered keys, at most `capacity` of them.
#[derive(Debug, Clone)]
pub struct AdmissionTracker {
    counts: LinkedHashMap<KeyBuf, Entry, KeyHasher>,
    capacity: usize,
    threshold: u64,
    /// Sequence number of the offer being counted; an entry stamped with it is protected.
    offer: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    count: u64,
    /// The last offer that counted this key.
    offer: u64,
}

impl AdmissionTracker {
    /// A tracker admitting keys offered `threshold` times, holding at most `capacity` keys.
    #[must_use]
    pub fn new(threshold: u64, capacity: usize) -> Self {
        Self {
            counts: LinkedHashMap::with_hasher(KeyHasher),
            capacity,
            threshold,
            offer: 0,
        }
    }

    /// The admission threshold.
    #[must_use]
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Number of tracked keys.
    #[must_use]
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// True when nothing is tracked.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Current count of `key` (0 when untracked).
    #[must_use]
    pub fn count(&self, key: &[u8]) -> u64 {
        self.counts.get(key).map_or(0, |e| e.count)
    }

    /// Whether a key offered once more (in an offer without repeats) would reach the
    /// threshold. A key first tracked by that offer has count 1, below any threshold >= 2.
    #[must_use]
    pub fn would_admit(&self, key: &[u8]) -> bool {
        self.counts
            .get(key)
            .is_some_and(|e| e.count.saturating_add(1) >= self.threshold)
    }

    /// Count one offer of `keys` (in offer order), as the module doc describes.
    pub fn record<'k>(&mut self, keys: impl Iterator<Item = &'k [u8]> + Clone) {
        self.offer += 1;
        let offer = self.offer;
        let mut protected = 0usize;
        for key in keys.clone() {
            if let Some(e) = self.counts.to_back(key) {
                e.count = e.count.saturating_add(1);
                if e.offer != offer {
                    e.offer = offer;
                    protected += 1;
                }
            }
        }
        // Entries older than every protected one can be dropped; `unprotected` counts them.
        // Protected entries (counted above, or added below) all sit at the newest end, so
        // the oldest entry is unprotected while any unprotected entry is left.
        let mut unprotected = self.counts.len().saturating_sub(protected);
        for key in keys {
            if self.counts.contains_key(key) {
                continue;
            }
            if self.counts.len() >= self.capacity {
                if unprotected == 0 {
                    continue;
                }
                self.counts.pop_front();
                unprotected -= 1;
            }
            self.counts.insert(key_buf(key), Entry { count: 1, offer });
        }
    }

    /// `(key, count)` pairs, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], u64)> {
        self.counts.iter().map(|(k, e)| (k.as_slice(), e.count))
    }

    /// Check the bound and that every count is positive.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.counts.len() <= self.capacity,
            "tracker: {} entries over capacity {}",
            self.counts.len(),
            self.capacity
        );
        ensure!(
            self.counts.values().all(|e| e.count >= 1),
            "tracker: a zero count"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(t: &mut AdmissionTracker, keys: &[&[u8]]) {
        t.record(keys.iter().copied());
        t.validate().unwrap();
    }

    fn state(t: &AdmissionTracker) -> Vec<(Vec<u8>, u64)> {
        t.entries().map(|(k, c)| (k.to_vec(), c)).collect()
    }

    #[test]
    fn counts_and_ages() {
        let mut t = AdmissionTracker::new(2, 3);
        rec(&mut t, &[b"1", b"2"]);
        assert!(t.would_admit(b"1"));
        assert!(!t.would_admit(b"3"));
        rec(&mut t, &[b"3", b"4"]);
        // 4 pushed out the oldest (1).
        assert_eq!(
            state(&t),
            vec![(b"2".to_vec(), 1), (b"3".to_vec(), 1), (b"4".to_vec(), 1)]
        );
        rec(&mut t, &[b"1"]);
        assert_eq!(t.count(b"1"), 1);
        assert_eq!(t.count(b"2"), 0);
    }

    #[test]
    fn offer_members_are_protected() {
        let mut t = AdmissionTracker::new(2, 2);
        rec(&mut t, &[b"a", b"b"]);
        // a and b are counted in pass 1 and protected: c cannot displace them.
        rec(&mut t, &[b"a", b"b", b"c"]);
        assert_eq!(state(&t), vec![(b"a".to_vec(), 2), (b"b".to_vec(), 2)]);
        // Keys added in pass 2 are protected too.
        let mut t = AdmissionTracker::new(2, 2);
        rec(&mut t, &[b"x", b"y", b"z"]);
        assert_eq!(state(&t), vec![(b"x".to_vec(), 1), (b"y".to_vec(), 1)]);
    }

    #[test]
    fn pass_one_reorders_before_pass_two_drops() {
        let mut t = AdmissionTracker::new(2, 3);
        rec(&mut t, &[b"a", b"b", b"c"]);
        // b moves to the newest end; d then displaces the oldest unprotected entry (a).
        rec(&mut t, &[b"d", b"b"]);
        assert_eq!(
            state(&t),
            vec![(b"c".to_vec(), 1), (b"b".to_vec(), 2), (b"d".to_vec(), 1)]
        );
    }

    #[test]
    fn repeated_occurrences_count_each() {
        let mut t = AdmissionTracker::new(3, 4);
        rec(&mut t, &[b"a"]);
        rec(&mut t, &[b"a", b"a"]);
        assert_eq!(t.count(b"a"), 3);
        // A repeated key is one protected entry, not two: with capacity 2 and entries
        // [a, b], offering [a, a, c] may still drop b.
        let mut t = AdmissionTracker::new(2, 2);
        rec(&mut t, &[b"b", b"a"]);
        rec(&mut t, &[b"a", b"a", b"c"]);
        assert_eq!(state(&t), vec![(b"a".to_vec(), 3), (b"c".to_vec(), 1)]);
    }
}
