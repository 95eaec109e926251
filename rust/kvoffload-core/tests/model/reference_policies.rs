//! The model's versions of kvoffload's own policies: FIFO, SIEVE, S3-FIFO, 2Q, SLRU and LFU,
//! each written from the rules of the plain-Python reference (`python/kvoffload/reference/`),
//! not from the crate's code.
//!
//! Everything is a `Vec` of keys scanned linearly. A queue is oldest first; moving a key to a
//! queue's newest end is `take` + `push`, to its oldest end `take` + `insert(0, ..)`. A key that
//! an eviction scan meets while it is not ready (pinned, or its store pending) is *parked*: it
//! leaves its queue's order but still belongs to (and counts in) the queue, and re-enters once
//! it is ready again (see `mark_evictable`). Whether a key is ready is not the policy's own
//! knowledge: the caller passes the ready keys (ref count 0) to `evict`.

use super::{has, take, Key};
use kvoffload_core::{ChunkId, PolicyKind};

/// A policy's observable order with keys in place of chunk ids, as the crate's
/// `PolicyState::Queue` and `PolicyState::Queues` report it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum View {
    /// FIFO and SIEVE: the queue oldest first and the parked keys by chunk id, each with its
    /// visited bit; the key the hand examines next.
    Queue {
        queue: Vec<(Key, bool)>,
        parked: Vec<(Key, bool)>,
        hand: Option<Key>,
    },
    /// The queue-based policies: each queue's linked keys oldest first and parked keys by chunk
    /// id, with a frequency (0 where the policy counts none); ghost keys oldest first.
    Queues {
        names: Vec<&'static str>,
        linked: Vec<Vec<(Key, u8)>>,
        parked: Vec<Vec<(Key, u8)>>,
        ghosts: Vec<Key>,
    },
}

/// Named queues of keys: each queue's linked keys oldest first, and the parked keys with the
/// queue they belong to.
#[derive(Debug, Clone)]
struct Lists {
    linked: Vec<Vec<Key>>,
    parked: Vec<(Key, usize)>,
}

impl Lists {
    fn new(queues: usize) -> Self {
        Self {
            linked: vec![Vec::new(); queues],
            parked: Vec::new(),
        }
    }

    /// The queue `key` belongs to (linked or parked), if any.
    fn queue_of(&self, key: &[u8]) -> Option<usize> {
        if let Some(q) = self.linked.iter().position(|l| has(l, key)) {
            return Some(q);
        }
        self.parked
            .iter()
            .find(|(k, _)| k.as_slice() == key)
            .map(|&(_, q)| q)
    }

    /// Keys of queue `q`, parked ones included.
    fn len(&self, q: usize) -> usize {
        self.linked[q].len() + self.parked.iter().filter(|&&(_, pq)| pq == q).count()
    }

    /// Every key, linked or parked.
    fn count(&self) -> usize {
        self.linked.iter().map(Vec::len).sum::<usize>() + self.parked.len()
    }

    /// Take `key` out (linked or parked); the queue it was in.
    fn remove(&mut self, key: &[u8]) -> Option<usize> {
        for (q, l) in self.linked.iter_mut().enumerate() {
            if take(l, key) {
                return Some(q);
            }
        }
        let i = self.parked.iter().position(|(k, _)| k.as_slice() == key)?;
        Some(self.parked.remove(i).1)
    }

    /// Put `key` (new, or taken from wherever it was) at queue `q`'s newest or oldest end.
    fn move_to(&mut self, key: &[u8], q: usize, newest: bool) {
        self.remove(key);
        if newest {
            self.linked[q].push(key.to_vec());
        } else {
            self.linked[q].insert(0, key.to_vec());
        }
    }

    /// A parked key that is ready again goes back to its queue's oldest end.
    fn unpark(&mut self, key: &[u8]) {
        if let Some(i) = self.parked.iter().position(|(k, _)| k.as_slice() == key) {
            let (k, q) = self.parked.remove(i);
            self.linked[q].insert(0, k);
        }
    }

    /// The oldest ready key of queue `q` not in `skip`; the keys before it that are not ready
    /// are parked.
    fn first_candidate(&mut self, q: usize, ready: &[Key], skip: &[Key]) -> Option<Key> {
        let mut found = None;
        let mut to_park = Vec::new();
        for k in &self.linked[q] {
            if !has(ready, k) {
                to_park.push(k.clone());
            } else if !has(skip, k) {
                found = Some(k.clone());
                break;
            }
        }
        for k in to_park {
            take(&mut self.linked[q], &k);
            self.parked.push((k, q));
        }
        found
    }

    /// Each queue's linked and parked keys (parked by chunk id), with `freq` of each key.
    fn view(
        &self,
        freq: &dyn Fn(&[u8]) -> u8,
        id: &dyn Fn(&[u8]) -> ChunkId,
    ) -> (Vec<Vec<(Key, u8)>>, Vec<Vec<(Key, u8)>>) {
        let linked = self
            .linked
            .iter()
            .map(|l| l.iter().map(|k| (k.clone(), freq(k))).collect())
            .collect();
        let parked = (0..self.linked.len())
            .map(|q| {
                let mut v: Vec<(Key, u8)> = self
                    .parked
                    .iter()
                    .filter(|&&(_, pq)| pq == q)
                    .map(|(k, _)| (k.clone(), freq(k)))
                    .collect();
                v.sort_by_key(|(k, _)| id(k));
                v
            })
            .collect();
        (linked, parked)
    }
}

/// FIFO: every resident key in store order; hits change nothing.
#[derive(Debug, Clone, Default)]
pub(crate) struct Fifo {
    order: Vec<Key>,
}

/// SIEVE: a queue with visited bits, parked keys and a hand.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sieve {
    /// Oldest first.
    queue: Vec<(Key, bool)>,
    parked: Vec<(Key, bool)>,
    /// The key the hand examines next; `None`: start at the oldest.
    hand: Option<Key>,
}

/// S3-FIFO: small (queue 0) and main (queue 1) FIFOs, frequencies 0 to 3, ghosts of small.
#[derive(Debug, Clone)]
pub(crate) struct S3Fifo {
    small_cap: usize,
    main_cap: usize,
    lists: Lists,
    freq: Vec<(Key, u8)>,
    /// Oldest first.
    ghosts: Vec<Key>,
}

/// 2Q: A1in (queue 0, FIFO), Am (queue 1, LRU), A1out ghosts of A1in.
#[derive(Debug, Clone)]
pub(crate) struct TwoQ {
    kin: usize,
    kout: usize,
    lists: Lists,
    /// Oldest first.
    ghosts: Vec<Key>,
}

/// SLRU: probation (queue 0) and protected (queue 1) segments, least recent first.
#[derive(Debug, Clone)]
pub(crate) struct Slru {
    protected_cap: usize,
    lists: Lists,
}

/// LFU with aging: queue `n` holds the keys whose count is `n` (0 to 15).
#[derive(Debug, Clone)]
pub(crate) struct Lfu {
    lists: Lists,
}

/// S3-FIFO's small queue.
const SMALL: usize = 0;
/// S3-FIFO's main queue.
const MAIN: usize = 1;
/// 2Q's FIFO of keys seen once.
const A1IN: usize = 0;
/// 2Q's LRU of the others.
const AM: usize = 1;
/// SLRU's segment of keys not hit since they were stored.
const PROBATION: usize = 0;
/// SLRU's segment of keys hit at least once.
const PROTECTED: usize = 1;
/// Highest S3-FIFO frequency.
const S3_MAX_FREQ: u8 = 3;
/// Highest LFU count.
const LFU_MAX: usize = 15;
/// LFU ages when the total count exceeds this many times the number of keys.
const LFU_MAX_AVERAGE: usize = 4;
/// LFU queue names.
const LFU_NAMES: [&str; LFU_MAX + 1] = [
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15",
];

/// One of kvoffload's own policies (all but LRU and the two ARCs).
#[derive(Debug, Clone)]
pub(crate) enum Own {
    Fifo(Fifo),
    Sieve(Sieve),
    S3Fifo(S3Fifo),
    TwoQ(TwoQ),
    Slru(Slru),
    Lfu(Lfu),
}

impl Own {
    /// An empty policy of `kind` for `cap` chunks; `None` for LRU and the ARCs.
    pub(crate) fn new(kind: PolicyKind, cap: u32) -> Option<Self> {
        let cap = cap as usize;
        Some(match kind {
            PolicyKind::Fifo => Own::Fifo(Fifo::default()),
            PolicyKind::Sieve => Own::Sieve(Sieve::default()),
            PolicyKind::S3Fifo => {
                let small_cap = (cap / 10).max(1);
                Own::S3Fifo(S3Fifo {
                    small_cap,
                    main_cap: cap.saturating_sub(small_cap),
                    lists: Lists::new(2),
                    freq: Vec::new(),
                    ghosts: Vec::new(),
                })
            }
            PolicyKind::TwoQ => Own::TwoQ(TwoQ {
                kin: (cap / 4).max(1),
                kout: (cap / 2).max(1),
                lists: Lists::new(2),
                ghosts: Vec::new(),
            }),
            PolicyKind::Slru => Own::Slru(Slru {
                protected_cap: cap * 4 / 5,
                lists: Lists::new(2),
            }),
            PolicyKind::Lfu => Own::Lfu(Lfu {
                lists: Lists::new(LFU_MAX + 1),
            }),
            _ => return None,
        })
    }

    /// Its kind.
    pub(crate) fn kind(&self) -> PolicyKind {
        match self {
            Own::Fifo(_) => PolicyKind::Fifo,
            Own::Sieve(_) => PolicyKind::Sieve,
            Own::S3Fifo(_) => PolicyKind::S3Fifo,
            Own::TwoQ(_) => PolicyKind::TwoQ,
            Own::Slru(_) => PolicyKind::Slru,
            Own::Lfu(_) => PolicyKind::Lfu,
        }
    }

    /// A new key, pending.
    pub(crate) fn insert(&mut self, key: &[u8]) {
        let key = key.to_vec();
        match self {
            Own::Fifo(p) => p.order.push(key),
            Own::Sieve(p) => p.queue.push((key, false)),
            Own::S3Fifo(p) => {
                // A ghost goes to main (and stops being a ghost), anything else to small.
                let q = if take(&mut p.ghosts, &key) {
                    MAIN
                } else {
                    SMALL
                };
                p.freq.push((key.clone(), 0));
                p.lists.move_to(&key, q, true);
            }
            Own::TwoQ(p) => {
                // A ghost goes to Am (and leaves A1out), anything else to A1in.
                let q = if take(&mut p.ghosts, &key) { AM } else { A1IN };
                p.lists.move_to(&key, q, true);
            }
            Own::Slru(p) => p.lists.move_to(&key, PROBATION, true),
            Own::Lfu(p) => p.lists.move_to(&key, 1, true),
        }
    }

    /// A failed store: the key goes, with no ghost.
    pub(crate) fn remove(&mut self, key: &[u8]) {
        match self {
            Own::Fifo(p) => {
                take(&mut p.order, key);
            }
            Own::Sieve(p) => p.drop_key(key),
            Own::S3Fifo(p) => {
                p.lists.remove(key);
                p.freq.retain(|(k, _)| k.as_slice() != key);
            }
            Own::TwoQ(p) => {
                p.lists.remove(key);
            }
            Own::Slru(p) => {
                p.lists.remove(key);
            }
            Own::Lfu(p) => {
                p.lists.remove(key);
            }
        }
    }

    /// Hits (a touch, or a request's first access), in call order; keys the policy does not
    /// hold (pending and parked ones it does) are ignored.
    pub(crate) fn hit(&mut self, keys: &[Key]) {
        for key in keys {
            match self {
                Own::Fifo(_) => {}
                Own::Sieve(p) => {
                    for (k, visited) in p.queue.iter_mut().chain(p.parked.iter_mut()) {
                        if k == key {
                            *visited = true;
                        }
                    }
                }
                Own::S3Fifo(p) => {
                    if let Some((_, f)) = p.freq.iter_mut().find(|(k, _)| k == key) {
                        *f = (*f + 1).min(S3_MAX_FREQ);
                    }
                }
                Own::TwoQ(p) => {
                    // Only Am is an LRU; a hit in A1in changes nothing.
                    if p.lists.queue_of(key) == Some(AM) {
                        p.lists.move_to(key, AM, true);
                    }
                }
                Own::Slru(p) => {
                    if p.lists.queue_of(key).is_none() {
                        continue;
                    }
                    p.lists.move_to(key, PROTECTED, true);
                    while p.lists.len(PROTECTED) > p.protected_cap {
                        // Every protected key parked: nothing to demote.
                        let Some(oldest) = p.lists.linked[PROTECTED].first().cloned() else {
                            break;
                        };
                        p.lists.move_to(&oldest, PROBATION, true);
                    }
                }
                Own::Lfu(p) => {
                    let Some(n) = p.lists.queue_of(key) else {
                        continue;
                    };
                    if n < LFU_MAX {
                        p.lists.move_to(key, n + 1, true);
                        if p.total() > LFU_MAX_AVERAGE * p.lists.count() {
                            p.age();
                        }
                    }
                }
            }
        }
    }

    /// Choose and drop exactly `n` victims among `ready` keys not in `protected`, in eviction
    /// order. The caller has checked that there are at least `n` such keys.
    pub(crate) fn evict(&mut self, n: usize, protected: &[Key], ready: &[Key]) -> Vec<Key> {
        let ok = |k: &Key| has(ready, k) && !has(protected, k);
        match self {
            Own::Fifo(p) => {
                let victims: Vec<Key> = p.order.iter().filter(|k| ok(k)).take(n).cloned().collect();
                for v in &victims {
                    take(&mut p.order, v);
                }
                victims
            }
            Own::Sieve(p) => p.evict(n, protected, ready),
            Own::S3Fifo(p) => {
                let mut victims = Vec::new();
                while victims.len() < n {
                    // Small first while it holds at least its share, else main first; the
                    // other queue when the first evicts nothing.
                    let small_first = p.lists.len(SMALL) >= p.small_cap;
                    let mut progressed = false;
                    for small in [small_first, !small_first] {
                        progressed = if small {
                            p.evict_small(protected, ready, &mut victims, n)
                        } else {
                            p.evict_main(protected, ready, &mut victims)
                        };
                        if progressed {
                            break;
                        }
                    }
                    assert!(progressed, "model s3fifo: no victim");
                }
                victims
            }
            Own::TwoQ(p) => {
                let mut victims = Vec::new();
                for _ in 0..n {
                    let order = if p.lists.len(A1IN) > p.kin {
                        [A1IN, AM]
                    } else {
                        [AM, A1IN]
                    };
                    let (q, v) = order
                        .into_iter()
                        .find_map(|q| p.lists.first_candidate(q, ready, protected).map(|v| (q, v)))
                        .expect("model 2q: no victim");
                    p.lists.remove(&v);
                    if q == A1IN {
                        p.ghosts.push(v.clone());
                        while p.ghosts.len() > p.kout {
                            p.ghosts.remove(0);
                        }
                    }
                    victims.push(v);
                }
                victims
            }
            Own::Slru(p) => (0..n)
                .map(|_| {
                    let v = [PROBATION, PROTECTED]
                        .into_iter()
                        .find_map(|q| p.lists.first_candidate(q, ready, protected))
                        .expect("model slru: no victim");
                    p.lists.remove(&v);
                    v
                })
                .collect(),
            Own::Lfu(p) => (0..n)
                .map(|_| {
                    let v = (0..=LFU_MAX)
                        .find_map(|q| p.lists.first_candidate(q, ready, protected))
                        .expect("model lfu: no victim");
                    p.lists.remove(&v);
                    v
                })
                .collect(),
        }
    }

    /// The key's ref count became 0: a parked key re-enters (SIEVE: right behind the hand;
    /// the others: its queue's oldest end).
    pub(crate) fn mark_evictable(&mut self, key: &[u8]) {
        match self {
            Own::Fifo(_) => {}
            Own::Sieve(p) => {
                if let Some(i) = p.parked.iter().position(|(k, _)| k.as_slice() == key) {
                    let entry = p.parked.remove(i);
                    let at = match &p.hand {
                        Some(h) => p.pos(h),
                        None => p.queue.len(),
                    };
                    p.queue.insert(at, entry);
                }
            }
            Own::S3Fifo(p) => p.lists.unpark(key),
            Own::TwoQ(p) => p.lists.unpark(key),
            Own::Slru(p) => p.lists.unpark(key),
            Own::Lfu(p) => p.lists.unpark(key),
        }
    }

    /// The order with keys for chunk ids; `id` gives a resident key's chunk (parked keys are
    /// listed by chunk id, as the crate lists them).
    pub(crate) fn view(&self, id: &dyn Fn(&[u8]) -> ChunkId) -> View {
        let zero = |_: &[u8]| 0u8;
        let queues = |names: Vec<&'static str>,
                      lists: &Lists,
                      freq: &dyn Fn(&[u8]) -> u8,
                      ghosts: &[Key]| {
            let (linked, parked) = lists.view(freq, id);
            View::Queues {
                names,
                linked,
                parked,
                ghosts: ghosts.to_vec(),
            }
        };
        match self {
            Own::Fifo(p) => View::Queue {
                queue: p.order.iter().map(|k| (k.clone(), false)).collect(),
                parked: Vec::new(),
                hand: None,
            },
            Own::Sieve(p) => {
                let mut parked = p.parked.clone();
                parked.sort_by_key(|(k, _)| id(k));
                View::Queue {
                    queue: p.queue.clone(),
                    parked,
                    hand: p.hand.clone(),
                }
            }
            Own::S3Fifo(p) => {
                let freq = |k: &[u8]| {
                    p.freq
                        .iter()
                        .find(|(fk, _)| fk.as_slice() == k)
                        .map_or(0, |&(_, f)| f)
                };
                queues(vec!["small", "main"], &p.lists, &freq, &p.ghosts)
            }
            Own::TwoQ(p) => queues(vec!["a1in", "am"], &p.lists, &zero, &p.ghosts),
            Own::Slru(p) => queues(vec!["probation", "protected"], &p.lists, &zero, &[]),
            Own::Lfu(p) => {
                let count = |k: &[u8]| p.lists.queue_of(k).map_or(0, |q| q as u8);
                queues(LFU_NAMES.to_vec(), &p.lists, &count, &[])
            }
        }
    }
}

impl Sieve {
    /// Where `key` is in the queue.
    fn pos(&self, key: &[u8]) -> usize {
        self.queue
            .iter()
            .position(|(k, _)| k.as_slice() == key)
            .expect("key in the SIEVE queue")
    }

    /// The key after `key` toward the newest end, if any.
    fn newer(&self, key: &[u8]) -> Option<Key> {
        self.queue.get(self.pos(key) + 1).map(|(k, _)| k.clone())
    }

    /// Take `key` out of the queue; a hand pointing at it moves to the next newer key.
    fn unlink(&mut self, key: &[u8]) -> (Key, bool) {
        if self.hand.as_deref() == Some(key) {
            self.hand = self.newer(key);
        }
        let i = self.pos(key);
        self.queue.remove(i)
    }

    /// Drop `key`, queued or parked.
    fn drop_key(&mut self, key: &[u8]) {
        if let Some(i) = self.parked.iter().position(|(k, _)| k.as_slice() == key) {
            self.parked.remove(i);
        } else {
            self.unlink(key);
        }
    }

    /// The sweep: from the hand toward the newest key, wrapping to the oldest, park keys that
    /// are not ready, pass protected and already chosen ones, clear visited bits, choose
    /// unvisited keys; the hand stays after the last key examined.
    fn evict(&mut self, n: usize, protected: &[Key], ready: &[Key]) -> Vec<Key> {
        let mut chosen: Vec<Key> = Vec::new();
        let mut cur = self.hand.clone();
        let mut steps = 0;
        while chosen.len() < n {
            steps += 1;
            assert!(steps < 10_000, "model sieve: sweep does not end");
            let c = match cur {
                Some(c) => c,
                None => self
                    .queue
                    .first()
                    .expect("model sieve: empty queue")
                    .0
                    .clone(),
            };
            let next = self.newer(&c);
            let i = self.pos(&c);
            if !has(ready, &c) {
                self.hand = next.clone();
                let entry = self.unlink(&c);
                self.parked.push(entry);
            } else if has(&chosen, &c) || has(protected, &c) {
                // Passed over, bit kept.
            } else if self.queue[i].1 {
                self.queue[i].1 = false;
            } else {
                chosen.push(c);
            }
            cur = next;
        }
        self.hand = cur;
        for v in &chosen {
            self.unlink(v);
        }
        chosen
    }
}

impl S3Fifo {
    fn freq_of(&self, key: &[u8]) -> u8 {
        self.freq
            .iter()
            .find(|(k, _)| k.as_slice() == key)
            .expect("s3fifo key has a frequency")
            .1
    }

    /// Evict `key` (from small: it becomes a ghost, when main has room for any).
    fn drop_victim(&mut self, key: &Key, victims: &mut Vec<Key>) {
        let from_small = self.lists.remove(key) == Some(SMALL);
        if from_small && self.main_cap > 0 {
            self.ghosts.push(key.clone());
            while self.ghosts.len() > self.main_cap {
                self.ghosts.remove(0);
            }
        }
        self.freq.retain(|(k, _)| k != key);
        victims.push(key.clone());
    }

    /// One eviction from main: keys with a frequency go round (one less) first.
    fn evict_main(&mut self, protected: &[Key], ready: &[Key], victims: &mut Vec<Key>) -> bool {
        while let Some(k) = self.lists.first_candidate(MAIN, ready, protected) {
            let f = self.freq_of(&k);
            if f > 0 {
                self.freq.iter_mut().find(|(fk, _)| *fk == k).unwrap().1 = f - 1;
                self.lists.move_to(&k, MAIN, true);
            } else {
                self.drop_victim(&k, victims);
                return true;
            }
        }
        false
    }

    /// Evictions from small until one small key is evicted or the batch has `target` keys:
    /// keys hit more than once move to main (which evicts one when that overfills it).
    fn evict_small(
        &mut self,
        protected: &[Key],
        ready: &[Key],
        victims: &mut Vec<Key>,
        target: usize,
    ) -> bool {
        let before = victims.len();
        while victims.len() < target {
            let Some(k) = self.lists.first_candidate(SMALL, ready, protected) else {
                break;
            };
            if self.freq_of(&k) > 1 {
                self.lists.move_to(&k, MAIN, true);
                if self.lists.len(MAIN) > self.main_cap {
                    self.evict_main(protected, ready, victims);
                }
            } else {
                self.drop_victim(&k, victims);
                break;
            }
        }
        victims.len() > before
    }
}

impl Lfu {
    /// The sum of the counts.
    fn total(&self) -> usize {
        (0..=LFU_MAX).map(|n| n * self.lists.len(n)).sum()
    }

    /// Halve every count: from count 1 up, each queue's linked keys join the newest end of
    /// their new queue in order; parked keys just change queue.
    fn age(&mut self) {
        for n in 1..=LFU_MAX {
            for k in self.lists.linked[n].clone() {
                self.lists.move_to(&k, n / 2, true);
            }
            for (_, q) in &mut self.lists.parked {
                if *q == n {
                    *q = n / 2;
                }
            }
        }
    }
}
