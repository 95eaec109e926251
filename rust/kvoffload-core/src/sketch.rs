//! `FrequencySketch`: the `TinyLFU` admission filter (Einziger, Friedman and Manes, "`TinyLFU`: A
//! Highly Efficient Cache Admission Policy", ACM TOS 2017), an alternative to the bounded
//! [`AdmissionTracker`](crate::AdmissionTracker) behind `store_threshold`.
//!
//! A count-min sketch: four rows of saturating 4-bit counters (0 to 15, one byte each here),
//! `width` counters per row, a power of two. A key's estimate is the least of its four counters.
//! Each request counts a key at most once, whatever it offers (its request state remembers).
//! After `10 * width` counts the sketch *resets*: every counter is halved, so old popularity
//! fades (the paper's aging; its doorkeeper is left out). A reset waits for the start of the
//! next offer, so one offer always sees one sketch.
//!
//! An absent key is admitted when its estimate *before* the offer, plus one if this offer counts
//! it, reaches the threshold. Unlike the tracker, counting never forgets a key to make room, so
//! an offer with more keys than the tracker could hold still makes progress: `threshold`
//! requests offering the same keys get them stored (barring a reset in between).
//!
//! Rows are indexed by [`sketch_hash`], a hash that plain Python can compute too, so that the
//! reference manager's sketch is counter for counter the same.

use crate::error::{ensure, CoreError, Result};
use crate::mem::ZeroArray;

const ROWS: usize = 4;
/// Per-row seeds mixed into the key's hash.
const SEEDS: [u64; ROWS] = [
    0x9e37_79b9_7f4a_7c15,
    0xc2b2_ae3d_27d4_eb4f,
    0x1656_67b1_9e37_79f9,
    0x85eb_ca77_c2b2_ae63,
];
const MAX_COUNT: u8 = 15;
/// Counts between resets, per counter of a row.
const SAMPLES_PER_COUNTER: u64 = 10;
/// The most counters a row may have (`max_tracker_size` with `admission="tinylfu"`): a table of
/// 4 GiB, already far more than a pool of 2^31 chunks needs.
pub const MAX_WIDTH: usize = 1 << 30;

/// The splitmix64 finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The sketch's hash of a key: its length, then each 8-byte little-endian word (the last one
/// zero-padded), folded through splitmix64.
#[must_use]
pub fn sketch_hash(key: &[u8]) -> u64 {
    let mut h = mix(key.len() as u64);
    for word in key.chunks(8) {
        let mut buf = [0u8; 8];
        buf[..word.len()].copy_from_slice(word);
        h = mix(h ^ u64::from_le_bytes(buf));
    }
    h
}

/// A count-min sketch with aging; see the module docs.
pub struct FrequencySketch {
    threshold: u64,
    /// Anonymous memory: pages cost nothing until a count lands in them.
    table: ZeroArray<u8>,
    mask: usize,
    samples: u64,
    sample_size: u64,
}

impl std::fmt::Debug for FrequencySketch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrequencySketch")
            .field("threshold", &self.threshold)
            .field("width", &(self.mask + 1))
            .field("samples", &self.samples)
            .finish_non_exhaustive()
    }
}

impl FrequencySketch {
    /// A sketch of at least `width` counters per row (rounded up to a power of two, at least
    /// 16) admitting keys whose estimate reaches `threshold`.
    ///
    /// # Errors
    /// [`CoreError::InvalidArgument`] if `width` exceeds [`MAX_WIDTH`] or the table's memory
    /// cannot be mapped.
    pub fn new(threshold: u64, width: usize) -> Result<Self> {
        if width > MAX_WIDTH {
            return Err(CoreError::InvalidArgument(format!(
                "a TinyLFU sketch has at most 2**30 counters per row (max_tracker_size), got {width}"
            )));
        }
        let width = width.max(16).next_power_of_two();
        let table = ZeroArray::new(ROWS * width).ok_or_else(|| {
            CoreError::InvalidArgument(format!(
                "cannot map a TinyLFU sketch of {width} counters per row"
            ))
        })?;
        Ok(Self {
            threshold,
            table,
            mask: width - 1,
            samples: 0,
            sample_size: SAMPLES_PER_COUNTER * width as u64,
        })
    }

    fn slot(&self, hash: u64, row: usize) -> usize {
        row * (self.mask + 1) + (mix(hash ^ SEEDS[row]) as usize & self.mask)
    }

    /// The estimated count of the key hashing to `hash` ([`sketch_hash`]).
    #[must_use]
    pub fn estimate(&self, hash: u64) -> u8 {
        (0..ROWS)
            .map(|r| self.table[self.slot(hash, r)])
            .min()
            .unwrap_or(0)
    }

    /// Whether an absent key is admitted: its estimate, plus one if this offer counts it, reaches
    /// the threshold.
    #[must_use]
    pub fn would_admit(&self, hash: u64, counted_now: bool) -> bool {
        u64::from(self.estimate(hash)) + u64::from(counted_now) >= self.threshold
    }

    /// [`would_admit`](Self::would_admit) as it will be at the next offer, whose start may
    /// halve the counters first (a reset is due): the decision of an offer not yet counted.
    #[must_use]
    pub fn would_admit_next(&self, hash: u64, counted_now: bool) -> bool {
        let mut estimate = self.estimate(hash);
        if self.samples >= self.sample_size {
            estimate >>= 1; // halving every counter halves their minimum
        }
        u64::from(estimate) + u64::from(counted_now) >= self.threshold
    }

    /// Count one occurrence of the key hashing to `hash` (counters saturate at 15).
    pub fn increment(&mut self, hash: u64) {
        for r in 0..ROWS {
            let i = self.slot(hash, r);
            if self.table[i] < MAX_COUNT {
                self.table[i] += 1;
            }
        }
        self.samples += 1;
    }

    /// Halve every counter if enough counts have accumulated (called before each offer).
    pub fn age_if_due(&mut self) {
        if self.samples >= self.sample_size {
            for c in self.table.iter_mut() {
                *c >>= 1;
            }
            self.samples /= 2;
        }
    }

    /// Counts since the last reset (halved by each reset).
    #[must_use]
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Check the counters' range and the sample count.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.table.iter().all(|&c| c <= MAX_COUNT),
            "sketch: a counter above 15"
        );
        ensure!(
            self.samples <= 2 * self.sample_size,
            "sketch: the reset is overdue"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_fixed() {
        // The reference manager computes the same values in Python.
        assert_eq!(sketch_hash(b""), mix(0));
        assert_eq!(sketch_hash(b"abc"), mix(mix(3) ^ 0x63_6261));
        assert_eq!(sketch_hash(b"abc"), 0xfb3d_c2a0_42ba_372a); // tests/test_admission.py too
    }

    #[test]
    fn counts_saturate_estimates_are_minimal_and_resets_halve() {
        let mut s = FrequencySketch::new(3, 16).unwrap();
        let (a, b) = (sketch_hash(b"a"), sketch_hash(b"b"));
        assert!(!s.would_admit(a, true));
        s.increment(a);
        s.increment(a);
        assert!(s.would_admit(a, true) && !s.would_admit(a, false));
        assert!(s.estimate(b) <= s.estimate(a));
        for _ in 0..20 {
            s.increment(a);
        }
        assert_eq!(s.estimate(a), 15);
        for _ in 0..200 {
            s.increment(b);
        }
        s.age_if_due();
        assert_eq!(s.estimate(a), 7);
        s.validate().unwrap();
    }

    /// A reset falls due at exactly ten counts per counter of a row (the row's width rounded up
    /// to a power of two, at least 16), is foreseen by `would_admit_next` from that count on,
    /// and halves the sample count rather than zeroing it.
    #[test]
    fn resets_fall_due_at_ten_counts_per_counter_and_halve_the_sample_count() {
        let mut s = FrequencySketch::new(2, 16).unwrap();
        let (a, b) = (sketch_hash(b"a"), sketch_hash(b"b"));
        s.increment(a);
        s.increment(a);
        assert_eq!(s.estimate(a), 2);
        for _ in 0..157 {
            s.increment(b);
        }
        // 159 of 160 counts: no reset due, and the next offer sees a's 2 whole.
        assert!(s.would_admit_next(a, false));
        s.age_if_due();
        assert_eq!((s.estimate(a), s.samples()), (2, 159));
        s.increment(b);
        // 160: the next offer comes after the reset, which halves a's 2.
        assert!(!s.would_admit_next(a, false) && s.would_admit_next(a, true));
        s.age_if_due();
        assert_eq!((s.estimate(a), s.samples()), (1, 80));
        s.validate().unwrap();
        // Widths round up to a power of two, at least 16: 3 -> 16 (160 counts), 17 -> 32 (320).
        for (width, due) in [(3, 160), (17, 320)] {
            let mut t = FrequencySketch::new(2, width).unwrap();
            for _ in 0..due - 1 {
                t.increment(b);
            }
            t.age_if_due();
            assert_eq!(t.samples(), due - 1, "width {width}");
            t.increment(b);
            t.age_if_due();
            assert_eq!(t.samples(), due / 2, "width {width}");
        }
    }
}
