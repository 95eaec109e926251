//! Keys: owned key bytes stored inline when short, one fixed hasher, and the KV-group index.

use smallvec::SmallVec;
use std::hash::BuildHasher;

/// Owned key bytes. A 32-byte hash plus the 4-byte group index fits inline (no allocation).
pub type KeyBuf = SmallVec<[u8; 40]>;

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
}
