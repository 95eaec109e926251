//! `AdmissionTracker`: a bounded table from key to the number of times it was offered for
//! storing, oldest entry first. A key is admitted once its count reaches the threshold.
//!
//! Counting an offer takes two passes. Pass 1: every tracked key of the offer gets +1 (per
//! occurrence) and moves to the newest end. Pass 2: every key still untracked is added with
//! count 1 at the newest end; when the table is full the oldest entry is dropped first, but
//! never an entry that belongs to this offer. When only such entries are left, the key is not
//! tracked.

use crate::error::{ensure, Result};
use crate::key::{hash_key, key_buf, KeyBuf};
use hashbrown::HashTable;

const NIL: u32 = u32::MAX;

/// Offer counts of recently offered keys, at most `capacity` of them.
///
/// The entries sit in a slab, linked oldest to newest by index, and a table finds them by the
/// key's hash ([`hash_key`], which the manager has computed for the offer already): counting a
/// key hashes nothing and allocates nothing once the slab has grown.
#[derive(Debug, Clone)]
pub struct AdmissionTracker {
    /// Entry ids, by their keys' hashes.
    index: HashTable<u32>,
    /// The entries; the ids of dropped ones are reused ([`free`](Self::free)).
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// The oldest and the newest entry ([`NIL`]: none).
    head: u32,
    tail: u32,
    capacity: usize,
    threshold: u64,
    /// Sequence number of the offer being counted; an entry stamped with it is protected.
    offer: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    key: KeyBuf,
    hash: u64,
    count: u64,
    /// The last offer that counted this key.
    offer: u64,
    /// The next older and next newer entry.
    prev: u32,
    next: u32,
}

impl AdmissionTracker {
    /// A tracker admitting keys offered `threshold` times, holding at most `capacity` keys
    /// (entry ids are 32-bit: a larger bound is a bound of `u32::MAX - 1`, some 300 GB of
    /// entries).
    #[must_use]
    pub fn new(threshold: u64, capacity: usize) -> Self {
        let capacity = capacity.min(NIL as usize - 1);
        Self {
            index: HashTable::new(),
            entries: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
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
        self.index.len()
    }

    /// True when nothing is tracked.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Current count of `key` (0 when untracked).
    #[must_use]
    pub fn count(&self, key: &[u8]) -> u64 {
        self.find(key, hash_key(key))
            .map_or(0, |i| self.entries[i as usize].count)
    }

    /// Whether `key` (whose [`hash_key`] is `hash`), offered once more in an offer without
    /// repeats, would reach the threshold. A key first tracked by that offer has count 1, below
    /// any threshold >= 2.
    #[must_use]
    pub fn would_admit(&self, key: &[u8], hash: u64) -> bool {
        self.admits(self.find(key, hash))
    }

    /// The entry of `key` (whose [`hash_key`] is `hash`), if tracked: what
    /// [`record_distinct`](Self::record_distinct) takes.
    pub(crate) fn find(&self, key: &[u8], hash: u64) -> Option<u32> {
        self.index
            .find(hash, |&i| self.entries[i as usize].key.as_slice() == key)
            .copied()
    }

    /// [`would_admit`](Self::would_admit) for the key whose entry [`find`](Self::find) gave.
    pub(crate) fn admits(&self, found: Option<u32>) -> bool {
        found.is_some_and(|i| self.entries[i as usize].count.saturating_add(1) >= self.threshold)
    }

    /// [`record`](Self::record) for an offer of distinct keys, given each key's entry as
    /// [`find`](Self::find) gave it with nothing recorded since: no key is looked up again.
    pub(crate) fn record_distinct(
        &mut self,
        keys: &[&[u8]],
        hashes: &[u64],
        found: &[Option<u32>],
    ) {
        debug_assert!(keys.len() == hashes.len() && keys.len() == found.len());
        self.offer += 1;
        let offer = self.offer;
        let mut protected = 0usize;
        for &i in found.iter().flatten() {
            self.count_in(i, offer, &mut protected);
        }
        let mut unprotected = self.len().saturating_sub(protected);
        for ((key, &hash), f) in keys.iter().zip(hashes).zip(found) {
            if f.is_none() {
                self.add_within_bound(key, hash, offer, &mut unprotected);
            }
        }
    }

    /// Count one offer of `keys` (in offer order; `hashes` their [`hash_key`]s), as the module
    /// doc describes.
    pub fn record(&mut self, keys: &[&[u8]], hashes: &[u64]) {
        debug_assert_eq!(keys.len(), hashes.len());
        self.offer += 1;
        let offer = self.offer;
        let mut protected = 0usize;
        for (key, &hash) in keys.iter().zip(hashes) {
            if let Some(i) = self.find(key, hash) {
                self.count_in(i, offer, &mut protected);
            }
        }
        // Entries older than every protected one can be dropped; `unprotected` counts them.
        // Protected entries (counted above, or added below) all sit at the newest end, so
        // the oldest entry is unprotected while any unprotected entry is left.
        let mut unprotected = self.len().saturating_sub(protected);
        for (key, &hash) in keys.iter().zip(hashes) {
            if self.find(key, hash).is_none() {
                self.add_within_bound(key, hash, offer, &mut unprotected);
            }
        }
    }

    /// Pass 1 for tracked entry `i`: one more offer, to the newest end, protected.
    fn count_in(&mut self, i: u32, offer: u64, protected: &mut usize) {
        self.unlink(i);
        self.push_newest(i);
        let e = &mut self.entries[i as usize];
        e.count = e.count.saturating_add(1);
        if e.offer != offer {
            e.offer = offer;
            *protected += 1;
        }
    }

    /// Pass 2 for untracked `key`: tracked, newest, unless the table is full of protected
    /// entries; else first the oldest unprotected entry goes.
    fn add_within_bound(&mut self, key: &[u8], hash: u64, offer: u64, unprotected: &mut usize) {
        if self.len() >= self.capacity {
            if *unprotected == 0 {
                return;
            }
            self.drop_oldest();
            *unprotected -= 1;
        }
        self.add(key, hash, offer);
    }

    /// `(key, count)` pairs, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], u64)> {
        let mut at = self.head;
        std::iter::from_fn(move || {
            let e = self.entries.get(at as usize)?;
            at = e.next;
            Some((e.key.as_slice(), e.count))
        })
    }

    /// Check the bound, that every count is positive, and that the list, the table and the
    /// free ids agree.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.len() <= self.capacity,
            "tracker: {} entries over capacity {}",
            self.len(),
            self.capacity
        );
        let (mut listed, mut prev, mut at) = (0usize, NIL, self.head);
        while at != NIL {
            let e = self.entries.get(at as usize);
            ensure!(
                listed < self.entries.len() && e.is_some_and(|e| e.prev == prev),
                "tracker: the list is broken at entry {at}"
            );
            let e = &self.entries[at as usize];
            ensure!(e.count >= 1, "tracker: a zero count");
            ensure!(
                e.hash == hash_key(&e.key) && self.find(&e.key, e.hash) == Some(at),
                "tracker: entry {at} is not indexed under its key's hash"
            );
            listed += 1;
            prev = at;
            at = e.next;
        }
        ensure!(
            prev == self.tail && listed == self.len(),
            "tracker: {listed} entries listed, {} indexed",
            self.len()
        );
        ensure!(
            listed + self.free.len() == self.entries.len(),
            "tracker: {listed} listed and {} free of {} entries",
            self.free.len(),
            self.entries.len()
        );
        Ok(())
    }

    /// Take entry `i` out of the list.
    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let e = &self.entries[i as usize];
            (e.prev, e.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.entries[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.entries[n as usize].prev = prev,
        }
    }

    /// Put entry `i` (out of the list) at its newest end.
    fn push_newest(&mut self, i: u32) {
        let tail = self.tail;
        {
            let e = &mut self.entries[i as usize];
            e.prev = tail;
            e.next = NIL;
        }
        match tail {
            NIL => self.head = i,
            t => self.entries[t as usize].next = i,
        }
        self.tail = i;
    }

    /// Drop the oldest entry (there is one).
    fn drop_oldest(&mut self) {
        let i = self.head;
        let hash = self.entries[i as usize].hash;
        if let Ok(found) = self.index.find_entry(hash, |&j| j == i) {
            found.remove();
        }
        self.unlink(i);
        self.free.push(i);
    }

    /// Track `key` (untracked) with count 1, newest.
    fn add(&mut self, key: &[u8], hash: u64, offer: u64) {
        let entry = Entry {
            key: key_buf(key),
            hash,
            count: 1,
            offer,
            prev: NIL,
            next: NIL,
        };
        let i = if let Some(i) = self.free.pop() {
            self.entries[i as usize] = entry;
            i
        } else {
            self.entries.push(entry);
            (self.entries.len() - 1) as u32
        };
        self.push_newest(i);
        let entries = &self.entries;
        self.index
            .insert_unique(hash, i, |&j| entries[j as usize].hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(t: &mut AdmissionTracker, keys: &[&[u8]]) {
        let hashes: Vec<u64> = keys.iter().map(|k| hash_key(k)).collect();
        t.record(keys, &hashes);
        t.validate().unwrap();
    }

    fn admits(t: &AdmissionTracker, key: &[u8]) -> bool {
        t.would_admit(key, hash_key(key))
    }

    fn state(t: &AdmissionTracker) -> Vec<(Vec<u8>, u64)> {
        t.entries().map(|(k, c)| (k.to_vec(), c)).collect()
    }

    #[test]
    fn counts_and_ages() {
        let mut t = AdmissionTracker::new(2, 3);
        rec(&mut t, &[b"1", b"2"]);
        assert!(admits(&t, b"1"));
        assert!(!admits(&t, b"3"));
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
    fn counting_distinct_keys_by_their_entries_is_counting_them() {
        // record_distinct (entries looked up beforehand) against record, over offers of
        // distinct keys drawn from 12, into trackers of 1 to 6 entries.
        let names: Vec<Vec<u8>> = (0..12u8).map(|i| vec![b'k', i]).collect();
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) as usize
        };
        for capacity in 1..=6 {
            let (mut a, mut b) = (
                AdmissionTracker::new(2, capacity),
                AdmissionTracker::new(2, capacity),
            );
            for _ in 0..200 {
                let mut offer: Vec<&[u8]> = Vec::new();
                for _ in 0..next() % 5 {
                    let k = names[next() % names.len()].as_slice();
                    if !offer.contains(&k) {
                        offer.push(k);
                    }
                }
                let hashes: Vec<u64> = offer.iter().map(|k| hash_key(k)).collect();
                let found: Vec<Option<u32>> = offer
                    .iter()
                    .zip(&hashes)
                    .map(|(k, &h)| b.find(k, h))
                    .collect();
                for (k, f) in offer.iter().zip(&found) {
                    assert_eq!(b.admits(*f), admits(&a, k));
                }
                a.record(&offer, &hashes);
                b.record_distinct(&offer, &hashes, &found);
                a.validate().unwrap();
                b.validate().unwrap();
                assert_eq!(state(&a), state(&b), "capacity {capacity}");
            }
        }
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
