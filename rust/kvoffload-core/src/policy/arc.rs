//! `ArcPolicy`: adaptive replacement over T1 (seen once), T2 (reused) and their ghost lists
//! B1/B2 (keys only), with a real-valued target size for T1.
//!
//! T1 and T2 are orders by a sequence number taken from one counter on every move to a list's
//! newest end. Besides its length, each list keeps an order (a [`SharedOrder`]) of its
//! *evictable* entries (moves to the newest end append in O(1)), so eviction starts at the oldest
//! evictable entry and never walks past pinned or pending ones. A chunk is in one list at most,
//! so the two orders share one node per chunk (its sequence number and links).
//! The ghost lists share one [`GhostLists`] (one slab of entries, one index: a key's list is one
//! probe away), trimmed to the capacity after each successful eviction.
//!
//! [`ArcPolicy::paper`] is the FAST 2003 paper's ARC instead (as libCacheSim 0.3.5 implements
//! it), which differs from vLLM's in three ways: a key requested while a ghost enters T2, not T1;
//! REPLACE takes T1's oldest when `0 < |T1|` and (`|T1| > p`, or `|T1| == p` after a B2 ghost
//! hit), or when T2 is empty, and T2's oldest otherwise (vLLM: T1 whenever `|T1| >= floor(p)`);
//! and on a miss that is no ghost hit the directory is bounded first: with `|T1| + |B1| >= c`,
//! B1's oldest ghost goes (or, B1 empty, T1's oldest chunk is evicted with no ghost), else with
//! `|T1| + |T2| + |B1| + |B2| >= 2c` B2's oldest ghost goes (vLLM keeps every victim as a ghost
//! and trims B1 and B2 to `c` each). The target moves the same way in both. Pinned and pending
//! chunks are passed over, as for vLLM's.

use super::ghosts::{GhostList, GhostLists};
use super::order::{grow_nodes, last_key, Node, SharedOrder};
use super::{Access, CachePolicy, FinishedKey, PolicyState, RequestRank};
use crate::error::{ensure, Result};
use crate::key::{hash_key, KeyBuf};
use crate::pool::ChunkId;
use crate::table::Slots;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum List {
    None,
    T1,
    T2,
}

/// A chunk's list and whether it is evictable (neither pinned nor pending).
#[derive(Debug, Clone, Copy)]
struct Info {
    list: List,
    evictable: bool,
}

const NO_INFO: Info = Info {
    list: List::None,
    evictable: false,
};

/// ARC over `capacity` chunk slots.
#[derive(Debug, Clone)]
pub struct ArcPolicy {
    capacity: usize,
    target: f64,
    /// Each chunk's list and whether it is evictable, side by side (a pin or a release reads
    /// both: one cache line, not two). Its sequence number in the list is kept by that list's
    /// order (`last_key`), the one copy.
    info: Vec<Info>,
    t1_len: usize,
    t2_len: usize,
    /// Evictable T1 entries by sequence number (oldest first; pinned and pending ones held).
    t1_evictable: SharedOrder<u64>,
    /// Evictable T2 entries by sequence number (oldest first; pinned and pending ones held).
    t2_evictable: SharedOrder<u64>,
    /// The nodes of both orders, one per chunk (a chunk is in one list at most).
    nodes: Vec<Node<u64>>,
    next_seq: u64,
    /// Ghost lists B1 and B2, oldest first. Looked up with the keys' precomputed hashes
    /// (`hash_key`).
    ghosts: GhostLists,
    /// The paper's ARC rather than vLLM's (see the module docs).
    paper: bool,
    /// Paper mode: the ghost hit of the last store miss (key, hash, in B2), until its insert.
    ghost_key: Option<(KeyBuf, u64, bool)>,
}

impl ArcPolicy {
    /// An empty policy for `capacity` chunk slots (also the bound of each ghost list).
    #[must_use]
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity: capacity as usize,
            target: 0.0,
            info: Vec::new(),
            t1_len: 0,
            t2_len: 0,
            t1_evictable: SharedOrder::new(),
            t2_evictable: SharedOrder::new(),
            nodes: Vec::new(),
            next_seq: 0,
            ghosts: GhostLists::new(),
            paper: false,
            ghost_key: None,
        }
    }

    /// The FAST 2003 paper's ARC (libCacheSim's) over `capacity` chunk slots.
    #[must_use]
    pub fn paper(capacity: u32) -> Self {
        Self {
            paper: true,
            ..Self::new(capacity)
        }
    }

    /// The oldest evictable, unprotected chunk of `l`.
    fn oldest_candidate(
        &mut self,
        l: List,
        protected: &dyn Fn(ChunkId) -> bool,
    ) -> Option<ChunkId> {
        let mut held = Vec::new();
        let order = if l == List::T1 {
            &self.t1_evictable
        } else {
            &self.t2_evictable
        };
        let found = next_victim(
            &mut order.iter(&self.nodes, &mut held),
            protected,
            &mut false,
        );
        for c in held {
            let (order, nodes) = self.order_of_mut(l);
            order.remove(nodes, c);
        }
        found
    }

    /// Evict `c` from its list (a ghost of it in `ghost`, if any).
    fn drop_chunk(&mut self, c: ChunkId, ghost: bool, keys: &Slots, out: &mut Vec<ChunkId>) {
        let l = self.unlink(c);
        self.info[c as usize].evictable = false;
        if ghost {
            let list = if l == List::T1 {
                GhostList::B1
            } else {
                GhostList::B2
            };
            push_ghost(&mut self.ghosts, list, keys, c);
        }
        out.push(c);
    }

    /// The paper's eviction of `n` chunks: directory bounds, then REPLACE, one chunk at a time.
    // The paper compares |T1| with the real-valued p exactly, and so does libCacheSim.
    #[allow(clippy::float_cmp)]
    fn evict_paper(
        &mut self,
        n: usize,
        protected: &dyn Fn(ChunkId) -> bool,
        keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        let c = self.capacity;
        for _ in 0..n {
            if self.ghost_key.is_none() {
                let (b1, b2) = (
                    self.ghosts.len(GhostList::B1),
                    self.ghosts.len(GhostList::B2),
                );
                if self.t1_len + b1 + 1 > c {
                    if b1 == 0 {
                        if let Some(v) = self.oldest_candidate(List::T1, protected) {
                            self.drop_chunk(v, false, keys, out);
                            continue;
                        }
                    } else {
                        self.ghosts.pop_front(GhostList::B1);
                    }
                } else if self.t1_len + b1 + self.t2_len + b2 >= 2 * c && b2 > 0 {
                    self.ghosts.pop_front(GhostList::B2);
                }
            }
            let t1 = self.t1_len as f64;
            let in_b2 = self.ghost_key.as_ref().is_some_and(|g| g.2);
            let from_t1 = (self.t1_len > 0 && (t1 > self.target || (t1 == self.target && in_b2)))
                || self.t2_len == 0;
            let order = if from_t1 {
                [List::T1, List::T2]
            } else {
                [List::T2, List::T1]
            };
            let Some(v) = order
                .into_iter()
                .find_map(|l| self.oldest_candidate(l, protected))
            else {
                // The manager asks only for evictions that can succeed; this is a guard.
                debug_assert!(false, "arc: no victim left");
                return false;
            };
            self.drop_chunk(v, true, keys, out);
        }
        true
    }

    /// The adaptive target size of T1.
    #[must_use]
    pub fn target(&self) -> f64 {
        self.target
    }

    /// List `l`'s order and the nodes it shares.
    fn order_of_mut(&mut self, l: List) -> (&mut SharedOrder<u64>, &mut [Node<u64>]) {
        if l == List::T1 {
            (&mut self.t1_evictable, &mut self.nodes)
        } else {
            (&mut self.t2_evictable, &mut self.nodes)
        }
    }

    // Out of line the compiler paid a call for it twice a key of a store (callgrind).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn unlink(&mut self, chunk: ChunkId) -> List {
        let i = chunk as usize;
        let l = self.info[i].list;
        if l != List::None {
            // A member, or a pinned chunk held in place.
            let (order, nodes) = self.order_of_mut(l);
            order.remove(nodes, chunk);
        }
        self.count_out(chunk, l);
        l
    }

    /// `chunk`, in list `l` but already out of its order, leaves the list.
    #[inline]
    fn count_out(&mut self, chunk: ChunkId, l: List) {
        match l {
            List::T1 => self.t1_len -= 1,
            List::T2 => self.t2_len -= 1,
            List::None => {}
        }
        self.info[chunk as usize].list = List::None;
    }

    /// Start loading `chunk`'s entry in the order of its list; changes nothing.
    fn prefetch_order_entry(&self, chunk: ChunkId) {
        match self.info.get(chunk as usize).map(|x| x.list) {
            Some(List::T1) => self.t1_evictable.prefetch(&self.nodes, chunk),
            Some(List::T2) => self.t2_evictable.prefetch(&self.nodes, chunk),
            _ => {}
        }
    }

    /// Start loading the neighbours of `chunk` in the order of its list; changes nothing.
    fn prefetch_neighbours(&self, chunk: ChunkId) {
        match self.info.get(chunk as usize).map(|x| x.list) {
            Some(List::T1) => self.t1_evictable.prefetch_neighbours(&self.nodes, chunk),
            Some(List::T2) => self.t2_evictable.prefetch_neighbours(&self.nodes, chunk),
            _ => {}
        }
    }

    /// Put `chunk` at the newest end of list `l`.
    fn push_newest(&mut self, chunk: ChunkId, l: List) {
        self.next_seq += 1;
        let seq = self.next_seq;
        let i = chunk as usize;
        if l != List::None && self.info[i].list == l && {
            let (order, nodes) = self.order_of_mut(l);
            order.move_to_tail(nodes, chunk, seq)
        } {
            // Within its list: to the tail as it is (a member stays one, a held entry stays
            // held); the list's count is unchanged.
            return;
        }
        self.unlink(chunk);
        self.info[i].list = l;
        match l {
            List::T1 => self.t1_len += 1,
            List::T2 => self.t2_len += 1,
            List::None => return,
        }
        // The newest sequence number sorts last: straight to the tail. Pending or pinned: held
        // there, so `mark_evictable` releases it in place (O(1)) rather than inserting it below
        // newer entries, into the tree.
        let held = !self.info[i].evictable;
        let (order, nodes) = self.order_of_mut(l);
        order.push_last(nodes, chunk, seq, held);
    }

    /// The end of an eviction whose `victims` come from both lists (`from_t2` of them from
    /// T2), or none: each out of its list and onto its ghost list (then trimmed by the caller).
    /// Out of line: the usual eviction takes all from one list.
    #[cold]
    #[inline(never)]
    fn evict_mixed(&mut self, victims: &[ChunkId], from_t2: usize, keys: &Slots) {
        let cap = self.capacity;
        // The oldest ghosts that the pushes drop: their index words (large lists), as the
        // trims after the pushes would.
        for (ghost, pushes) in [
            (GhostList::B1, victims.len() - from_t2),
            (GhostList::B2, from_t2),
        ] {
            let drops = self.ghosts.to_drop(ghost, pushes, cap);
            self.ghosts.prefetch_oldest_words(ghost, drops);
        }
        for &c in victims {
            let ghost = if self.unlink(c) == List::T1 {
                GhostList::B1
            } else {
                GhostList::B2
            };
            self.info[c as usize].evictable = false;
            push_ghost_within(&mut self.ghosts, ghost, keys, c, cap);
        }
    }

    /// Adapt the target to a ghost hit on `key`; `false` when the key is no ghost.
    // Inlined into the store's and the touch's loops over their keys, most of which are no
    // ghosts: the probe inline, the target's update (on a hit) out of line.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn ghost_hit(&mut self, key: &[u8], hash: u64) -> bool {
        match self.ghosts.move_to_back(key, hash) {
            Some(list) => {
                self.adapt_target(list);
                true
            }
            None => false,
        }
    }

    /// Adapt the target to a hit in ghost list `list` (moving a ghost to its list's newest end
    /// leaves the lists' lengths as they were).
    #[inline(never)]
    fn adapt_target(&mut self, list: GhostList) {
        let cap = self.capacity as f64;
        let n1 = self.ghosts.len(GhostList::B1) as f64;
        let n2 = self.ghosts.len(GhostList::B2) as f64;
        self.target = match list {
            GhostList::B1 => (self.target + (n2 / n1).max(1.0)).min(cap),
            GhostList::B2 => (self.target - (n1 / n2).max(1.0)).max(0.0),
        };
    }

    fn ordered(&self, l: List) -> Vec<ChunkId> {
        let mut v: Vec<(u64, ChunkId)> = (0..self.info.len())
            .filter(|&i| self.info[i].list == l)
            .map(|i| (last_key(&self.nodes, i as ChunkId), i as ChunkId))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, c)| c).collect()
    }
}

/// The next evictable, unprotected entry of `it`; `passed` set when it walks past a protected
/// one.
// Inlined into the eviction's scans, and a plain loop: `find`'s `try_fold` was kept out of
// line, a call per victim (callgrind).
#[allow(clippy::inline_always)]
#[inline(always)]
fn next_victim(
    it: &mut impl Iterator<Item = (u64, ChunkId)>,
    protected: &dyn Fn(ChunkId) -> bool,
    passed: &mut bool,
) -> Option<ChunkId> {
    for (_, c) in it {
        if !protected(c) {
            return Some(c);
        }
        *passed = true;
    }
    None
}

impl CachePolicy for ArcPolicy {
    fn grow(&mut self, n: usize) {
        if n > self.info.len() {
            crate::mem::resize_huge(&mut self.info, n, NO_INFO);
            self.t1_evictable.grow(n);
            self.t2_evictable.grow(n);
            grow_nodes(&mut self.nodes, n);
        }
    }

    fn insert(&mut self, chunk: ChunkId, key: Access<'_>, _rank: &mut RequestRank) {
        let i = chunk as usize;
        if self.info[i].list == List::None {
            // In no list (every chunk the manager allocates): `push_newest`'s steps for such a
            // chunk, inline. The newest sequence number, held (pending) at T1's tail.
            self.next_seq += 1;
            self.info[i] = Info {
                list: List::T1,
                evictable: false,
            };
            self.t1_len += 1;
            let seq = self.next_seq;
            self.t1_evictable
                .push_last(&mut self.nodes, chunk, seq, true);
        } else {
            self.info[i].evictable = false;
            self.push_newest(chunk, List::T1);
        }
        self.ghosts.remove(key.key, key.hash);
        if self
            .ghost_key
            .as_ref()
            .is_some_and(|g| g.1 == key.hash && g.0.as_slice() == key.key)
        {
            if self.paper {
                self.push_newest(chunk, List::T2);
            }
            self.ghost_key = None;
        }
    }

    fn remove(&mut self, chunk: ChunkId) {
        self.unlink(chunk);
        self.info[chunk as usize].evictable = false;
    }

    fn touch(&mut self, keys: &[Access<'_>], refs: &Slots) {
        // The entries of the orders the chunks are in (their lists were prefetched with the
        // keys), then their neighbours, which unlinking rewrites: the misses overlap.
        for a in keys {
            if let Some(c) = a.chunk {
                self.prefetch_order_entry(c);
            }
        }
        for a in keys {
            if let Some(c) = a.chunk {
                self.prefetch_neighbours(c);
            }
        }
        for a in keys.iter().rev() {
            match a.chunk.map(|c| (c, self.info[c as usize].list)) {
                Some((c, List::T1)) => {
                    let to = if refs.raw(c) >= 0 { List::T2 } else { List::T1 };
                    self.push_newest(c, to);
                }
                Some((c, List::T2)) => self.push_newest(c, List::T2),
                _ => {
                    self.ghost_hit(a.key, a.hash);
                }
            }
        }
    }

    fn on_store_miss(&mut self, keys: &[Access<'_>]) {
        if self.paper {
            // The first of the offer's keys that is a ghost, for insert and REPLACE.
            self.ghost_key = keys.iter().find_map(|a| {
                let list = self.ghosts.find(a.key, a.hash)?;
                Some((KeyBuf::from_slice(a.key), a.hash, list == GhostList::B2))
            });
        }
        // Each key's index word first, then (large lists) the entry it names, so the misses
        // of a batch overlap (a ghost hit compares the entry's key).
        for a in keys {
            self.ghosts.prefetch(a.hash);
        }
        if self.ghosts.large() {
            for a in keys {
                self.ghosts.prefetch_entry(a.hash);
            }
        }
        for a in keys.iter().rev() {
            self.ghost_hit(a.key, a.hash);
        }
    }

    fn prefetch(&self, chunk: ChunkId) {
        // Which order holds the chunk is itself behind a miss: fetch its list entry, and its
        // place in both orders (pinning and releasing a chunk read only its place there), not
        // a node, which only the order holding it would need.
        if let Some(x) = self.info.get(chunk as usize) {
            crate::mem::prefetch(x);
        }
        self.t1_evictable.prefetch_place(chunk);
        self.t2_evictable.prefetch_place(chunk);
    }

    fn reads_access_keys(&self, _positions: bool) -> bool {
        false
    }

    fn on_request_access(&mut self, _keys: &[Access<'_>], _rank: &mut RequestRank) {}

    fn on_request_finished(&mut self, keys: &[FinishedKey<'_>]) {
        for k in keys.iter().rev() {
            let Some(c) = k.chunk else { continue };
            let l = self.info[c as usize].list;
            if k.inserted_only {
                self.push_newest(c, l);
            } else if k.reused {
                self.push_newest(c, List::T2);
            }
        }
    }

    fn evict(
        &mut self,
        n: usize,
        protected: &dyn Fn(ChunkId) -> bool,
        keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        if self.paper {
            return self.evict_paper(n, protected, keys, out);
        }
        let start = out.len();
        // Held (pinned) entries the scans walk past; detached once the scans end.
        let (mut held1, mut held2) = (Vec::new(), Vec::new());
        // Victims taken from T2, and whether each scan walked past a protected chunk.
        let (mut from_t2, mut passed1, mut passed2) = (0, false, false);
        let found = {
            let floor_target = self.target as usize;
            let mut virtual_t1 = self.t1_len;
            let mut t1 = self.t1_evictable.iter(&self.nodes, &mut held1);
            let mut t2 = self.t2_evictable.iter(&self.nodes, &mut held2);
            (0..n).all(|_| {
                let mut pick = None;
                if virtual_t1 >= floor_target {
                    pick = next_victim(&mut t1, protected, &mut passed1).map(|c| (c, true));
                }
                if pick.is_none() {
                    pick = next_victim(&mut t2, protected, &mut passed2).map(|c| (c, false));
                }
                if pick.is_none() {
                    pick = next_victim(&mut t1, protected, &mut passed1).map(|c| (c, true));
                }
                let Some((c, is_t1)) = pick else {
                    return false;
                };
                if is_t1 {
                    virtual_t1 = virtual_t1.saturating_sub(1);
                } else {
                    from_t2 += 1;
                }
                out.push(c);
                true
            })
        };
        for &c in &held1 {
            self.t1_evictable.remove(&mut self.nodes, c);
        }
        for &c in &held2 {
            self.t2_evictable.remove(&mut self.nodes, c);
        }
        if !found {
            out.truncate(start);
            return false;
        }
        // The victims' index words and the oldest ghosts first, so the misses overlap.
        for &c in &out[start..] {
            self.ghosts.prefetch(keys.hash(c));
        }
        self.ghosts.prefetch_oldest(GhostList::B1);
        self.ghosts.prefetch_oldest(GhostList::B2);
        let victims = &out[start..];
        // All from one list (the usual eviction): out of its order in one step, which cuts a
        // prefix of it at once (see `SharedOrder::remove_all`); otherwise each is unlinked (a
        // victim of T1's scan is in T1 until then). (Unlinking all of them, even from one
        // list, measured 2% more instructions a store.) A scan's victims are in its list, so
        // the scans tell which list holds them all, if one does.
        let (first, passed) = if victims.is_empty() || (from_t2 != 0 && from_t2 != victims.len()) {
            (List::None, true)
        } else if from_t2 == 0 {
            (List::T1, passed1)
        } else {
            (List::T2, passed2)
        };
        let cap = self.capacity;
        // The index as long as pushing every victim before trimming would make it.
        self.ghosts.reserve(victims.len());
        if first == List::None {
            self.evict_mixed(victims, from_t2, keys);
        } else {
            let (order, nodes) = self.order_of_mut(first);
            // A scan of the list alone that passed no protected chunk took every member it met:
            // the victims are its first members (the held entries it passed are out already).
            if order.list_only() && !passed {
                order.cut_prefix(nodes, victims);
            } else {
                order.remove_all(nodes, victims);
            }
            // `count_out` of each, at once.
            let ghost = if first == List::T1 {
                self.t1_len -= victims.len();
                GhostList::B1
            } else {
                self.t2_len -= victims.len();
                GhostList::B2
            };
            // The oldest ghosts that the pushes drop: their index words (large lists), as the
            // trim after the pushes would.
            let drops = self.ghosts.to_drop(ghost, victims.len(), cap);
            self.ghosts.prefetch_oldest_words(ghost, drops);
            for &c in victims {
                // In no list, and not evictable.
                self.info[c as usize] = NO_INFO;
                push_ghost_within(&mut self.ghosts, ghost, keys, c, cap);
            }
        }
        // Most pushes kept their list within the capacity; this trims what the others left.
        for list in [GhostList::B1, GhostList::B2] {
            self.ghosts.trim(list, self.capacity);
        }
        true
    }

    fn clear(&mut self) {
        self.info.clear();
        self.t1_len = 0;
        self.t2_len = 0;
        self.t1_evictable.clear();
        self.t2_evictable.clear();
        self.nodes.clear();
        self.ghosts.clear();
        self.target = 0.0;
        self.ghost_key = None;
    }

    fn mark_evictable(&mut self, chunk: ChunkId) {
        let i = chunk as usize;
        debug_assert!(!self.info[i].evictable);
        self.info[i].evictable = true;
        let l = self.info[i].list;
        if l != List::None {
            let (order, nodes) = self.order_of_mut(l);
            order.release_in_place(nodes, chunk);
        }
    }

    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        let i = chunk as usize;
        debug_assert!(self.info[i].evictable);
        self.info[i].evictable = false;
        let l = self.info[i].list;
        if l != List::None {
            self.order_of_mut(l).0.hold(chunk);
        }
    }

    fn state(&self) -> PolicyState {
        PolicyState::Arc {
            t1: self.ordered(List::T1),
            t2: self.ordered(List::T2),
            b1: self.ghosts.key_bufs(GhostList::B1),
            b2: self.ghosts.key_bufs(GhostList::B2),
            target: self.target,
        }
    }

    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        ensure!(
            resident.len() == self.info.len(),
            "arc: per-chunk arrays differ in length"
        );
        let (mut t1, mut t2, mut e1, mut e2) = (0, 0, 0, 0);
        for (i, &res) in resident.iter().enumerate() {
            let l = self.info[i].list;
            let seq = last_key(&self.nodes, i as ChunkId);
            ensure!(
                res == (l != List::None),
                "arc: chunk {i} residency differs from the index"
            );
            // A key that becomes resident leaves the ghost lists (`insert`), and only a victim
            // becomes a ghost: the eviction's pushes rely on it (`push_ghost_within`).
            ensure!(
                !res || self
                    .ghosts
                    .find(&refs.key(i as ChunkId), refs.hash(i as ChunkId))
                    .is_none(),
                "arc: chunk {i}'s key is resident and a ghost too"
            );
            let ev = res && refs.raw(i as ChunkId) == 0;
            ensure!(
                self.info[i].evictable == ev,
                "arc: chunk {i} evictable flag is {}",
                self.info[i].evictable
            );
            match l {
                List::T1 => t1 += 1,
                List::T2 => t2 += 1,
                List::None => {}
            }
            let c = i as ChunkId;
            for (map, ml) in [
                (&self.t1_evictable, List::T1),
                (&self.t2_evictable, List::T2),
            ] {
                if let Some(k) = map.held_key_of(&self.nodes, c) {
                    ensure!(
                        l == ml && k == seq && (refs.raw(c) > 0 || refs.raw(c) == -1),
                        "arc: chunk {i} held in an order but not pinned or pending there at its \
                         sequence"
                    );
                }
            }
            if ev {
                let map = if l == List::T1 {
                    &self.t1_evictable
                } else {
                    &self.t2_evictable
                };
                ensure!(
                    map.key_of(&self.nodes, i as ChunkId) == Some(seq),
                    "arc: chunk {i} missing from its evictable order, or under a stale sequence"
                );
                if l == List::T1 {
                    e1 += 1;
                } else {
                    e2 += 1;
                }
            }
        }
        ensure!(
            (t1, t2) == (self.t1_len, self.t2_len),
            "arc: list lengths drifted"
        );
        ensure!(
            (e1, e2) == (self.t1_evictable.len(), self.t2_evictable.len()),
            "arc: evictable orders hold stale entries"
        );
        self.t1_evictable.validate(&self.nodes)?;
        self.t2_evictable.validate(&self.nodes)?;
        // The paper bounds the directory only on misses it can evict for, which pinned chunks
        // can prevent: its ghost lists have no fixed bound.
        ensure!(
            self.paper
                || (self.ghosts.len(GhostList::B1) <= self.capacity
                    && self.ghosts.len(GhostList::B2) <= self.capacity),
            "arc: a ghost list is over capacity"
        );
        // Links, index, no key in both lists, and each key's hash is `hash_key`'s.
        self.ghosts.validate(hash_key)?;
        ensure!(
            (0.0..=self.capacity as f64).contains(&self.target),
            "arc: target {} outside [0, capacity]",
            self.target
        );
        Ok(())
    }

    fn set_target(&mut self, target: f64) -> bool {
        self.target = target;
        true
    }
}

/// Push slot `c`'s key onto ghost list `list` and, when the list holds `keep` ghosts already,
/// drop its oldest in the same step ([`GhostLists::push_within`]); otherwise (or when that
/// declines) a plain [`push_ghost`], leaving the list for the caller to trim to `keep`.
///
/// A victim's key is never a ghost (`validate` checks it), so every push appends a new ghost,
/// none moves one: dropping the oldest at each push, or once after all of them, keeps the same
/// newest `keep`. (The plain push, when `push_within` declines for a word with the key's tag,
/// meets another key's word.)
// Inlined into the eviction's loops over their victims, the plain push out of line.
#[allow(clippy::inline_always)]
#[inline(always)]
fn push_ghost_within(
    ghosts: &mut GhostLists,
    list: GhostList,
    keys: &Slots,
    c: ChunkId,
    keep: usize,
) {
    if !ghosts.push_within(list, keys.hash(c), keep, || keys.inline_key(c)) {
        push_ghost(ghosts, list, keys, c);
    }
}

/// Push slot `c`'s key onto ghost list `list`: straight from the slot's inline buffer (one
/// fixed-size copy) unless the key is longer.
#[inline(never)]
fn push_ghost(ghosts: &mut GhostLists, list: GhostList, keys: &Slots, c: ChunkId) {
    let hash = keys.hash(c);
    match keys.inline_key(c) {
        Some((buf, len)) => ghosts.push_inline(list, &buf, len, hash),
        None => ghosts.push(list, &keys.key(c), hash),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::test_util::{keys, TestKeys};

    fn ready(p: &mut ArcPolicy, refs: &mut Slots, c: ChunkId, ks: &TestKeys) {
        p.grow(c as usize + 1);
        refs.grow(c as usize + 1);
        let s = &ks[c as usize];
        p.insert(
            c,
            Access {
                key: &s.key,
                hash: s.hash,
                chunk: None,
                position: None,
            },
            &mut None,
        );
        crate::key::test_util::pend(refs, c);
        refs.complete_store(c);
        p.mark_evictable(c);
    }

    fn evict(p: &mut ArcPolicy, n: usize, ks: &TestKeys) -> Option<Vec<ChunkId>> {
        let mut out = Vec::new();
        p.evict(n, &|_| false, ks, &mut out).then_some(out)
    }

    #[test]
    fn ghost_hit_raises_target_and_touch_promotes() {
        let ks = keys(3);
        let mut refs = Slots::new(3).unwrap();
        let mut p = ArcPolicy::new(2);
        ready(&mut p, &mut refs, 0, &ks);
        ready(&mut p, &mut refs, 1, &ks);
        assert_eq!(evict(&mut p, 1, &ks), Some(vec![0]));
        let PolicyState::Arc { b1, .. } = p.state() else {
            panic!()
        };
        assert_eq!(b1, vec![ks[0].key.clone()]);
        p.touch(
            &[Access {
                key: &ks[0].key,
                hash: ks[0].hash,
                chunk: None,
                position: None,
            }],
            &refs,
        );
        assert!((p.target() - 1.0).abs() < f64::EPSILON);
        p.touch(
            &[Access {
                key: &ks[1].key,
                hash: ks[1].hash,
                chunk: Some(1),
                position: None,
            }],
            &refs,
        );
        let PolicyState::Arc { t1, t2, .. } = p.state() else {
            panic!()
        };
        assert_eq!((t1, t2), (vec![], vec![1]));
    }

    #[test]
    fn target_steers_between_lists() {
        let ks = keys(4);
        let mut refs = Slots::new(4).unwrap();
        let mut p = ArcPolicy::new(4);
        for c in 0..4 {
            ready(&mut p, &mut refs, c, &ks);
        }
        let acc = |c: ChunkId| Access {
            key: b"",
            hash: 0,
            chunk: Some(c),
            position: None,
        };
        p.touch(&[acc(2), acc(3)], &refs);
        // T1 = [0, 1], T2 = [3, 2]. Target 2 > |T1| - 1 after one pick: second comes from T2.
        p.set_target(2.0);
        assert_eq!(evict(&mut p, 2, &ks), Some(vec![0, 3]));
        p.validate(&[false, true, true, false], &refs).unwrap();
    }
}
