//! The model's cache policies (SPEC "LRU policy" and "ARC policy"): each hook the manager calls,
//! as one `match` over the two policies. LRU ranks live in the chunks; ARC's lists hold keys,
//! oldest first, and a move to a list's newest end is `take` + `push`.

use super::{has, issue, take, Chunk, Key, Model, Policy, Req};
use kvoffload_core::ChunkId;

impl Model {
    /// `touch`: last key to first. LRU: a fresh rank for each resident key. ARC: T1 readable
    /// -> T2, T1 pending -> T1, T2 -> T2 (newest ends), anything else is a ghost hit.
    pub(crate) fn touch(&mut self, keys: &[Key]) {
        for k in keys.iter().rev() {
            let refs = self.refs_of(k);
            match &mut self.policy {
                Policy::Lru { counter } => {
                    if let Some(c) = self.chunks.iter_mut().find(|c| &c.key == k) {
                        c.rank = (issue(counter), 0);
                    }
                }
                Policy::Arc { t1, t2, .. } => {
                    if take(t1, k) {
                        if refs.is_some_and(|r| r >= 0) {
                            t2.push(k.clone());
                        } else {
                            t1.push(k.clone());
                        }
                    } else if take(t2, k) {
                        t2.push(k.clone());
                    } else {
                        self.ghost_hit(k);
                    }
                }
            }
        }
    }

    /// `on_store_miss`: LRU nothing; ARC ghost hits, last key to first.
    pub(super) fn on_store_miss(&mut self, keys: &[Key]) {
        for k in keys.iter().rev() {
            self.ghost_hit(k);
        }
    }

    /// `on_request_access` with the keys a request sees for the first time. LRU: the request
    /// takes its rank now if it has none; resident keys with a position rise to
    /// `(request rank, -position)` when that is newer. ARC: nothing.
    pub(super) fn on_request_access(&mut self, req: &mut Req, new: &[(Key, Option<i64>)]) {
        let Policy::Lru { counter } = &mut self.policy else {
            return;
        };
        let rank = *req.rank.get_or_insert_with(|| issue(counter));
        for (k, p) in new {
            let Some(p) = *p else { continue };
            if let Some(c) = self.chunks.iter_mut().find(|c| &c.key == k) {
                if (rank, -p) > c.rank {
                    c.rank = (rank, -p);
                }
            }
        }
    }

    /// `insert`, pending. LRU: `(request rank, -position)` with a position, else a fresh rank.
    /// ARC: T1's newest end, out of the ghost lists.
    pub(super) fn insert(&mut self, id: ChunkId, key: &[u8], position: Option<i64>, req: &Req) {
        let rank = match &mut self.policy {
            Policy::Lru { counter } => match position {
                Some(p) => (req.rank.expect("the store recorded the request first"), -p),
                None => (issue(counter), 0),
            },
            Policy::Arc { t1, b1, b2, .. } => {
                t1.push(key.to_vec());
                take(b1, key);
                take(b2, key);
                (0, 0)
            }
        };
        self.chunks.push(Chunk {
            id,
            key: key.to_vec(),
            refs: -1,
            rank,
        });
    }

    /// `remove` after a failed store: ARC drops the key from T1/T2 without a ghost entry.
    pub(super) fn remove(&mut self, key: &[u8]) {
        if let Policy::Arc { t1, t2, .. } = &mut self.policy {
            if !take(t1, key) {
                take(t2, key);
            }
        }
    }

    /// `on_request_finished` over the head-to-tail list, last to first. LRU: fresh ranks for
    /// the resident keys. ARC: inserted-only keys to their list's newest end, reused keys to
    /// T2's newest end, others untouched.
    pub(super) fn finished(&mut self, req: &Req, head_to_tail: &[Key]) {
        for k in head_to_tail.iter().rev() {
            let Some(i) = self.chunks.iter().position(|c| &c.key == k) else {
                continue;
            };
            match &mut self.policy {
                Policy::Lru { counter } => self.chunks[i].rank = (issue(counter), 0),
                Policy::Arc { t1, t2, .. } => {
                    let reused = has(&req.reused, k);
                    if has(&req.inserted, k) && !reused {
                        if take(t1, k) {
                            t1.push(k.clone());
                        } else if take(t2, k) {
                            t2.push(k.clone());
                        }
                    } else if reused {
                        if !take(t1, k) {
                            take(t2, k);
                        }
                        t2.push(k.clone());
                    }
                }
            }
        }
    }

    /// ARC ghost hit: adapt the target, move the ghost to its list's newest end.
    fn ghost_hit(&mut self, key: &[u8]) {
        let cap = f64::from(self.num_chunks);
        let Policy::Arc { b1, b2, target, .. } = &mut self.policy else {
            return;
        };
        if has(b1, key) {
            let ratio = b2.len() as f64 / b1.len() as f64;
            *target = (*target + if ratio > 1.0 { ratio } else { 1.0 }).min(cap);
            take(b1, key);
            b1.push(key.to_vec());
        } else if has(b2, key) {
            let ratio = b1.len() as f64 / b2.len() as f64;
            *target = (*target - if ratio > 1.0 { ratio } else { 1.0 }).max(0.0);
            take(b2, key);
            b2.push(key.to_vec());
        }
    }

    /// `evict`: choose exactly `n` evictable chunks whose keys are not `protected`, or change
    /// nothing. Returns the victims' keys in eviction order; the caller drops the chunks.
    pub(super) fn evict(&mut self, n: usize, protected: &[Key]) -> Option<Vec<Key>> {
        let evictable: Vec<Key> = self
            .chunks
            .iter()
            .filter(|c| c.refs == 0 && !protected.contains(&c.key))
            .map(|c| c.key.clone())
            .collect();
        match &mut self.policy {
            Policy::Lru { .. } => {
                let mut order: Vec<&Chunk> = self
                    .chunks
                    .iter()
                    .filter(|c| evictable.contains(&c.key))
                    .collect();
                order.sort_by(|a, b| (a.rank, &a.key).cmp(&(b.rank, &b.key)));
                (order.len() >= n).then(|| order[..n].iter().map(|c| c.key.clone()).collect())
            }
            Policy::Arc {
                t1,
                t2,
                b1,
                b2,
                target,
            } => {
                let floor = target.floor() as usize;
                let mut virtual_t1 = t1.len();
                let mut chosen: Vec<(Key, bool)> = Vec::new();
                for _ in 0..n {
                    let oldest = |list: &[Key], chosen: &[(Key, bool)]| {
                        list.iter()
                            .find(|k| evictable.contains(k) && !chosen.iter().any(|(c, _)| c == *k))
                            .cloned()
                    };
                    let mut pick = None;
                    if virtual_t1 >= floor {
                        pick = oldest(t1, &chosen).map(|k| (k, true));
                    }
                    if pick.is_none() {
                        pick = oldest(t2, &chosen).map(|k| (k, false));
                    }
                    if pick.is_none() {
                        pick = oldest(t1, &chosen).map(|k| (k, true));
                    }
                    let (k, from_t1) = pick?;
                    if from_t1 {
                        virtual_t1 -= 1;
                    }
                    chosen.push((k, from_t1));
                }
                for (k, from_t1) in &chosen {
                    if *from_t1 {
                        take(t1, k);
                        b1.push(k.clone());
                    } else {
                        take(t2, k);
                        b2.push(k.clone());
                    }
                }
                let cap = self.num_chunks as usize;
                for ghosts in [b1, b2] {
                    while ghosts.len() > cap {
                        ghosts.remove(0);
                    }
                }
                Some(chosen.into_iter().map(|(k, _)| k).collect())
            }
        }
    }
}
