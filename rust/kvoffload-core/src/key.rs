//! Keys: owned key bytes stored inline when short, one fixed hasher, and the KV-group index.

use smallvec::SmallVec;
use std::hash::BuildHasher;

/// Owned key bytes. A 32-byte hash plus the 4-byte group index fits inline (no allocation).
pub type KeyBuf = SmallVec<[u8; 40]>;

/// The key held by one chunk slot, its hash and whether the slot holds a key: one cache line,
/// so resolving or evicting a chunk touches one line of per-chunk key data.
#[derive(Debug, Clone, Default)]
#[repr(align(64))]
pub struct KeySlot {
    /// The key bytes (empty when the slot holds no key; the empty key is legal, see `resident`).
    pub key: KeyBuf,
    /// `hash_key(&key)` while resident.
    pub hash: u64,
    /// Whether the slot holds a key.
    pub resident: bool,
}

/// The hasher every key table of the crate uses. Keys are block hashes already, so a fast
/// non-cryptographic hash with a fixed seed is enough and keeps runs reproducible.
#[derive(Clone, Copy, Default, Debug)]
pub struct KeyHasher;

impl BuildHasher for KeyHasher {
    type Hasher = foldhash::fast::FoldHasher<'static>;

    fn build_hasher(&self) -> Self::Hasher {
        foldhash::fast::FixedState::with_seed(0x6b76_6f66_666c_6f61).build_hasher()
    }
}

/// Hash of a key's bytes, as used by every `HashTable` in the crate.
#[inline]
#[must_use]
pub fn hash_key(key: &[u8]) -> u64 {
    KeyHasher.hash_one(key)
}

/// The KV-group index of a key: its last (up to) 4 bytes read as a big-endian unsigned int.
#[must_use]
pub fn group_of(key: &[u8]) -> u32 {
    let tail = &key[key.len().saturating_sub(4)..];
    tail.iter().fold(0u32, |acc, &b| (acc << 8) | u32::from(b))
}

/// Key slots for policy unit tests.
#[cfg(test)]
pub(crate) mod test_util {
    use super::{hash_key, KeyBuf, KeySlot};

    /// A resident slot holding `k`.
    pub(crate) fn slot(k: &[u8]) -> KeySlot {
        KeySlot {
            key: KeyBuf::from_slice(k),
            hash: hash_key(k),
            resident: true,
        }
    }

    /// Slots holding the keys `k0`, `k1`, ...
    pub(crate) fn keys(n: usize) -> Vec<KeySlot> {
        (0..n).map(|i| slot(format!("k{i}").as_bytes())).collect()
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
}
