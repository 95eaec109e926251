//! The harness: one crate `Manager` and one naive `Model` driven by the same operations, with
//! every result and every observable piece of state compared after each operation.
//!
//! Operations name keys and picks by small indices; the harness resolves them against the
//! model's state (equal to the crate's, as checked after every step) so that calls are legal:
//! loads only of readable keys, load completions only of pinned ones, finished requests only
//! recording keys they saw. `Op::Illegal` builds a call that must be refused and checks that
//! the refusal changed nothing.

#[path = "check.rs"]
mod check;
#[path = "illegal.rs"]
mod illegal;

pub(crate) use illegal::Illegal;

use super::reference::{Key, Model, Refusal, Req};
use kvoffload_core::{CoreError, Hints, Manager, ManagerConfig, PolicyKind, RequestState};

/// Length of a position table: 16 block hashes x 2 groups; block `h`, `g`-th group at `2h + g`.
pub(crate) const MAX_KEYS: usize = 32;

/// One manager configuration plus the requests' initial token positions.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) num_chunks: u32,
    pub(crate) policy: PolicyKind,
    pub(crate) events: bool,
    pub(crate) threshold: u64,
    pub(crate) tracker: usize,
    /// Distinct block hashes (1..=16).
    pub(crate) hashes: u8,
    /// The KV group indices in use (1 or 2 of them).
    pub(crate) groups: Vec<u32>,
    /// Request slots, each with its position table (`MAX_KEYS` long).
    pub(crate) positions: Vec<Vec<Option<i64>>>,
}

/// One step. `u8` values are indices, reduced modulo whatever list they pick from.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Lookup(u8),
    LookupPrefix(Vec<u8>),
    /// Load keys picked from the readable ones (for a finished request: those it saw).
    Load {
        req: u8,
        picks: Vec<u8>,
        explicit: bool,
    },
    /// Pin keys picked from the readable ones for another tier's copy (`prepare_read`): no
    /// request records them; the pins are completed as a load's.
    Read(Vec<u8>),
    /// Complete one load job in flight (`whole_job`, picked by the first pick), or loads of
    /// keys drawn from all jobs' pins (a key at most as often as it is pinned).
    CompleteLoad {
        whole_job: bool,
        picks: Vec<u8>,
    },
    Touch(Vec<u8>),
    /// Offer keys, repeats dropped (and, for a finished request, the new keys it would record).
    Store {
        req: u8,
        keys: Vec<u8>,
        explicit: bool,
    },
    /// Complete one store job in flight (`whole_job`), or stores of keys picked mostly from
    /// the pending ones (values < 192), else any key (those are ignored).
    CompleteStore {
        whole_job: bool,
        picks: Vec<u8>,
        success: bool,
    },
    /// Finish the request; with `renew` the slot then holds a new request (same positions).
    Finish {
        req: u8,
        renew: bool,
    },
    /// The slot's request is replaced by a new request with these positions.
    NewRequest {
        req: u8,
        positions: Vec<Option<i64>>,
    },
    /// The request's context now reports this position for the key.
    SetPosition {
        req: u8,
        key: u8,
        position: Option<i64>,
    },
    Reset,
    TakeEvents,
    TakeStats,
    Illegal {
        kind: Illegal,
        req: u8,
        picks: Vec<u8>,
    },
}

struct Slot {
    state: RequestState,
    model: Req,
    positions: Vec<Option<i64>>,
}

pub(crate) struct Harness {
    mgr: Manager,
    model: Model,
    keys: Vec<Key>,
    groups: Vec<u32>,
    slots: Vec<Slot>,
    /// Keys of each load in flight; together they are exactly the pins.
    load_jobs: Vec<Vec<Key>>,
    /// Keys of each store in flight (completions may also come piecemeal or not at all).
    store_jobs: Vec<Vec<Key>>,
    /// Steps run, for failure messages.
    step: usize,
}

/// Each key's chunk, if resident.
fn chunks_of(mgr: &Manager, keys: &[Key]) -> Vec<Option<u32>> {
    let resident = mgr.resident();
    keys.iter()
        .map(|k| {
            resident
                .iter()
                .find(|(r, _, _)| r.as_slice() == k.as_slice())
                .map(|&(_, c, _)| c)
        })
        .collect()
}

/// Guesses of the keys' chunks for the hinted calls, varied by `salt`: none at all, or per
/// key none, the right chunk, another chunk, or an id past every chunk. The results must not
/// depend on them.
fn hints(mgr: &Manager, keys: &[Key], salt: usize) -> Vec<Option<u32>> {
    if salt % 5 == 0 {
        return Vec::new();
    }
    chunks_of(mgr, keys)
        .into_iter()
        .enumerate()
        .map(|(i, c)| match (i + salt) % 4 {
            0 => None,
            1 => c,
            2 => Some(c.map_or(0, |c| c + 1)),
            _ => Some(u32::MAX - 1),
        })
        .collect()
}

/// Guesses a caller may vouch for ([`Hints::vouched`]), varied by `salt`: per key its
/// chunk, none, or a chunk that holds no key (a free one, or an id past every chunk). Never a
/// chunk that holds another key.
fn vouched_hints(mgr: &Manager, keys: &[Key], salt: usize) -> Vec<Option<u32>> {
    let taken: Vec<u32> = mgr.resident().iter().map(|&(_, c, _)| c).collect();
    let free = (0..u32::MAX - 1)
        .find(|c| !taken.contains(c))
        .unwrap_or(u32::MAX - 1);
    chunks_of(mgr, keys)
        .into_iter()
        .enumerate()
        .map(|(i, c)| match ((i + salt) % 6, c) {
            (0..=2, Some(c)) => Some(c),
            (3, _) => None,
            (4, _) => Some(free),
            _ => Some(u32::MAX - 1),
        })
        .collect()
}

/// Whether a hinted call vouches for its guesses (one call in three).
fn vouches(salt: usize) -> bool {
    salt % 3 == 1
}

/// The guesses of a hinted call varied by `salt`: vouched for or to check.
fn guesses(mgr: &Manager, keys: &[Key], salt: usize) -> Vec<Option<u32>> {
    if vouches(salt) {
        vouched_hints(mgr, keys, salt)
    } else {
        hints(mgr, keys, salt)
    }
}

/// `chunks` as the hints of a call varied by `salt` (see [`guesses`]).
fn hinted(chunks: &[Option<u32>], salt: usize) -> Hints<'_> {
    Hints {
        chunks,
        vouched: vouches(salt),
    }
}

fn refs(keys: &[Key]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

fn refusal(e: &CoreError) -> Refusal {
    match e {
        CoreError::InvalidArgument(_) => Refusal::InvalidArgument,
        CoreError::KeyState(_) => Refusal::KeyState,
        CoreError::DuplicateKey(_) => Refusal::DuplicateKey,
        CoreError::RequestFinished(_) => Refusal::RequestFinished,
        other => panic!("unexpected error {other:?}"),
    }
}

/// Pick from `list` by each index (modulo its length); empty when `list` is.
fn pick(list: &[Key], picks: &[u8]) -> Vec<Key> {
    if list.is_empty() {
        return Vec::new();
    }
    picks
        .iter()
        .map(|&p| list[p as usize % list.len()].clone())
        .collect()
}

fn dedup(keys: Vec<Key>) -> Vec<Key> {
    let mut out: Vec<Key> = Vec::new();
    for k in keys {
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

impl Harness {
    pub(crate) fn new(cfg: &Config) -> Self {
        let mgr = Manager::new(&ManagerConfig {
            num_chunks: cfg.num_chunks,
            policy: cfg.policy,
            enable_events: cfg.events,
            store_threshold: cfg.threshold,
            max_tracker_size: cfg.tracker,
            admission: kvoffload_core::Admission::default(),
        })
        .expect("valid config");
        let model = Model::new(
            cfg.num_chunks,
            cfg.policy,
            cfg.events,
            cfg.threshold,
            cfg.tracker,
        );
        let mut keys = Vec::new();
        for h in 0..cfg.hashes {
            for g in &cfg.groups {
                let mut k = vec![b'k', b'0' + h];
                k.extend_from_slice(&g.to_be_bytes());
                keys.push(k);
            }
        }
        let slots = cfg
            .positions
            .iter()
            .map(|p| Slot {
                state: mgr.new_request_state(),
                model: model.new_request(),
                positions: p.clone(),
            })
            .collect();
        let h = Self {
            mgr,
            model,
            keys,
            groups: cfg.groups.clone(),
            slots,
            load_jobs: Vec::new(),
            store_jobs: Vec::new(),
            step: 0,
        };
        h.check();
        h
    }

    /// Run `ops` in order, checking after each, then drain and compare events and stats.
    pub(crate) fn run(cfg: &Config, ops: &[Op]) {
        let mut h = Self::new(cfg);
        for op in ops.iter().chain(&[Op::TakeEvents, Op::TakeStats]) {
            h.apply(op);
        }
    }

    fn slot(&self, req: u8) -> usize {
        req as usize % self.slots.len()
    }

    fn key(&self, i: u8) -> Key {
        self.keys[i as usize % self.keys.len()].clone()
    }

    fn position(&self, slot: usize, key: &[u8]) -> Option<i64> {
        self.table_index(key)
            .and_then(|i| self.slots[slot].positions[i])
    }

    /// Where a key's position is in a position table (`None` for the outsider).
    fn table_index(&self, key: &[u8]) -> Option<usize> {
        if key[0] != b'k' {
            return None;
        }
        let group = u32::from_be_bytes(key[2..6].try_into().unwrap());
        let g = self.groups.iter().position(|&x| x == group).unwrap();
        Some(2 * usize::from(key[1] - b'0') + g)
    }

    fn positions(&self, slot: usize, keys: &[Key]) -> Vec<Option<i64>> {
        keys.iter().map(|k| self.position(slot, k)).collect()
    }

    /// The binding replaces stale state before a recording call.
    fn refresh(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        assert_eq!(
            self.mgr.is_current(&s.state),
            self.model.is_current(&s.model)
        );
        if !self.mgr.is_current(&s.state) {
            s.state = self.mgr.new_request_state();
        }
        self.model.refresh(&mut s.model);
    }

    fn seen(&self, slot: usize) -> &[Key] {
        &self.slots[slot].model.seen
    }

    fn finished(&self, slot: usize) -> bool {
        self.slots[slot].model.finished
    }

    /// The pins in flight, one entry per pin.
    fn pins(&self) -> Vec<Key> {
        let mut out = Vec::new();
        for k in self.model.keys_where(|r| r > 0) {
            for _ in 0..self.model.refs_of(&k).unwrap() {
                out.push(k.clone());
            }
        }
        out
    }

    /// Draw pins without replacement: each key at most as often as it is pinned.
    fn draw_pins(&self, picks: &[u8]) -> Vec<Key> {
        let mut pins = self.pins();
        let mut keys = Vec::new();
        for &p in picks {
            if pins.is_empty() {
                break;
            }
            keys.push(pins.remove(p as usize % pins.len()));
        }
        keys
    }

    fn load(&mut self, slot: usize, keys: &[Key], explicit: bool) {
        self.refresh(slot);
        let pos = self.positions(slot, keys);
        let pass = explicit || pos.iter().any(Option::is_some);
        let s = &mut self.slots[slot];
        let got = self
            .mgr
            .prepare_load(&refs(keys), pass.then_some(&pos[..]), &mut s.state);
        let want = self.model.prepare_load(keys, &pos, &mut s.model);
        assert_eq!(got.map_err(|e| refusal(&e)), want, "prepare_load {keys:?}");
        if want.is_ok() {
            self.load_jobs.push(keys.to_vec());
        }
    }

    fn store(&mut self, slot: usize, keys: &[Key], explicit: bool) {
        self.refresh(slot);
        let pos = self.positions(slot, keys);
        let pass = explicit || pos.iter().any(Option::is_some);
        let s = &mut self.slots[slot];
        let got = self
            .mgr
            .prepare_store(&refs(keys), pass.then_some(&pos[..]), &mut s.state);
        let want = self.model.prepare_store(keys, &pos, &mut s.model);
        assert_eq!(got.map_err(|e| refusal(&e)), want, "prepare_store {keys:?}");
        if let Ok(Some(out)) = want {
            if !out.to_store.is_empty() {
                self.store_jobs
                    .push(out.to_store.iter().map(|&i| keys[i].clone()).collect());
            }
        }
    }

    fn finish(&mut self, slot: usize) {
        let pos: Vec<Option<i64>> = self.slots[slot]
            .state
            .seen_keys()
            .map(|k| self.position(slot, k))
            .collect();
        let by_key: Vec<(Key, Option<i64>)> = self
            .keys
            .iter()
            .map(|k| (k.clone(), self.position(slot, k)))
            .collect();
        let lookup = |k: &[u8]| {
            by_key
                .iter()
                .find(|(bk, _)| bk.as_slice() == k)
                .and_then(|(_, p)| *p)
        };
        let s = &mut self.slots[slot];
        self.mgr
            .on_request_finished(&mut s.state, &pos)
            .expect("on_request_finished");
        self.model.on_request_finished(&mut s.model, &lookup);
    }

    /// Keys the request may load: the readable ones (a finished request: those it saw).
    fn loadable(&self, slot: usize) -> Vec<Key> {
        let mut readable = self.model.keys_where(|r| r >= 0);
        if self.model.is_current(&self.slots[slot].model) && self.finished(slot) {
            readable.retain(|k| self.seen(slot).contains(k));
        }
        readable
    }

    /// A whole load job, or pins drawn from all jobs; the keys leave their jobs.
    fn take_loads(&mut self, whole_job: bool, picks: &[u8]) -> Vec<Key> {
        if whole_job && !self.load_jobs.is_empty() {
            let p = picks.first().copied().unwrap_or(0) as usize;
            return self.load_jobs.remove(p % self.load_jobs.len());
        }
        let mut keys = Vec::new();
        for &p in picks {
            let total: usize = self.load_jobs.iter().map(Vec::len).sum();
            if total == 0 {
                break;
            }
            let mut at = p as usize % total;
            let j = self
                .load_jobs
                .iter()
                .position(|job| {
                    let here = at < job.len();
                    if !here {
                        at -= job.len();
                    }
                    here
                })
                .unwrap();
            keys.push(self.load_jobs[j].remove(at));
        }
        self.load_jobs.retain(|job| !job.is_empty());
        keys
    }

    /// The offer of key indices, without repeats; a finished request keeps only keys it would
    /// not record or has seen.
    fn offer(&self, slot: usize, picks: &[u8]) -> Vec<Key> {
        let mut keys = dedup(picks.iter().map(|&i| self.key(i)).collect());
        if self.model.is_current(&self.slots[slot].model) && self.finished(slot) {
            let records = self.model.store_records(&keys);
            let seen = self.seen(slot);
            let keep: Vec<bool> = (0..keys.len())
                .map(|i| !records[i] || seen.contains(&keys[i]))
                .collect();
            let mut i = 0;
            keys.retain(|_| {
                i += 1;
                keep[i - 1]
            });
        }
        keys
    }

    /// A whole store job, or keys picked mostly from the pending ones (values < 192).
    fn take_stores(&mut self, whole_job: bool, picks: &[u8]) -> Vec<Key> {
        if whole_job && !self.store_jobs.is_empty() {
            let p = picks.first().copied().unwrap_or(0) as usize;
            return self.store_jobs.remove(p % self.store_jobs.len());
        }
        let pending = self.model.keys_where(|r| r < 0);
        picks
            .iter()
            .map(|&p| {
                if p < 192 && !pending.is_empty() {
                    pending[p as usize % pending.len()].clone()
                } else {
                    self.key(p)
                }
            })
            .collect()
    }

    /// `complete_store` of some of the stores in flight, on both sides, with chunk guesses.
    fn complete_store(&mut self, whole_job: bool, picks: &[u8], success: bool) {
        let keys = self.take_stores(whole_job, picks);
        let salt = picks.len() + usize::from(success);
        let chunks = guesses(&self.mgr, &keys, salt);
        let freed = self
            .mgr
            .complete_store_hinted(&refs(&keys), hinted(&chunks, salt), success);
        assert_eq!(
            freed,
            self.model.complete_store(&keys, success),
            "freed chunks"
        );
    }

    /// `complete_load` of some of the loads in flight, on both sides, with chunk guesses.
    fn complete_load(&mut self, whole_job: bool, picks: &[u8]) {
        let keys = self.take_loads(whole_job, picks);
        let chunks = guesses(&self.mgr, &keys, picks.len());
        let got = self
            .mgr
            .complete_load_hinted(&refs(&keys), hinted(&chunks, picks.len()));
        let want = self.model.complete_load(&keys);
        assert_eq!(got.map_err(|e| refusal(&e)), want, "complete_load {keys:?}");
    }

    /// `touch` of any keys, on both sides, with chunk guesses.
    fn touch(&mut self, picks: &[u8]) {
        let keys: Vec<Key> = picks.iter().map(|&i| self.key(i)).collect();
        let chunks = guesses(&self.mgr, &keys, picks.len());
        self.mgr
            .touch_hinted(&refs(&keys), hinted(&chunks, picks.len()));
        self.model.touch(&keys);
    }

    pub(crate) fn apply(&mut self, op: &Op) {
        self.step += 1;
        match op {
            Op::Lookup(i) => {
                let k = self.key(*i);
                assert_eq!(self.mgr.lookup(&k), self.model.lookup(&k));
            }
            Op::LookupPrefix(picks) => {
                let keys: Vec<Key> = picks.iter().map(|&i| self.key(i)).collect();
                assert_eq!(
                    self.mgr.lookup_prefix(&refs(&keys)),
                    self.model.lookup_prefix(&keys)
                );
            }
            Op::Load {
                req,
                picks,
                explicit,
            } => {
                let slot = self.slot(*req);
                let keys = pick(&self.loadable(slot), picks);
                if !keys.is_empty() {
                    self.load(slot, &keys, *explicit);
                }
            }
            Op::Read(picks) => {
                let keys = pick(&self.model.keys_where(|r| r >= 0), picks);
                if !keys.is_empty() {
                    let got = self.mgr.prepare_read(&refs(&keys));
                    let want = self.model.prepare_read(&keys);
                    assert_eq!(got.map_err(|e| refusal(&e)), want, "prepare_read {keys:?}");
                    if want.is_ok() {
                        self.load_jobs.push(keys);
                    }
                }
            }
            Op::CompleteLoad { whole_job, picks } => self.complete_load(*whole_job, picks),
            Op::Touch(picks) => self.touch(picks),
            Op::Store {
                req,
                keys,
                explicit,
            } => {
                let slot = self.slot(*req);
                let keys = self.offer(slot, keys);
                self.store(slot, &keys, *explicit);
            }
            Op::CompleteStore {
                whole_job,
                picks,
                success,
            } => self.complete_store(*whole_job, picks, *success),
            Op::Finish { req, renew } => {
                let slot = self.slot(*req);
                self.finish(slot);
                if *renew {
                    let s = &mut self.slots[slot];
                    s.state = self.mgr.new_request_state();
                    s.model = self.model.new_request();
                }
            }
            Op::NewRequest { req, positions } => {
                let slot = self.slot(*req);
                self.slots[slot] = Slot {
                    state: self.mgr.new_request_state(),
                    model: self.model.new_request(),
                    positions: positions.clone(),
                };
            }
            Op::SetPosition { req, key, position } => {
                let slot = self.slot(*req);
                let i = self.table_index(&self.key(*key)).unwrap();
                self.slots[slot].positions[i] = *position;
            }
            Op::Reset => {
                self.mgr.reset_cache();
                self.model.reset_cache();
                // The engine never delivers completions of jobs issued before a reset.
                self.load_jobs.clear();
                self.store_jobs.clear();
            }
            Op::TakeEvents => {
                assert_eq!(self.mgr.take_events(), self.model.take_events());
            }
            Op::TakeStats => {
                assert_eq!(self.mgr.take_stats(), self.model.take_stats());
            }
            Op::Illegal { kind, req, picks } => {
                let slot = self.slot(*req);
                self.illegal(*kind, slot, picks);
            }
        }
        self.check();
    }
}
