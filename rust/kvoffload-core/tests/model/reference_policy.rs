//! The model's cache policies (SPEC "LRU policy" and "ARC policy"): each hook the manager calls,
//! as one `match` over the policies. LRU ranks live in the chunks; ARC's lists hold keys,
//! oldest first, and a move to a list's newest end is `take` + `push`. The paper's ARC shares
//! vLLM's hooks but for its store-miss bookkeeping, insert and eviction. kvoffload's own
//! policies (FIFO, SIEVE, S3-FIFO, 2Q, SLRU, LFU) are in `reference_policies.rs`; their hooks
//! here only hand the call on.

use super::{has, issue, take, Chunk, Key, Model, Policy, Req};
use kvoffload_core::ChunkId;

impl Model {
    /// `touch`: last key to first. LRU: a fresh rank for each resident key. ARC: T1 readable
    /// -> T2, T1 pending -> T1, T2 -> T2 (newest ends), anything else is a ghost hit.
    pub(crate) fn touch(&mut self, keys: &[Key]) {
        if let Policy::Own(o) = &mut self.policy {
            // Own policies: a hit on each resident key, first key to last.
            o.hit(keys);
            return;
        }
        for k in keys.iter().rev() {
            let refs = self.refs_of(k);
            match &mut self.policy {
                Policy::Lru { counter } => {
                    if let Some(c) = self.chunks.iter_mut().find(|c| &c.key == k) {
                        c.rank = (issue(counter), 0);
                    }
                }
                Policy::Own(_) => unreachable!("handled above"),
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

    /// `on_store_miss`: ARC ghost hits, last key to first (the paper's ARC first notes the
    /// offer's first ghost, for insert and eviction); the others nothing.
    pub(super) fn on_store_miss(&mut self, keys: &[Key]) {
        if let Policy::Arc {
            b1,
            b2,
            paper: true,
            ghost_key,
            ..
        } = &mut self.policy
        {
            *ghost_key = keys
                .iter()
                .find(|k| has(b1, k) || has(b2, k))
                .map(|k| (k.clone(), has(b2, k)));
        }
        for k in keys.iter().rev() {
            self.ghost_hit(k);
        }
    }

    /// `on_request_access` with the keys a request sees for the first time. LRU: the request
    /// takes its rank now if it has none; resident keys with a position rise to
    /// `(request rank, -position)` when that is newer. ARC: nothing.
    pub(super) fn on_request_access(&mut self, req: &mut Req, new: &[(Key, Option<i64>)]) {
        if let Policy::Own(o) = &mut self.policy {
            o.hit(&new.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
            return;
        }
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
    /// ARC: T1's newest end, out of the ghost lists; the paper's ARC puts the noted ghost at
    /// T2's newest end instead. Own policies: their own rules.
    pub(super) fn insert(&mut self, id: ChunkId, key: &[u8], position: Option<i64>, req: &Req) {
        let rank = match &mut self.policy {
            Policy::Lru { counter } => match position {
                Some(p) => (req.rank.expect("the store recorded the request first"), -p),
                None => (issue(counter), 0),
            },
            Policy::Arc {
                t1,
                t2,
                b1,
                b2,
                paper,
                ghost_key,
                ..
            } => {
                t1.push(key.to_vec());
                take(b1, key);
                take(b2, key);
                if ghost_key.as_ref().is_some_and(|(g, _)| g.as_slice() == key) {
                    if *paper {
                        take(t1, key);
                        t2.push(key.to_vec());
                    }
                    *ghost_key = None;
                }
                (0, 0)
            }
            Policy::Own(o) => {
                o.insert(key);
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

    /// `remove` after a failed store: ARC drops the key from T1/T2 without a ghost entry; own
    /// policies drop it without a ghost too.
    pub(super) fn remove(&mut self, key: &[u8]) {
        match &mut self.policy {
            Policy::Arc { t1, t2, .. } => {
                if !take(t1, key) {
                    take(t2, key);
                }
            }
            Policy::Own(o) => o.remove(key),
            Policy::Lru { .. } => {}
        }
    }

    /// The key's ref count became 0 (a completed store or the last load of it): own policies
    /// link a parked key back.
    pub(super) fn mark_evictable(&mut self, key: &[u8]) {
        if let Policy::Own(o) = &mut self.policy {
            o.mark_evictable(key);
        }
    }

    /// `on_request_finished` over the head-to-tail list, last to first. LRU: fresh ranks for
    /// the resident keys. ARC: inserted-only keys to their list's newest end, reused keys to
    /// T2's newest end, others untouched. Own policies: nothing.
    pub(super) fn finished(&mut self, req: &Req, head_to_tail: &[Key]) {
        if let Policy::Own(_) = self.policy {
            return;
        }
        for k in head_to_tail.iter().rev() {
            let Some(i) = self.chunks.iter().position(|c| &c.key == k) else {
                continue;
            };
            match &mut self.policy {
                Policy::Lru { counter } => self.chunks[i].rank = (issue(counter), 0),
                Policy::Own(_) => unreachable!("returned above"),
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
        if matches!(
            self.policy,
            Policy::Own(_) | Policy::Arc { paper: true, .. }
        ) && evictable.len() < n
        {
            // The manager asks these policies only for evictions that can succeed.
            return None;
        }
        let ready: Vec<Key> = self
            .chunks
            .iter()
            .filter(|c| c.refs == 0)
            .map(|c| c.key.clone())
            .collect();
        match &mut self.policy {
            Policy::Own(o) => Some(o.evict(n, protected, &ready)),
            Policy::Arc { paper: true, .. } => Some(self.evict_paper(n, &evictable)),
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
                ..
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

    /// The paper's eviction, one key at a time: unless a ghost hit is noted, bound the
    /// directory first (with `|T1| + |B1| >= c`, drop B1's oldest ghost, or with B1 empty evict
    /// T1's oldest evictable key with no ghost; else with all four lists at `2c` or more, drop
    /// B2's oldest ghost); then REPLACE: T1's oldest when `0 < |T1|` and (`|T1| > p`, or
    /// `|T1| == p` after a B2 ghost hit), or when T2 is empty, else T2's oldest, into its
    /// ghost list. `evictable`: the ready, unprotected keys.
    #[allow(clippy::float_cmp)]
    fn evict_paper(&mut self, n: usize, evictable: &[Key]) -> Vec<Key> {
        let c = self.num_chunks as usize;
        let Policy::Arc {
            t1,
            t2,
            b1,
            b2,
            target,
            ghost_key,
            ..
        } = &mut self.policy
        else {
            unreachable!("paper ARC")
        };
        let oldest = |list: &[Key]| list.iter().find(|k| has(evictable, k)).cloned();
        let mut victims = Vec::new();
        while victims.len() < n {
            if ghost_key.is_none() {
                if t1.len() + b1.len() >= c {
                    if b1.is_empty() {
                        if let Some(v) = oldest(t1) {
                            take(t1, &v);
                            victims.push(v);
                            continue;
                        }
                    } else {
                        b1.remove(0);
                    }
                } else if t1.len() + t2.len() + b1.len() + b2.len() >= 2 * c && !b2.is_empty() {
                    b2.remove(0);
                }
            }
            let in_b2 = ghost_key.as_ref().is_some_and(|g| g.1);
            let len1 = t1.len() as f64;
            let from_t1 =
                (!t1.is_empty() && (len1 > *target || (len1 == *target && in_b2))) || t2.is_empty();
            let pick1 = oldest(t1);
            let pick2 = oldest(t2);
            let (v, into_b1) = match (from_t1, pick1, pick2) {
                (true, Some(v), _) | (false, Some(v), None) => (v, true),
                (_, _, Some(v)) => (v, false),
                _ => panic!("model arc-paper: no victim"),
            };
            if into_b1 {
                take(t1, &v);
                b1.push(v.clone());
            } else {
                take(t2, &v);
                b2.push(v.clone());
            }
            victims.push(v);
        }
        victims
    }
}
