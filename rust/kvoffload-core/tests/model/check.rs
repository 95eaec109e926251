//! The comparison after every step: `validate()`, then each observable piece of the crate's
//! state against the model's (ARC lists compared by key, through the chunks' keys).

use super::Harness;
use crate::reference::{Key, Policy, View};
use kvoffload_core::{ChunkId, KeyBuf, PolicyState};

impl Harness {
    /// Compare every observable piece of state.
    pub(super) fn check(&self) {
        let step = self.step;
        if let Err(e) = self.mgr.validate() {
            panic!("step {step}: validate: {e}");
        }
        let resident: Vec<(Key, ChunkId, i32)> = self
            .mgr
            .resident()
            .into_iter()
            .map(|(k, c, r)| (k.to_vec(), c, r))
            .collect();
        assert_eq!(resident, self.model.resident(), "step {step}: resident");
        let (fresh, free) = self.mgr.pool_state();
        assert_eq!(
            (fresh, free.to_vec()),
            self.model.pool(),
            "step {step}: pool"
        );
        let tracker = self.mgr.tracker().map(|t| {
            t.entries()
                .map(|(k, n)| (k.to_vec(), n))
                .collect::<Vec<_>>()
        });
        assert_eq!(tracker, self.model.tracker(), "step {step}: tracker");
        self.check_policy();
        let mut pins: Vec<Key> = self.load_jobs.concat();
        pins.sort();
        let mut want = self.pins();
        want.sort();
        assert_eq!(pins, want, "step {step}: load jobs vs pins");
        for k in &self.keys {
            assert_eq!(
                self.mgr.lookup(k),
                self.model.lookup(k),
                "step {step}: lookup {k:?}"
            );
        }
        for (i, s) in self.slots.iter().enumerate() {
            let current = self.mgr.is_current(&s.state);
            assert_eq!(
                current,
                self.model.is_current(&s.model),
                "step {step}: request {i} current"
            );
            if current {
                let seen: Vec<Key> = s.state.seen_keys().map(<[u8]>::to_vec).collect();
                assert_eq!(seen, s.model.seen, "step {step}: request {i} seen");
                assert_eq!(
                    s.state.is_finished(),
                    s.model.finished,
                    "step {step}: request {i} finished"
                );
            }
        }
    }

    fn check_policy(&self) {
        let step = self.step;
        let key_of = |c: &ChunkId| {
            self.mgr
                .key_of(*c)
                .expect("listed chunk is resident")
                .to_vec()
        };
        match (self.mgr.policy_state(), &self.model.policy) {
            (PolicyState::Lru { ranks, next_rank }, Policy::Lru { counter }) => {
                assert_eq!(ranks, self.model.ranks(), "step {step}: lru ranks");
                assert_eq!(next_rank, *counter, "step {step}: lru counter");
            }
            (
                PolicyState::Arc {
                    t1,
                    t2,
                    b1,
                    b2,
                    target,
                },
                Policy::Arc {
                    t1: m1,
                    t2: m2,
                    b1: g1,
                    b2: g2,
                    target: mt,
                    ..
                },
            ) => {
                assert_eq!(
                    &t1.iter().map(key_of).collect::<Vec<_>>(),
                    m1,
                    "step {step}: t1"
                );
                assert_eq!(
                    &t2.iter().map(key_of).collect::<Vec<_>>(),
                    m2,
                    "step {step}: t2"
                );
                let ghosts = |v: Vec<KeyBuf>| v.into_iter().map(|k| k.to_vec()).collect::<Vec<_>>();
                assert_eq!(&ghosts(b1), g1, "step {step}: b1");
                assert_eq!(&ghosts(b2), g2, "step {step}: b2");
                assert_eq!(
                    target.to_bits(),
                    mt.to_bits(),
                    "step {step}: target {target} vs {mt}"
                );
            }
            (
                PolicyState::Queue {
                    queue,
                    parked,
                    hand,
                },
                Policy::Own(_),
            ) => {
                let keyed = |v: Vec<(ChunkId, bool)>| {
                    v.iter().map(|(c, b)| (key_of(c), *b)).collect::<Vec<_>>()
                };
                let got = View::Queue {
                    queue: keyed(queue),
                    parked: keyed(parked),
                    hand: hand.as_ref().map(key_of),
                };
                assert_eq!(Some(got), self.model.own_view(), "step {step}: queue");
            }
            (
                PolicyState::Queues {
                    names,
                    linked,
                    parked,
                    ghosts,
                },
                Policy::Own(_),
            ) => {
                let keyed = |v: Vec<Vec<(ChunkId, u8)>>| {
                    v.into_iter()
                        .map(|q| q.iter().map(|(c, f)| (key_of(c), *f)).collect())
                        .collect::<Vec<Vec<_>>>()
                };
                let got = View::Queues {
                    names: names.to_vec(),
                    linked: keyed(linked),
                    parked: keyed(parked),
                    ghosts: ghosts.into_iter().map(|k| k.to_vec()).collect(),
                };
                assert_eq!(Some(got), self.model.own_view(), "step {step}: queues");
            }
            (got, _) => panic!("step {step}: policy kind mismatch: {got:?}"),
        }
    }
}
