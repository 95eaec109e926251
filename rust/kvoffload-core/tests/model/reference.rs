//! A deliberately naive second implementation of the manager, written from SPEC.md alone.
//!
//! Everything is a plain `Vec` scanned linearly: the resident chunks (in no particular order),
//! the ARC lists (oldest first, a move is `remove` + `push`), the tracker (oldest first) and the
//! request state (lists of keys). There are no indexes and no running counts that could drift:
//! every count is recomputed from the lists when it is needed. The other policies' models
//! (`reference_policies.rs`) are as plain. Outputs use the crate's plain data types (`Lookup`,
//! `StoreOutcome`, `Event`, `RawStats`) so the test can compare them.

#[path = "reference_policies.rs"]
mod policies;
#[path = "reference_policy.rs"]
mod policy;

pub(crate) use policies::View;

use kvoffload_core::{ChunkId, Event, KeyBuf, Lookup, PolicyKind, RawStats, StoreOutcome};
use policies::Own;

/// Key bytes.
pub(crate) type Key = Vec<u8>;

/// Why the model refuses a call (mirrors the `CoreError` variants a call can return).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    InvalidArgument,
    KeyState,
    DuplicateKey,
    RequestFinished,
}

/// One resident chunk. `refs`: -1 pending, 0 ready, n > 0 pinned by n loads.
#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    pub(crate) id: ChunkId,
    pub(crate) key: Key,
    pub(crate) refs: i32,
    /// LRU only: `(major, minor)`.
    pub(crate) rank: (u64, i64),
}

/// The cache policy's own state (the LRU ranks live in the chunks).
#[derive(Debug, Clone)]
pub(crate) enum Policy {
    Lru {
        /// The next rank to issue (ranks start at 0).
        counter: u64,
    },
    /// vLLM's ARC, or (`paper`) the FAST 2003 paper's as libCacheSim implements it.
    Arc {
        t1: Vec<Key>,
        t2: Vec<Key>,
        b1: Vec<Key>,
        b2: Vec<Key>,
        target: f64,
        /// The paper's ARC rather than vLLM's.
        paper: bool,
        /// Paper: the first ghost of the last store miss report and whether it was in B2,
        /// until that key is inserted (or the next report).
        ghost_key: Option<(Key, bool)>,
    },
    /// FIFO, SIEVE, S3-FIFO, 2Q, SLRU or LFU (`reference_policies.rs`).
    Own(Own),
}

impl Policy {
    /// An empty policy of `kind` for `num_chunks` chunks.
    fn new(kind: PolicyKind, num_chunks: u32) -> Self {
        match kind {
            PolicyKind::Lru => Policy::Lru { counter: 0 },
            PolicyKind::Arc | PolicyKind::ArcPaper => Policy::Arc {
                t1: Vec::new(),
                t2: Vec::new(),
                b1: Vec::new(),
                b2: Vec::new(),
                target: 0.0,
                paper: kind == PolicyKind::ArcPaper,
                ghost_key: None,
            },
            other => Policy::Own(Own::new(other, num_chunks).expect("one of the own policies")),
        }
    }

    /// Its kind.
    fn kind(&self) -> PolicyKind {
        match self {
            Policy::Lru { .. } => PolicyKind::Lru,
            Policy::Arc { paper: false, .. } => PolicyKind::Arc,
            Policy::Arc { paper: true, .. } => PolicyKind::ArcPaper,
            Policy::Own(o) => o.kind(),
        }
    }
}

/// What one request did since its cache generation began (SPEC "Request state").
#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub(crate) generation: u64,
    pub(crate) finished: bool,
    /// First-seen order.
    pub(crate) seen: Vec<Key>,
    inserted: Vec<Key>,
    reused: Vec<Key>,
    reported: Vec<Key>,
    /// LRU: the request rank, taken at the first `on_request_access`.
    rank: Option<u64>,
}

/// The naive manager.
#[derive(Debug, Clone)]
pub(crate) struct Model {
    num_chunks: u32,
    events_on: bool,
    threshold: u64,
    tracker_cap: usize,
    pub(crate) chunks: Vec<Chunk>,
    /// Ids `0..fresh` were handed out since the last reset.
    fresh: u32,
    /// Freed ids; the last one is handed out next.
    free: Vec<ChunkId>,
    pub(crate) policy: Policy,
    /// `(key, offers)`, oldest first; `None` when `threshold < 2`.
    tracker: Option<Vec<(Key, u64)>>,
    events: Vec<Event>,
    samples: Vec<u64>,
    skipped: u64,
    generation: u64,
}

fn has(list: &[Key], key: &[u8]) -> bool {
    list.iter().any(|k| k.as_slice() == key)
}

/// Remove `key` from `list`; whether it was there.
fn take(list: &mut Vec<Key>, key: &[u8]) -> bool {
    match list.iter().position(|k| k.as_slice() == key) {
        Some(i) => {
            list.remove(i);
            true
        }
        None => false,
    }
}

/// LRU: take the next rank from the counter.
fn issue(counter: &mut u64) -> u64 {
    *counter += 1;
    *counter - 1
}

fn buf(key: &[u8]) -> KeyBuf {
    KeyBuf::from_slice(key)
}

/// The KV group: the last 4 bytes, big-endian.
fn group(key: &[u8]) -> u32 {
    let tail: [u8; 4] = key[key.len() - 4..].try_into().unwrap();
    u32::from_be_bytes(tail)
}

/// SPEC "Admission tracker": pass 1 counts and refreshes tracked keys, pass 2 adds the rest,
/// dropping the oldest entry that is not part of this offer when full.
fn count_offer(table: &mut Vec<(Key, u64)>, cap: usize, offer: &[Key]) {
    for key in offer {
        if let Some(i) = table.iter().position(|(k, _)| k == key) {
            let (k, n) = table.remove(i);
            table.push((k, n + 1));
        }
    }
    for key in offer {
        if table.iter().any(|(k, _)| k == key) {
            continue;
        }
        if table.len() >= cap {
            match table.iter().position(|(k, _)| !offer.contains(k)) {
                Some(i) => {
                    table.remove(i);
                }
                None => continue,
            }
        }
        table.push((key.clone(), 1));
    }
}

impl Model {
    pub(crate) fn new(
        num_chunks: u32,
        kind: PolicyKind,
        events_on: bool,
        threshold: u64,
        tracker_cap: usize,
    ) -> Self {
        let policy = Policy::new(kind, num_chunks);
        Self {
            num_chunks,
            events_on,
            threshold,
            tracker_cap,
            chunks: Vec::new(),
            fresh: 0,
            free: Vec::new(),
            policy,
            tracker: (threshold >= 2).then(Vec::new),
            events: Vec::new(),
            samples: Vec::new(),
            skipped: 0,
            generation: 0,
        }
    }

    // --- request state ---

    pub(crate) fn new_request(&self) -> Req {
        Req {
            generation: self.generation,
            finished: false,
            seen: Vec::new(),
            inserted: Vec::new(),
            reused: Vec::new(),
            reported: Vec::new(),
            rank: None,
        }
    }

    pub(crate) fn is_current(&self, req: &Req) -> bool {
        req.generation == self.generation
    }

    /// What the binding does before a recording call: stale state is replaced by fresh state.
    pub(crate) fn refresh(&self, req: &mut Req) {
        if !self.is_current(req) {
            *req = self.new_request();
        }
    }

    // --- views ---

    fn find(&self, key: &[u8]) -> Option<usize> {
        self.chunks.iter().position(|c| c.key.as_slice() == key)
    }

    fn by_id(&self) -> Vec<&Chunk> {
        let mut v: Vec<&Chunk> = self.chunks.iter().collect();
        v.sort_by_key(|c| c.id);
        v
    }

    /// `(key, chunk, ref count)` by chunk id.
    pub(crate) fn resident(&self) -> Vec<(Key, ChunkId, i32)> {
        self.by_id()
            .into_iter()
            .map(|c| (c.key.clone(), c.id, c.refs))
            .collect()
    }

    /// Keys with the given ref-count property, by chunk id.
    pub(crate) fn keys_where(&self, pred: impl Fn(i32) -> bool) -> Vec<Key> {
        self.by_id()
            .into_iter()
            .filter(|c| pred(c.refs))
            .map(|c| c.key.clone())
            .collect()
    }

    pub(crate) fn refs_of(&self, key: &[u8]) -> Option<i32> {
        self.find(key).map(|i| self.chunks[i].refs)
    }

    pub(crate) fn pool(&self) -> (u32, Vec<ChunkId>) {
        (self.fresh, self.free.clone())
    }

    pub(crate) fn tracker(&self) -> Option<Vec<(Key, u64)>> {
        self.tracker.clone()
    }

    /// Own policies: the order, keys in place of chunk ids.
    pub(crate) fn own_view(&self) -> Option<View> {
        let Policy::Own(o) = &self.policy else {
            return None;
        };
        let id = |k: &[u8]| self.chunks[self.find(k).expect("a listed key is resident")].id;
        Some(o.view(&id))
    }

    /// LRU: `(chunk, rank)` by chunk id.
    pub(crate) fn ranks(&self) -> Vec<(ChunkId, (u64, i64))> {
        self.by_id().into_iter().map(|c| (c.id, c.rank)).collect()
    }

    pub(crate) fn lookup(&self, key: &[u8]) -> Lookup {
        match self.refs_of(key) {
            None => Lookup::Miss,
            Some(-1) => Lookup::HitPending,
            Some(_) => Lookup::Hit,
        }
    }

    pub(crate) fn lookup_prefix(&self, keys: &[Key]) -> usize {
        keys.iter()
            .take_while(|k| self.lookup(k) == Lookup::Hit)
            .count()
    }

    /// For each key of an offer: would `prepare_store` record it for the request (a candidate
    /// that passes the threshold, or a readable key)?
    pub(crate) fn store_records(&self, keys: &[Key]) -> Vec<bool> {
        let mut table = self.tracker.clone();
        if let Some(t) = &mut table {
            count_offer(t, self.tracker_cap, keys);
        }
        keys.iter()
            .map(|k| match self.refs_of(k) {
                None => match &table {
                    None => true,
                    Some(t) => t
                        .iter()
                        .find(|(tk, _)| tk == k)
                        .is_some_and(|&(_, n)| n >= self.threshold),
                },
                Some(r) => r >= 0,
            })
            .collect()
    }

    // --- calls ---

    pub(crate) fn prepare_load(
        &mut self,
        keys: &[Key],
        positions: &[Option<i64>],
        req: &mut Req,
    ) -> Result<Vec<ChunkId>, Refusal> {
        if positions.len() != keys.len() {
            return Err(Refusal::InvalidArgument);
        }
        for k in keys {
            match self.refs_of(k) {
                None | Some(-1) => return Err(Refusal::KeyState),
                Some(_) => {}
            }
        }
        if req.finished && keys.iter().any(|k| !has(&req.seen, k)) {
            return Err(Refusal::RequestFinished);
        }
        let ids = self.pin(keys);
        let accessed: Vec<(Key, Option<i64>)> = keys
            .iter()
            .cloned()
            .zip(positions.iter().copied())
            .collect();
        self.record(req, &accessed, keys);
        Ok(ids)
    }

    /// `prepare_load` for another tier's copy: the same pins, and no request records a key.
    pub(crate) fn prepare_read(&mut self, keys: &[Key]) -> Result<Vec<ChunkId>, Refusal> {
        if keys
            .iter()
            .any(|k| matches!(self.refs_of(k), None | Some(-1)))
        {
            return Err(Refusal::KeyState);
        }
        Ok(self.pin(keys))
    }

    /// One more pin of each key (all readable); their chunk ids.
    fn pin(&mut self, keys: &[Key]) -> Vec<ChunkId> {
        let mut ids = Vec::new();
        for k in keys {
            let i = self.find(k).unwrap();
            self.chunks[i].refs += 1;
            ids.push(self.chunks[i].id);
        }
        ids
    }

    pub(crate) fn complete_load(&mut self, keys: &[Key]) -> Result<(), Refusal> {
        for k in keys {
            let times = keys.iter().filter(|o| *o == k).count() as i32;
            match self.refs_of(k) {
                Some(n) if n >= times => {}
                _ => return Err(Refusal::KeyState),
            }
        }
        for k in keys {
            let i = self.find(k).unwrap();
            self.chunks[i].refs -= 1;
            if self.chunks[i].refs == 0 {
                self.mark_evictable(k);
            }
        }
        Ok(())
    }

    pub(crate) fn prepare_store(
        &mut self,
        keys: &[Key],
        positions: &[Option<i64>],
        req: &mut Req,
    ) -> Result<Option<StoreOutcome>, Refusal> {
        if positions.len() != keys.len() {
            return Err(Refusal::InvalidArgument);
        }
        for (i, k) in keys.iter().enumerate() {
            if keys[..i].contains(k) {
                return Err(Refusal::DuplicateKey);
            }
        }
        let records = self.store_records(keys);
        if req.finished && (0..keys.len()).any(|i| records[i] && !has(&req.seen, &keys[i])) {
            return Err(Refusal::RequestFinished);
        }
        // 1: count the whole offer.
        if let Some(t) = &mut self.tracker {
            count_offer(t, self.tracker_cap, keys);
        }
        // 2-3: partition; drop candidates below the threshold.
        let absent: Vec<usize> = (0..keys.len())
            .filter(|&i| self.refs_of(&keys[i]).is_none())
            .collect();
        let candidates: Vec<usize> = absent.iter().copied().filter(|&i| records[i]).collect();
        if self.tracker.is_some() {
            self.skipped += (absent.len() - candidates.len()) as u64;
        }
        let readable: Vec<Key> = (0..keys.len())
            .filter(|&i| self.refs_of(&keys[i]).is_some_and(|r| r >= 0))
            .map(|i| keys[i].clone())
            .collect();
        // 4: misses this request has not reported.
        let misses: Vec<Key> = candidates
            .iter()
            .map(|&i| keys[i].clone())
            .filter(|k| !has(&req.reported, k))
            .collect();
        if !misses.is_empty() {
            self.on_store_miss(&misses);
            req.reported.extend(misses);
        }
        // 5: record candidates and readable keys, in offer order.
        let accessed: Vec<(Key, Option<i64>)> = (0..keys.len())
            .filter(|&i| records[i])
            .map(|i| (keys[i].clone(), positions[i]))
            .collect();
        self.record(req, &accessed, &readable);
        // 6-7.
        if candidates.is_empty() {
            return Ok(Some(StoreOutcome::default()));
        }
        self.samples.push(candidates.len() as u64);
        // 8: make room.
        let free = self.free.len() + (self.num_chunks - self.fresh) as usize;
        let mut evicted = Vec::new();
        let mut evicted_chunks = Vec::new();
        if candidates.len() > free {
            let shortfall = candidates.len() - free;
            if shortfall > self.chunks.iter().filter(|c| c.refs == 0).count() {
                return Ok(None);
            }
            let Some(victims) = self.evict(shortfall, keys) else {
                return Ok(None);
            };
            // 9: drop the victims, free their chunks in eviction order, one event.
            for v in &victims {
                let i = self.find(v).unwrap();
                let c = self.chunks.remove(i);
                self.free.push(c.id);
                evicted.push(buf(v));
                evicted_chunks.push(c.id);
            }
            if self.events_on {
                self.events.push(Event {
                    keys: evicted.clone(),
                    chunks: Vec::new(),
                    positions: Vec::new(),
                    removed: true,
                    metadata_only: false,
                });
            }
        }
        let ids = self.allocate(candidates.len());
        for (&i, &id) in candidates.iter().zip(&ids) {
            self.insert(id, &keys[i], positions[i], req);
            if !has(&req.inserted, &keys[i]) {
                req.inserted.push(keys[i].clone());
            }
        }
        Ok(Some(StoreOutcome {
            to_store: candidates,
            chunks: ids,
            evicted,
            evicted_chunks,
        }))
    }

    /// SPEC `complete_store`; returns the chunks freed by a failure.
    pub(crate) fn complete_store(&mut self, keys: &[Key], success: bool) -> Vec<u32> {
        let mut done = Vec::new();
        let mut freed = Vec::new();
        for k in keys {
            let Some(i) = self.find(k) else { continue };
            if self.chunks[i].refs != -1 {
                continue;
            }
            if success {
                self.chunks[i].refs = 0;
                self.mark_evictable(k);
            } else {
                let c = self.chunks.remove(i);
                self.remove(k);
                self.free.push(c.id);
                freed.push(c.id);
            }
            done.push(buf(k));
        }
        if self.events_on && !done.is_empty() {
            self.events.push(Event {
                keys: done,
                chunks: Vec::new(),
                positions: Vec::new(),
                removed: !success,
                metadata_only: !success,
            });
        }
        freed
    }

    /// SPEC `on_request_finished`; `position` is read from the request context now.
    pub(crate) fn on_request_finished(
        &mut self,
        req: &mut Req,
        position: &dyn Fn(&[u8]) -> Option<i64>,
    ) {
        if !self.is_current(req) || req.finished {
            return;
        }
        req.finished = true;
        let mut groups: Vec<u32> = req.seen.iter().map(|k| group(k)).collect();
        groups.sort_unstable();
        groups.dedup();
        let mut list: Vec<Key> = Vec::new();
        for g in groups {
            let mut keys: Vec<Key> = req.seen.iter().filter(|k| group(k) == g).cloned().collect();
            if keys.iter().all(|k| position(k).is_some()) {
                keys.sort_by_key(|k| position(k)); // stable
            }
            list.extend(keys);
        }
        if list.iter().all(|k| position(k).is_some()) {
            list.sort_by_key(|k| position(k)); // stable
        }
        self.finished(req, &list);
    }

    pub(crate) fn reset_cache(&mut self) {
        self.chunks.clear();
        self.fresh = 0;
        self.free.clear();
        self.policy = Policy::new(self.policy.kind(), self.num_chunks);
        self.generation += 1;
    }

    pub(crate) fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    pub(crate) fn take_stats(&mut self) -> RawStats {
        RawStats {
            num_chunks: self.num_chunks,
            num_used: self.chunks.iter().filter(|c| c.refs != 0).count(),
            num_pending: self.chunks.iter().filter(|c| c.refs == -1).count(),
            allocation_sizes: std::mem::take(&mut self.samples),
            stores_skipped: self
                .tracker
                .is_some()
                .then(|| std::mem::take(&mut self.skipped)),
        }
    }

    // --- internals ---

    /// Never-used ids ascending, then freed ids last-freed first.
    fn allocate(&mut self, n: usize) -> Vec<ChunkId> {
        let mut ids = Vec::new();
        while ids.len() < n && self.fresh < self.num_chunks {
            ids.push(self.fresh);
            self.fresh += 1;
        }
        while ids.len() < n {
            ids.push(self.free.pop().unwrap());
        }
        ids
    }

    /// SPEC "Request state": note first-seen keys (they go to `on_request_access`), then mark
    /// `reused` keys unless this request inserted them.
    fn record(&mut self, req: &mut Req, accessed: &[(Key, Option<i64>)], reused: &[Key]) {
        let mut new: Vec<(Key, Option<i64>)> = Vec::new();
        for (k, p) in accessed {
            if !has(&req.seen, k) {
                req.seen.push(k.clone());
                new.push((k.clone(), *p));
            }
        }
        if !new.is_empty() {
            self.on_request_access(req, &new);
        }
        for k in reused {
            if !has(&req.inserted, k) && !has(&req.reused, k) {
                req.reused.push(k.clone());
            }
        }
    }
}
