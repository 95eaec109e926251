//! Illegal calls: each is built from the current state so that it has exactly one reason to
//! be refused, then made on the crate's manager (which must refuse it with the matching error
//! and change nothing observable) and on the model (which must refuse it too).

use super::{dedup, pick, refs, refusal, Harness};
use crate::reference::{Key, Refusal, Req};
use kvoffload_core::{ChunkId, PolicyState, RequestState};

/// A call that must be refused.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Illegal {
    LoadAbsent,
    LoadPending,
    CompleteUnpinned,
    CompleteTooMany,
    StoreDuplicate,
    FinishedLoadsNewKey,
    FinishedStoresNewKey,
    LoadPositionsMismatch,
    StorePositionsMismatch,
    FinishPositionsMismatch,
}

/// A key never in the alphabet: always absent.
const OUTSIDER: &[u8] = b"zz\x00\x00\x00\x00";

/// The manager call an illegal step makes.
enum Call {
    Load,
    CompleteLoad,
    Store,
    Finish,
}

/// Everything observable about the crate's manager and one request state, owned.
#[derive(Debug, PartialEq)]
struct Snapshot {
    resident: Vec<(Vec<u8>, ChunkId, i32)>,
    policy: PolicyState,
    pool: (u32, Vec<ChunkId>),
    tracker: Option<Vec<(Vec<u8>, u64)>>,
    current: bool,
    seen: Vec<Vec<u8>>,
    finished: bool,
}

impl Harness {
    fn snapshot(&self, state: &RequestState) -> Snapshot {
        let (fresh, free) = self.mgr.pool_state();
        Snapshot {
            resident: self
                .mgr
                .resident()
                .into_iter()
                .map(|(k, c, r)| (k.to_vec(), c, r))
                .collect(),
            policy: self.mgr.policy_state(),
            pool: (fresh, free.to_vec()),
            tracker: self
                .mgr
                .tracker()
                .map(|t| t.entries().map(|(k, n)| (k.to_vec(), n)).collect()),
            current: self.mgr.is_current(state),
            seen: state.seen_keys().map(<[u8]>::to_vec).collect(),
            finished: state.is_finished(),
        }
    }

    /// A request that has finished: the slot's own when it is current and finished, else a
    /// fresh request finished at once (it saw nothing, so finishing it changes nothing).
    fn finished_request(&mut self, slot: usize) -> (RequestState, Req) {
        let s = &self.slots[slot];
        if self.model.is_current(&s.model) && s.model.finished {
            return (s.state.clone(), s.model.clone());
        }
        let mut state = self.mgr.new_request_state();
        let mut model = self.model.new_request();
        self.mgr.on_request_finished(&mut state, &[]).unwrap();
        self.model.on_request_finished(&mut model, &|_| None);
        (state, model)
    }

    /// An absent key: from the alphabet when one is absent, else the outsider.
    fn absent_key(&self, p: u8) -> Key {
        let absent: Vec<Key> = self
            .keys
            .iter()
            .filter(|k| self.model.refs_of(k).is_none())
            .cloned()
            .collect();
        pick(&absent, &[p])
            .pop()
            .unwrap_or_else(|| OUTSIDER.to_vec())
    }

    /// Build the illegal call `kind`, expect the refusal, and check that nothing changed.
    #[allow(clippy::too_many_lines)] // one arm per kind of illegal call
    pub(super) fn illegal(&mut self, kind: Illegal, slot: usize, picks: &[u8]) {
        let p0 = picks.first().copied().unwrap_or(0);
        let at = |len: usize| p0 as usize % (len + 1);
        let readable = self.model.keys_where(|r| r >= 0);
        let pending = self.model.keys_where(|r| r < 0);
        let (mut state, mut req) = match kind {
            Illegal::FinishedLoadsNewKey | Illegal::FinishedStoresNewKey => {
                self.finished_request(slot)
            }
            _ => {
                self.refresh(slot);
                let s = &self.slots[slot];
                (s.state.clone(), s.model.clone())
            }
        };
        let legal_loads = |req: &Req| -> Vec<Key> {
            let mut v = readable.clone();
            if req.finished {
                v.retain(|k| req.seen.contains(k));
            }
            v
        };
        let (call, keys, bad_positions, want) = match kind {
            Illegal::LoadAbsent | Illegal::LoadPending => {
                let bad = if matches!(kind, Illegal::LoadAbsent) {
                    self.absent_key(p0)
                } else if pending.is_empty() {
                    return;
                } else {
                    pick(&pending, &[p0]).remove(0)
                };
                let mut keys = pick(&legal_loads(&req), &picks[1.min(picks.len())..]);
                keys.insert(at(keys.len()), bad);
                (Call::Load, keys, false, Refusal::KeyState)
            }
            Illegal::CompleteUnpinned | Illegal::CompleteTooMany => {
                let mut keys = self.draw_pins(&picks[1.min(picks.len())..]);
                if matches!(kind, Illegal::CompleteUnpinned) {
                    let mut unpinned: Vec<Key> = self
                        .keys
                        .iter()
                        .filter(|k| self.model.refs_of(k).is_none_or(|r| r <= 0))
                        .cloned()
                        .collect();
                    unpinned.push(OUTSIDER.to_vec());
                    let bad = pick(&unpinned, &[p0]).remove(0);
                    keys.insert(at(keys.len()), bad);
                } else {
                    let pinned = self.model.keys_where(|r| r > 0);
                    if pinned.is_empty() {
                        return;
                    }
                    let k = pick(&pinned, &[p0]).remove(0);
                    keys.retain(|o| *o != k);
                    for _ in 0..=self.model.refs_of(&k).unwrap() {
                        keys.insert(at(keys.len()), k.clone());
                    }
                }
                (Call::CompleteLoad, keys, false, Refusal::KeyState)
            }
            Illegal::StoreDuplicate => {
                let mut keys = dedup(picks.iter().map(|&i| self.key(i)).collect());
                if keys.is_empty() {
                    keys.push(self.key(0));
                }
                let dup = keys[p0 as usize % keys.len()].clone();
                keys.insert(at(keys.len()), dup);
                (Call::Store, keys, false, Refusal::DuplicateKey)
            }
            Illegal::FinishedLoadsNewKey => {
                let new: Vec<Key> = readable
                    .iter()
                    .filter(|k| !req.seen.contains(k))
                    .cloned()
                    .collect();
                if new.is_empty() {
                    return;
                }
                let mut keys = pick(&legal_loads(&req), &picks[1.min(picks.len())..]);
                keys.insert(at(keys.len()), pick(&new, &[p0]).remove(0));
                (Call::Load, keys, false, Refusal::RequestFinished)
            }
            Illegal::FinishedStoresNewKey => {
                let offer = dedup(picks.iter().map(|&i| self.key(i)).collect());
                let records = self.model.store_records(&offer);
                let new: Vec<usize> = (0..offer.len())
                    .filter(|&i| records[i] && !req.seen.contains(&offer[i]))
                    .collect();
                if new.is_empty() {
                    return;
                }
                (Call::Store, offer, false, Refusal::RequestFinished)
            }
            Illegal::LoadPositionsMismatch => {
                let keys = pick(&legal_loads(&req), picks);
                (Call::Load, keys, true, Refusal::InvalidArgument)
            }
            Illegal::StorePositionsMismatch => {
                let keys = dedup(picks.iter().map(|&i| self.key(i)).collect());
                (Call::Store, keys, true, Refusal::InvalidArgument)
            }
            Illegal::FinishPositionsMismatch => {
                if req.finished {
                    return;
                }
                (Call::Finish, Vec::new(), true, Refusal::InvalidArgument)
            }
        };
        let before = self.snapshot(&state);
        let model_before = format!("{:?}", (&self.model, &req));
        let mut pos = self.positions(slot, &keys);
        if bad_positions {
            match pos.first_mut() {
                // A position whose negation overflows.
                Some(first) if p0 % 2 == 1 => *first = Some(i64::MIN),
                _ => pos.push(None),
            }
        }
        let got = match call {
            Call::Load => self
                .mgr
                .prepare_load(&refs(&keys), Some(&pos), &mut state)
                .map(drop),
            Call::Store => self
                .mgr
                .prepare_store(&refs(&keys), Some(&pos), &mut state)
                .map(drop),
            Call::CompleteLoad => self.mgr.complete_load(&refs(&keys)),
            Call::Finish => {
                let n = state.seen_keys().len();
                self.mgr.on_request_finished(&mut state, &vec![None; n + 1])
            }
        };
        assert_eq!(
            got.map_err(|e| refusal(&e)),
            Err(want),
            "step {}: illegal {kind:?} with {keys:?}",
            self.step
        );
        assert_eq!(
            self.snapshot(&state),
            before,
            "step {}: illegal {kind:?} changed the state",
            self.step
        );
        // The model refuses the same calls (argument shapes are the driver's concern).
        if !bad_positions {
            let refused = match call {
                Call::Load => self.model.prepare_load(&keys, &pos, &mut req).map(drop),
                Call::Store => self.model.prepare_store(&keys, &pos, &mut req).map(drop),
                Call::CompleteLoad => self.model.complete_load(&keys),
                Call::Finish => unreachable!(),
            };
            assert_eq!(refused, Err(want), "model: illegal {kind:?} with {keys:?}");
            assert_eq!(format!("{:?}", (&self.model, &req)), model_before);
        }
    }
}
