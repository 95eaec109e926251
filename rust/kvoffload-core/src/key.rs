//! Keys: owned key bytes stored inline when short, one fixed hasher, and the KV-group index.

use smallvec::SmallVec;
use std::hash::{BuildHasher, Hasher};

/// Owned key bytes. A 32-byte hash plus the 4-byte group index fits inline (no allocation).
pub type KeyBuf = SmallVec<[u8; INLINE_BYTES]>;

/// Key bytes held inline by a [`KeyBuf`] and by a request's seen keys (a 32-byte hash plus a
/// 4-byte group index fits).
pub const INLINE_BYTES: usize = 40;

/// Copy `key` into `dst`, whose bytes after the key's end must be zero; `false` (nothing
/// written) when it is longer. A key of 33-40 bytes (vLLM's are 36) is copied as its first 32
/// and last 8 bytes, two fixed-size copies, instead of by a `memcpy` call of its length.
/// Writing straight into the entry that keeps the key matters: an array built on the stack
/// and then copied is read back across the smaller writes that made it, and such a read
/// waits for them to reach the cache (a store-forwarding stall, several per key).
#[inline]
pub fn copy_inline(dst: &mut [u8; INLINE_BYTES], key: &[u8]) -> bool {
    let n = key.len();
    if n > INLINE_BYTES {
        return false;
    }
    if let (Some(head), Some(tail)) = (key.first_chunk::<32>(), key.last_chunk::<8>()) {
        dst[..32].copy_from_slice(head);
        dst[n - 8..n].copy_from_slice(tail);
    } else {
        dst[..n].copy_from_slice(key);
    }
    true
}

/// `key` as a [`KeyBuf`] (inline up to [`INLINE_BYTES`] bytes, through [`copy_inline`]).
#[inline]
#[must_use]
pub fn key_buf(key: &[u8]) -> KeyBuf {
    let mut buf = [0u8; INLINE_BYTES];
    if copy_inline(&mut buf, key) {
        KeyBuf::from_buf_and_len(buf, key.len())
    } else {
        KeyBuf::from_slice(key)
    }
}

/// The hasher of the crate's hash maps keyed by key bytes ([`KeyBuf`]) or by numbers. A byte
/// string hashes to exactly [`hash_key`] of it, so a map may be probed with a hash computed
/// once per call (`from_key_hashed_nocheck`). Keys are block hashes already, so a fast
/// non-cryptographic hash with a fixed seed is enough and keeps runs reproducible.
#[derive(Clone, Copy, Default, Debug)]
pub struct KeyHasher;

impl BuildHasher for KeyHasher {
    type Hasher = KeyState;

    fn build_hasher(&self) -> KeyState {
        KeyState(0)
    }
}

/// The state of [`KeyHasher`]: byte strings enter through [`hash_key`], numbers through one
/// multiply each. A `usize` write is taken for a slice's length prefix and skipped, so this is
/// no hasher for maps keyed by `usize` (the crate keys its maps by key bytes and `u64`).
#[derive(Clone, Copy, Debug)]
pub struct KeyState(u64);

impl Hasher for KeyState {
    fn write(&mut self, bytes: &[u8]) {
        // A lone byte string (the keys' case) hashes to `hash_key(bytes)`.
        let h = hash_key(bytes);
        self.0 = if self.0 == 0 { h } else { fold(self.0 ^ h, M1) };
    }

    fn write_u64(&mut self, i: u64) {
        self.0 = fold(self.0 ^ i ^ SEED, M1);
    }

    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }

    /// A slice's length prefix: skipped, since [`hash_key`] counts the length itself.
    fn write_usize(&mut self, _len: usize) {}

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Seeds of [`hash_key`]: fixed (runs are reproducible) and odd, so no multiplier is zero.
const SEED: u64 = 0x6b76_6f66_666c_6f61;
const M0: u64 = 0x243f_6a88_85a3_08d3;
const M1: u64 = 0x1319_8a2e_0370_7345;
const M2: u64 = 0xa409_3822_299f_31d1;

/// The 128-bit product of `x` and `y`, its halves xor-ed: every input bit reaches the middle
/// output bits, the mixing step of foldhash and wyhash.
#[inline]
fn fold(x: u64, y: u64) -> u64 {
    let p = u128::from(x) * u128::from(y);
    (p as u64) ^ ((p >> 64) as u64)
}

/// The 8 bytes of `b` at `at` as a little-endian word (`at + 8 <= b.len()`).
#[inline]
fn word(b: &[u8], at: usize) -> u64 {
    let mut w = [0; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// The 4 bytes of `b` at `at` as a little-endian word (`at + 4 <= b.len()`).
#[inline]
fn half(b: &[u8], at: usize) -> u64 {
    let mut w = [0; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u64::from(u32::from_le_bytes(w))
}

/// Hash of a key's bytes, as used by every `HashTable` in the crate.
///
/// Keys are block hashes plus a group index (36 bytes in vLLM), so what matters is the cost per
/// call: whole words read (the last one overlapping, as foldhash does), two words per multiply,
/// and no `Hasher` state or length-prefix write. 36 bytes take four multiplies. The length is
/// folded in at the end, so keys that share their bytes but not their length differ. Measured
/// with callgrind on one `lookup`: 196 instructions, against 233 with foldhash's `FoldHasher`
/// given the bytes alone and 239 through `BuildHasher::hash_one` (length prefix included).
#[inline]
#[must_use]
pub fn hash_key(key: &[u8]) -> u64 {
    let len = key.len();
    let (mut a, mut b) = (SEED, M0);
    if len <= 16 {
        if len >= 8 {
            a ^= word(key, 0);
            b ^= word(key, len - 8);
        } else if len >= 4 {
            a ^= half(key, 0);
            b ^= half(key, len - 4);
        } else if len > 0 {
            a ^= u64::from(key[0]);
            b ^= u64::from(key[len - 1]) << 8 | u64::from(key[len / 2]);
        }
    } else if len > 32 && len <= 48 {
        // vLLM's keys (36 bytes): the loop below, unrolled (its two rounds, then the tail).
        a = fold(word(key, 0) ^ a, word(key, 8) ^ M1);
        a = fold(word(key, 16) ^ a, word(key, 24) ^ M1);
        a ^= word(key, len - 16);
        b ^= word(key, len - 8);
    } else {
        (a, b) = mix_long(key, a, b);
    }
    fold(fold(a, b) ^ len as u64, M2)
}

/// [`hash_key`]'s mixing of a key of more than 16 bytes into `(a, b)`: 16 bytes a multiply,
/// then the last 16 bytes (overlapping what the loop read).
#[inline]
fn mix_long(key: &[u8], mut a: u64, mut b: u64) -> (u64, u64) {
    let len = key.len();
    let mut at = 0;
    while len - at > 16 {
        a = fold(word(key, at) ^ a, word(key, at + 8) ^ M1);
        at += 16;
    }
    a ^= word(key, len - 16);
    b ^= word(key, len - 8);
    (a, b)
}

/// The KV-group index of a key: its last (up to) 4 bytes read as a big-endian unsigned int.
#[must_use]
pub fn group_of(key: &[u8]) -> u32 {
    let tail = &key[key.len().saturating_sub(4)..];
    tail.iter().fold(0u32, |acc, &b| (acc << 8) | u32::from(b))
}

/// Keys in slots, for policy unit tests.
#[cfg(test)]
pub(crate) mod test_util {
    use super::{hash_key, KeyBuf};
    use crate::table::Slots;

    /// One test key and its hash.
    pub(crate) struct TestSlot {
        pub(crate) key: KeyBuf,
        pub(crate) hash: u64,
    }

    /// A table whose slot `i` holds the `i`-th key, ready and unpinned; `ks[i]` gives the key.
    pub(crate) struct TestKeys {
        slots: Slots,
        list: Vec<TestSlot>,
    }

    impl std::ops::Deref for TestKeys {
        type Target = Slots;
        fn deref(&self) -> &Slots {
            &self.slots
        }
    }

    impl std::ops::DerefMut for TestKeys {
        fn deref_mut(&mut self) -> &mut Slots {
            &mut self.slots
        }
    }

    impl std::ops::Index<usize> for TestKeys {
        type Output = TestSlot;
        fn index(&self, i: usize) -> &TestSlot {
            &self.list[i]
        }
    }

    /// Slots holding `keys`, in order.
    pub(crate) fn keys_of(keys: &[&[u8]]) -> TestKeys {
        let mut slots = Slots::new(keys.len() as u32).unwrap();
        let list = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let hash = hash_key(k);
                slots.insert(i as u32, k, hash);
                slots.complete_store(i as u32);
                TestSlot {
                    key: KeyBuf::from_slice(k),
                    hash,
                }
            })
            .collect();
        TestKeys { slots, list }
    }

    /// Give absent slot `c` a key of its own, pending.
    pub(crate) fn pend(slots: &mut Slots, c: u32) {
        let k = format!("chunk{c}");
        slots.insert(c, k.as_bytes(), hash_key(k.as_bytes()));
    }

    /// Slots holding the keys `k0`, `k1`, ...
    pub(crate) fn keys(n: usize) -> TestKeys {
        let names: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
        let refs: Vec<&[u8]> = names.iter().map(String::as_bytes).collect();
        keys_of(&refs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_index_is_big_endian_tail() {
        assert_eq!(group_of(b"abc\x00\x00\x00\x02"), 2);
        assert_eq!(group_of(b"\x01\x00\x00\x00\x00"), 0);
        assert_eq!(group_of(b"\x01\x02"), 0x0102);
        assert_eq!(group_of(b""), 0);
        assert_eq!(group_of(&[0xff; 4]), u32::MAX);
    }

    #[test]
    fn hash_is_deterministic() {
        assert_eq!(hash_key(b"abc"), hash_key(b"abc"));
        assert_ne!(hash_key(b"abc"), hash_key(b"abd"));
    }

    /// Every length of 0..=80 bytes, each byte position flipped: all hashes distinct, and the
    /// bucket bits (low) and tag bits (high) both spread.
    #[test]
    fn hash_separates_lengths_and_bytes() {
        let mut seen = std::collections::HashSet::new();
        let (mut low, mut high) = (
            std::collections::HashSet::new(),
            std::collections::HashSet::new(),
        );
        let base: Vec<u8> = (0..80u8).map(|i| i.wrapping_mul(37)).collect();
        for len in 0..=80 {
            let k = &base[..len];
            let h = hash_key(k);
            assert!(seen.insert(h), "length {len}");
            low.insert(h & 0xff);
            high.insert(h >> 56);
            for at in 0..len {
                let mut f = k.to_vec();
                f[at] ^= 1;
                let h = hash_key(&f);
                assert!(seen.insert(h), "length {len}, byte {at}");
                low.insert(h & 0xff);
                high.insert(h >> 56);
            }
        }
        // 3,321 hashes: a good mix fills nearly all 256 values of each byte.
        assert!(
            low.len() > 240 && high.len() > 240,
            "{} {}",
            low.len(),
            high.len()
        );
    }

    /// The unrolled path for 33 to 48 bytes gives exactly what the general loop gives.
    #[test]
    fn unrolled_hash_matches_the_loop() {
        fn looped(key: &[u8]) -> u64 {
            let (a, b) = mix_long(key, SEED, M0);
            fold(fold(a, b) ^ key.len() as u64, M2)
        }
        let base: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(101) ^ 0x5a).collect();
        for len in 17..=64 {
            assert_eq!(hash_key(&base[..len]), looped(&base[..len]), "length {len}");
        }
    }

    /// The maps' hasher gives a key's bytes exactly `hash_key`, the hash callers probe with.
    #[test]
    fn key_hasher_agrees_with_hash_key() {
        for k in [&b""[..], b"abc", &[7; 36], &[1; 100]] {
            assert_eq!(KeyHasher.hash_one(KeyBuf::from_slice(k)), hash_key(k));
            assert_eq!(KeyHasher.hash_one(k), hash_key(k));
        }
        assert_ne!(KeyHasher.hash_one(1u64), KeyHasher.hash_one(2u64));
        assert_ne!(
            KeyHasher.hash_one((1u64, 2u64)),
            KeyHasher.hash_one((2u64, 1u64))
        );
    }

    /// `key_buf` copies every key exactly, its two-copy path (33-40 bytes) included, inline
    /// up to the buffer's 40 bytes.
    #[test]
    fn key_buf_copies_every_length() {
        let base: Vec<u8> = (1..=64u8).map(|i| i.wrapping_mul(37)).collect();
        for len in 0..=64 {
            let k = key_buf(&base[..len]);
            assert_eq!(k.as_slice(), &base[..len], "length {len}");
            assert_eq!(k.spilled(), len > 40, "length {len}");
        }
    }

    /// Keys that differ only in their zero padding (same words, another length) differ.
    #[test]
    fn hash_counts_the_length() {
        assert_ne!(hash_key(&[0; 8]), hash_key(&[0; 9]));
        assert_ne!(hash_key(&[0; 20]), hash_key(&[0; 24]));
        assert_ne!(hash_key(b""), hash_key(&[0]));
    }
}
