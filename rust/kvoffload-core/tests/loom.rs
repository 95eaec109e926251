//! Model checks of the lock-free table (`table.rs`) with loom: every interleaving of a few
//! threads, within loom's bounds.
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p kvoffload-core --test loom --release
//! ```
//! (The normal test run compiles this file to nothing.) Each model runs with at most three
//! preemptions per execution.
#![cfg(loom)]

use kvoffload_core::table::{colliding_keys, same_chain_bit};
use kvoffload_core::{hash_key, ChunkState, Probe, Release, Slots};
use loom::thread;

/// Run `f` under loom with at most three preemptions per execution (loom's advice: the bugs
/// of small lock-free structures show within two or three; unbounded, the chain-rebuild model
/// runs for hours).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// A table of `n` slots holding `keys[i]` in slot `i`, ready.
fn ready(n: u32, keys: &[&[u8]]) -> Slots {
    let mut t = Slots::new(n).unwrap();
    for (c, k) in keys.iter().enumerate() {
        t.insert(c as u32, k, hash_key(k));
        assert!(t.complete_store(c as u32));
    }
    t
}

/// Bucket 0 holds `x` in its one entry (under loom) and the chain `a -> b`. The writer removes
/// the key of slot `gone` (0: `x`, from the entry; 2: `a`, the chain's head) and gives that slot
/// to `c`, in the same bucket or in another one. The reader looks for `b`, which stays: it must
/// find it even when the slot it stands on moves away.
fn reader_during_rebuild(gone: u32, c_bucket: u64) {
    model(move || {
        let same = colliding_keys(0, 3);
        let c_key = colliding_keys(c_bucket, 4).pop().unwrap();
        let mut t = ready(3, &[&same[0], &same[1], &same[2]]);
        let shared = t.shared();
        let b_key = same[1].clone();
        let c2 = c_key.clone();
        let reader = thread::spawn(move || {
            let b = shared.probe(&b_key, hash_key(&b_key));
            let c = shared.probe(&c2, hash_key(&c2));
            (b, c)
        });
        t.remove(gone);
        t.insert(gone, &c_key, hash_key(&c_key));
        let (b, c) = reader.join().unwrap();
        assert_eq!(b, Probe::Ready, "b is resident throughout");
        assert!(matches!(c, Probe::Miss | Probe::Pending));
        t.validate().unwrap();
    });
}

#[test]
fn a_reader_never_misses_a_resident_key_while_its_chain_is_rebuilt() {
    reader_during_rebuild(2, 0);
}

#[test]
fn a_reader_standing_on_a_slot_moved_to_another_chain_starts_again() {
    reader_during_rebuild(2, 1);
}

#[test]
fn a_reader_passing_an_entry_that_is_emptied_and_refilled_finds_the_chained_key() {
    reader_during_rebuild(0, 0);
}

#[test]
fn a_reader_passing_an_entry_whose_slot_moved_to_another_bucket_finds_the_chained_key() {
    reader_during_rebuild(0, 1);
}

/// Bucket 0 holds `x` in its one entry (under loom) and the chain `b -> a`, `a` and `b` under
/// different bits of the chain's summary. The writer removes `b` (its bit stays in the summary),
/// walks the chain for an absent key under `b`'s bit (which makes the summary exact, without
/// `b`'s bit), and chains `c`, another key under that bit, in `b`'s slot. The reader looks for
/// `a`, which stays, and for `b`: `a` is found whatever the summary, `b` is never half-seen.
#[test]
fn a_reader_never_misses_a_chained_key_while_the_chain_summary_is_rebuilt() {
    model(|| {
        let same = colliding_keys(0, 64);
        let (x, a) = (&same[0], &same[1]);
        let mut under_b = same[2..].iter().filter(|k| !same_chain_bit(k, a));
        let b = under_b.next().unwrap();
        let mut twins = same[2..].iter().filter(|k| *k != b && same_chain_bit(k, b));
        let (absent, c) = (twins.next().unwrap().clone(), twins.next().unwrap().clone());
        let mut t = ready(3, &[x, a, b]);
        let shared = t.shared();
        let (a2, b2) = (a.clone(), b.clone());
        let reader = thread::spawn(move || {
            let a = shared.probe(&a2, hash_key(&a2));
            let b = shared.probe(&b2, hash_key(&b2));
            (a, b)
        });
        t.remove(2);
        assert_eq!(t.find(&absent, hash_key(&absent)), None);
        t.insert(2, &c, hash_key(&c));
        let (a, b) = reader.join().unwrap();
        assert_eq!(a, Probe::Ready, "a is resident throughout");
        assert!(matches!(b, Probe::Ready | Probe::Miss), "{b:?}");
        t.validate().unwrap();
    });
}

/// Key `k` resident in slot 0 with one pin, and a thread releasing that pin (lock-free).
fn pinned_and_releasing() -> (Slots, thread::JoinHandle<Release>) {
    let mut t = ready(1, &[b"k"]);
    t.check_pin(0, 1).unwrap();
    t.pin(0);
    let shared = t.shared();
    (t, thread::spawn(move || shared.release(&[b"k"])))
}

#[test]
fn a_release_racing_the_writers_pin_and_drain_loses_no_pin() {
    model(|| {
        let (mut t, releaser) = pinned_and_releasing();
        // The writer: apply queued releases, then a load pins the key again.
        let mut applied = 0;
        t.drain_releases(|_| applied += 1);
        t.check_pin(0, 1).unwrap();
        t.pin(0);
        assert_eq!(releaser.join().unwrap(), Release::Done);
        t.drain_releases(|_| applied += 1);
        // Exactly the writer's pin is left, and the slot is not evictable.
        assert_eq!(t.state(0), ChunkState::Ready(1));
        assert_eq!(t.num_evictable(), 0);
        assert!(applied <= 1);
        assert_eq!(t.unpin_all(&[0]).unwrap().to_vec(), [true]);
        t.validate().unwrap();
    });
}

#[test]
fn a_release_racing_an_exclusive_writer_backs_off_or_keeps_the_writer_on_compare_and_swap() {
    // The writer asks for pins without compare-and-swap, pins and unpins once, and stops
    // asking, while a release of the key's other pin runs. Either the release backs off (and
    // its caller would repeat it under the lock) or it lands: no pin is ever lost or doubled.
    model(|| {
        let (mut t, releaser) = pinned_and_releasing();
        t.set_exclusive(true);
        t.check_pin(0, 1).unwrap();
        t.pin(0);
        assert!(t.unpin_all(&[0]).is_ok());
        t.set_exclusive(false);
        let released = releaser.join().unwrap();
        t.drain_releases(|_| {});
        let left = if released == Release::Done { 0 } else { 1 };
        assert_eq!(t.state(0), ChunkState::Ready(left));
        t.validate().unwrap();
    });
}

#[test]
fn two_releases_of_one_pin_one_wins_and_the_other_changes_nothing() {
    model(|| {
        let mut t = ready(2, &[b"x", b"y"]);
        for c in [0, 1] {
            t.pin(c);
        }
        let (s1, s2) = (t.shared(), t.shared());
        let first = thread::spawn(move || s1.release(&[b"x", b"y"]));
        let second = s2.release(&[b"y"]);
        let first = first.join().unwrap();
        // y had one pin: exactly one of the two releases took it.
        assert!(
            (first == Release::Done) != (second == Release::Done),
            "{first:?} {second:?}"
        );
        let mut order = Vec::new();
        t.drain_releases(|c| order.push(c));
        if first == Release::Done {
            assert_eq!(order, vec![0, 1]);
            assert_eq!(t.num_evictable(), 2);
        } else {
            // The failed release gave x's pin back.
            assert_eq!(order, vec![1]);
            assert_eq!(t.state(0), ChunkState::Ready(1));
        }
        t.validate().unwrap();
    });
}

#[test]
fn two_releases_of_two_pins_queue_the_slot_once() {
    model(|| {
        let mut t = ready(1, &[b"k"]);
        t.pin(0);
        t.pin(0);
        let (s1, s2) = (t.shared(), t.shared());
        let other = thread::spawn(move || s1.release(&[b"k"]));
        assert_eq!(s2.release(&[b"k"]), Release::Done);
        assert_eq!(other.join().unwrap(), Release::Done);
        let mut order = Vec::new();
        t.drain_releases(|c| order.push(c));
        assert_eq!(order, vec![0]);
        assert_eq!((t.state(0), t.num_evictable()), (ChunkState::Ready(0), 1));
        t.validate().unwrap();
    });
}

/// Key `k` in slot 0 with one pin. A release of `k` runs while the writer drops that pin itself
/// (as a load's completion under the lock would), evicts `k` and gives the slot to `j`, which
/// is stored and pinned. Whatever the order, the release never takes `j`'s pin: once the slot
/// has a new key (a new sequence number), a release still retrying on it must back off.
#[test]
fn a_release_retrying_on_a_slot_that_changed_keys_backs_off() {
    model(|| {
        let (mut t, releaser) = pinned_and_releasing();
        let rekeyed = t.unpin_all(&[0]).is_ok();
        if rekeyed {
            t.remove(0);
            t.insert(0, b"j", hash_key(b"j"));
            assert!(t.complete_store(0));
            t.check_pin(0, 1).unwrap();
            t.pin(0);
        }
        let released = releaser.join().unwrap();
        let mut queued = Vec::new();
        t.drain_releases(|c| queued.push(c));
        if rekeyed {
            assert_eq!(released, Release::Unsure);
            assert_eq!(t.state(0), ChunkState::Ready(1), "j keeps its pin");
            assert!(queued.is_empty());
            assert_eq!(t.key(0).as_ref(), b"j");
        } else {
            // The release took k's pin first: the writer's own drop found none.
            assert_eq!(released, Release::Done);
            assert_eq!((t.state(0), queued), (ChunkState::Ready(0), vec![0]));
        }
        t.validate().unwrap();
    });
}
