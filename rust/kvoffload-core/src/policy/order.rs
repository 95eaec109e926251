//! `EvictionOrder`: the evictable chunks of a policy in ascending order of a sort key.
//!
//! Most insertions carry a key above every key in the order (a fresh rank, a new sequence
//! number): those are appended to an intrusive linked list threaded through per-chunk arrays,
//! in O(1). So is an insertion right next to the previous one (a request's chunks ranked by
//! token position arrive tail first, each just below the last). Any other insertion (a chunk whose old rank becomes evictable again,
//! a token-position rank) goes to a B-tree instead, in O(log n). Both halves are sorted, and
//! iteration merges them, so the order starts at the least key.
//!
//! A member that stops being evictable (pinned by a load) is *held*: it keeps its place, so
//! being pinned and released at the same key costs O(1) and touches no neighbour. Iteration
//! skips held entries and reports them, and the caller detaches them after an eviction scan, so
//! a scan walks past a held chunk at most once per pin: eviction costs amortised O(1) per victim
//! whatever the number of pinned chunks. A chunk that is not evictable (pinned, or a pending
//! store) and gets a new key can be held at it directly (`insert_held`: the policies do so when
//! they re-rank a held chunk or take in a pending one), so its release there is O(1) as well. A
//! held chunk released after being detached (or at another key) is inserted anew.

use crate::error::{ensure, Result};
use crate::pool::ChunkId;
use std::collections::BTreeSet;
use std::iter::Peekable;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Out,
    List,
    Tree,
    /// Held (not a member) but still linked in the list, at its key.
    ListHeld,
    /// Held (not a member) but still in the tree, at its key.
    TreeHeld,
}

/// An ordered set of chunks keyed by `(K, chunk)`; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct EvictionOrder<K> {
    place: Vec<Place>,
    key: Vec<K>,
    /// When a chunk is in the list: the next (greater) and previous members.
    next: Vec<u32>,
    prev: Vec<u32>,
    head: u32,
    tail: u32,
    /// The list member inserted last (`NIL` when it left the list).
    finger: u32,
    tree: BTreeSet<(K, ChunkId)>,
    /// Members (held entries excluded).
    len: usize,
}

impl<K: Ord + Copy + Default> EvictionOrder<K> {
    pub(crate) fn new() -> Self {
        Self {
            place: Vec::new(),
            key: Vec::new(),
            next: Vec::new(),
            prev: Vec::new(),
            head: NIL,
            tail: NIL,
            finger: NIL,
            tree: BTreeSet::new(),
            len: 0,
        }
    }

    /// Make room for chunk ids `0..n`.
    pub(crate) fn grow(&mut self, n: usize) {
        if n > self.place.len() {
            self.place.resize(n, Place::Out);
            self.key.resize(n, K::default());
            self.next.resize(n, NIL);
            self.prev.resize(n, NIL);
        }
    }

    /// Number of members.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `c` is a member (held entries are not).
    pub(crate) fn contains(&self, c: ChunkId) -> bool {
        self.place
            .get(c as usize)
            .is_some_and(|&p| matches!(p, Place::List | Place::Tree))
    }

    /// The sort key of member `c`.
    pub(crate) fn key_of(&self, c: ChunkId) -> Option<K> {
        self.contains(c).then(|| self.key[c as usize])
    }

    /// Start loading `c`'s entry into the cache; changes nothing.
    pub(crate) fn prefetch(&self, c: ChunkId) {
        let i = c as usize;
        if i < self.place.len() {
            crate::mem::prefetch(&self.place[i]);
            crate::mem::prefetch(&self.key[i]);
            crate::mem::prefetch(&self.next[i]);
            crate::mem::prefetch(&self.prev[i]);
        }
    }

    /// Start loading the links that removing `c` from the list rewrites (its neighbours').
    pub(crate) fn prefetch_neighbours(&self, c: ChunkId) {
        let i = c as usize;
        if i < self.place.len() && matches!(self.place[i], Place::List | Place::ListHeld) {
            let (p, n) = (self.prev[i], self.next[i]);
            if p != NIL {
                crate::mem::prefetch(&self.next[p as usize]);
            }
            if n != NIL {
                crate::mem::prefetch(&self.prev[n as usize]);
            }
        }
    }

    /// The key `c` is held at, when it is held.
    pub(crate) fn held_key_of(&self, c: ChunkId) -> Option<K> {
        self.place
            .get(c as usize)
            .is_some_and(|&p| matches!(p, Place::ListHeld | Place::TreeHeld))
            .then(|| self.key[c as usize])
    }

    /// Add `c` with sort key `k` (`c` must be neither a member nor held).
    pub(crate) fn insert(&mut self, c: ChunkId, k: K) {
        let i = c as usize;
        debug_assert_eq!(self.place[i], Place::Out);
        self.key[i] = k;
        self.len += 1;
        let me = (k, c);
        let entry = |m: u32| (self.key[m as usize], m);
        // The member after which `c` belongs, if that spot is the tail or next to the finger.
        let after = if self.tail == NIL || me > entry(self.tail) {
            Some(self.tail)
        } else if self.finger != NIL && me < entry(self.finger) {
            let p = self.prev[self.finger as usize];
            (p == NIL || entry(p) < me).then_some(p)
        } else if self.finger != NIL {
            let n = self.next[self.finger as usize];
            (n != NIL && me < entry(n)).then_some(self.finger)
        } else {
            None
        };
        if let Some(p) = after {
            self.link_after(c, p);
        } else {
            self.place[i] = Place::Tree;
            self.tree.insert(me);
        }
    }

    /// Link `c` into the list right after `p` (`NIL`: at the head).
    fn link_after(&mut self, c: ChunkId, p: u32) {
        let i = c as usize;
        let n = if p == NIL {
            self.head
        } else {
            self.next[p as usize]
        };
        self.place[i] = Place::List;
        self.prev[i] = p;
        self.next[i] = n;
        if p == NIL {
            self.head = c;
        } else {
            self.next[p as usize] = c;
        }
        if n == NIL {
            self.tail = c;
        } else {
            self.prev[n as usize] = c;
        }
        self.finger = c;
    }

    /// Drop `c` if it is a member or held.
    pub(crate) fn remove(&mut self, c: ChunkId) {
        let i = c as usize;
        let place = self.place.get(i).copied().unwrap_or(Place::Out);
        match place {
            Place::Out => return,
            Place::Tree | Place::TreeHeld => {
                self.tree.remove(&(self.key[i], c));
            }
            Place::List | Place::ListHeld => {
                if self.finger == c {
                    self.finger = NIL;
                }
                let (p, n) = (self.prev[i], self.next[i]);
                if p == NIL {
                    self.head = n;
                } else {
                    self.next[p as usize] = n;
                }
                if n == NIL {
                    self.tail = p;
                } else {
                    self.prev[n as usize] = p;
                }
            }
        }
        self.place[i] = Place::Out;
        if matches!(place, Place::List | Place::Tree) {
            self.len -= 1;
        }
    }

    /// Member `c` stops being one but keeps its place (see the module docs).
    pub(crate) fn hold(&mut self, c: ChunkId) {
        let p = &mut self.place[c as usize];
        *p = match *p {
            Place::List => Place::ListHeld,
            Place::Tree => Place::TreeHeld,
            other => {
                debug_assert!(false, "hold of a non-member");
                other
            }
        };
        self.len -= 1;
    }

    /// Add `c` (neither a member nor held) as an entry held at `k`, as if inserted at `k` and
    /// then held: a pinned chunk given a new key keeps a place there, so its release at `k`
    /// costs O(1) instead of an insertion that most likely lands in the tree.
    pub(crate) fn insert_held(&mut self, c: ChunkId, k: K) {
        self.insert(c, k);
        self.hold(c);
    }

    /// Make `c` a member again with sort key `k`: in O(1) if it is still held at `k`.
    pub(crate) fn release(&mut self, c: ChunkId, k: K) {
        let i = c as usize;
        match self.place[i] {
            Place::ListHeld if self.key[i] == k => self.place[i] = Place::List,
            Place::TreeHeld if self.key[i] == k => self.place[i] = Place::Tree,
            _ => {
                self.remove(c);
                self.insert(c, k);
                return;
            }
        }
        self.len += 1;
    }

    /// Members in ascending `(key, chunk)` order. Held entries met on the way are appended to
    /// `held`; pass them to [`remove`](Self::remove) once the scan is over.
    pub(crate) fn iter<'a>(&'a self, held: &'a mut Vec<ChunkId>) -> Iter<'a, K> {
        Iter {
            order: self,
            list: self.head,
            tree: self.tree.iter().peekable(),
            held,
        }
    }

    /// Forget every member.
    pub(crate) fn clear(&mut self) {
        self.place.clear();
        self.key.clear();
        self.next.clear();
        self.prev.clear();
        self.head = NIL;
        self.tail = NIL;
        self.finger = NIL;
        self.tree.clear();
        self.len = 0;
    }

    /// Check the list is sorted and linked both ways, and the counts add up.
    pub(crate) fn validate(&self) -> Result<()> {
        let (mut n, mut linked) = (0, 0);
        let mut prev = NIL;
        let mut c = self.head;
        while c != NIL {
            let i = c as usize;
            ensure!(
                matches!(self.place[i], Place::List | Place::ListHeld),
                "order: chunk {c} linked but not in the list"
            );
            ensure!(self.prev[i] == prev, "order: chunk {c} back link broken");
            if prev != NIL {
                ensure!(
                    (self.key[prev as usize], prev) < (self.key[i], c),
                    "order: list not ascending at chunk {c}"
                );
            }
            n += usize::from(self.place[i] == Place::List);
            linked += 1;
            ensure!(
                linked <= self.place.len(),
                "order: list longer than the chunk count (cycle?)"
            );
            prev = c;
            c = self.next[i];
        }
        ensure!(prev == self.tail, "order: tail is not the last list member");
        for &(k, c) in &self.tree {
            let i = c as usize;
            ensure!(
                matches!(self.place[i], Place::Tree | Place::TreeHeld) && self.key[i] == k,
                "order: stale tree entry for chunk {c}"
            );
            n += usize::from(self.place[i] == Place::Tree);
        }
        ensure!(n == self.len, "order: member count drifted");
        let in_place = |p: Place| self.place.iter().filter(|&&q| q == p).count();
        ensure!(
            in_place(Place::ListHeld) + in_place(Place::List) == linked
                && in_place(Place::TreeHeld) + in_place(Place::Tree) == self.tree.len(),
            "order: a chunk is marked linked but is not, or the reverse"
        );
        let members = in_place(Place::List) + in_place(Place::Tree);
        ensure!(
            members == self.len,
            "order: {members} chunks marked, count says {}",
            self.len
        );
        Ok(())
    }
}

/// Merge of the list and the tree, ascending, skipping (and reporting) held entries.
pub(crate) struct Iter<'a, K> {
    order: &'a EvictionOrder<K>,
    list: u32,
    tree: Peekable<std::collections::btree_set::Iter<'a, (K, ChunkId)>>,
    held: &'a mut Vec<ChunkId>,
}

impl<K: Ord + Copy> Iter<'_, K> {
    /// The next entry of the merge, held or not.
    fn next_entry(&mut self) -> Option<(K, ChunkId)> {
        let from_list = (self.list != NIL).then(|| (self.order.key[self.list as usize], self.list));
        match (from_list, self.tree.peek()) {
            (Some(l), Some(&&t)) if t < l => {
                self.tree.next();
                Some(t)
            }
            (Some(l), _) => {
                self.list = self.order.next[l.1 as usize];
                Some(l)
            }
            (None, Some(&&t)) => {
                self.tree.next();
                Some(t)
            }
            (None, None) => None,
        }
    }
}

impl<K: Ord + Copy> Iterator for Iter<'_, K> {
    type Item = (K, ChunkId);

    fn next(&mut self) -> Option<(K, ChunkId)> {
        loop {
            let (k, c) = self.next_entry()?;
            if matches!(self.order.place[c as usize], Place::List | Place::Tree) {
                return Some((k, c));
            }
            self.held.push(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_appends_and_late_inserts_in_order() {
        let mut o: EvictionOrder<u64> = EvictionOrder::new();
        o.grow(6);
        o.insert(0, 10);
        o.insert(1, 20);
        o.insert(2, 5); // below the tail: tree
        o.insert(3, 30);
        o.insert(4, 15); // tree
        o.validate().unwrap();
        let order: Vec<ChunkId> = o.iter(&mut Vec::new()).map(|(_, c)| c).collect();
        assert_eq!(order, vec![2, 0, 4, 1, 3]);
        o.remove(1);
        o.remove(2);
        o.remove(3);
        o.insert(5, 16); // above the new tail (15 is in the tree; list tail is 10)
        o.validate().unwrap();
        assert_eq!(
            o.iter(&mut Vec::new()).map(|(k, _)| k).collect::<Vec<_>>(),
            vec![10, 15, 16]
        );
        assert_eq!(o.len(), 3);
        assert!(o.contains(4) && !o.contains(1));
    }

    #[test]
    fn descending_runs_stay_in_the_list() {
        let mut o: EvictionOrder<(u64, i64)> = EvictionOrder::new();
        o.grow(8);
        o.insert(0, (1, 0));
        // A request's chunks at positions 16, 32, 48: ranks (2, -16) > (2, -32) > (2, -48).
        o.insert(1, (2, -16));
        o.insert(2, (2, -32));
        o.insert(3, (2, -48));
        assert!(o.tree.is_empty(), "each went next to the previous insert");
        o.insert(4, (3, 0));
        o.insert(5, (2, -40)); // between 2 and 3: not next to the finger (4)
        o.validate().unwrap();
        assert_eq!(
            o.iter(&mut Vec::new()).map(|(_, c)| c).collect::<Vec<_>>(),
            vec![0, 3, 5, 2, 1, 4]
        );
        o.remove(4);
        o.insert(6, (2, -20)); // finger gone: below the tail, so the tree
        o.validate().unwrap();
        assert_eq!(
            o.iter(&mut Vec::new()).map(|(_, c)| c).collect::<Vec<_>>(),
            vec![0, 3, 5, 2, 6, 1]
        );
    }

    #[test]
    fn held_entries_keep_their_place_and_are_detached_by_a_scan() {
        let mut o: EvictionOrder<u64> = EvictionOrder::new();
        o.grow(4);
        for c in 0..4 {
            o.insert(c, u64::from(c) * 10);
        }
        o.hold(0);
        o.hold(2);
        assert_eq!(
            (o.len(), o.contains(0), o.held_key_of(0)),
            (2, false, Some(0))
        );
        o.validate().unwrap();
        o.release(2, 20); // same key: back in place, no re-insert
        assert_eq!(o.held_key_of(2), None);
        o.validate().unwrap();
        let mut held = Vec::new();
        let seen: Vec<ChunkId> = o.iter(&mut held).map(|(_, c)| c).collect();
        assert_eq!((seen, held.clone()), (vec![1, 2, 3], vec![0]));
        for c in held {
            o.remove(c);
        }
        assert_eq!(o.held_key_of(0), None);
        o.validate().unwrap();
        o.release(0, 25); // detached meanwhile: inserted anew at its new key
        o.hold(3);
        o.release(3, 5); // held under another key: moved
        assert_eq!(
            o.iter(&mut Vec::new()).collect::<Vec<_>>(),
            vec![(5, 3), (10, 1), (20, 2), (25, 0)]
        );
        o.validate().unwrap();
    }

    #[test]
    fn a_held_entry_given_a_new_key_is_released_there_in_place() {
        let mut o: EvictionOrder<u64> = EvictionOrder::new();
        o.grow(3);
        o.insert(0, 10);
        o.insert(1, 20);
        o.hold(0);
        o.remove(0);
        o.insert_held(0, 30); // a pinned chunk given the newest key: held at the tail
        assert!(o.tree.is_empty());
        assert_eq!((o.len(), o.held_key_of(0)), (1, Some(30)));
        o.insert(2, 40);
        o.validate().unwrap();
        let mut held = Vec::new();
        assert_eq!(o.iter(&mut held).count(), 2);
        assert_eq!(held, vec![0]);
        o.release(0, 30); // no scan detached it: back in place, not in the tree
        assert!(o.tree.is_empty());
        assert_eq!(
            o.iter(&mut Vec::new()).collect::<Vec<_>>(),
            vec![(20, 1), (30, 0), (40, 2)]
        );
        o.validate().unwrap();
    }

    #[test]
    fn equal_keys_order_by_chunk() {
        let mut o: EvictionOrder<(u64, i64)> = EvictionOrder::new();
        o.grow(3);
        o.insert(2, (1, -4));
        o.insert(0, (1, -4));
        o.insert(1, (1, -4));
        assert_eq!(
            o.iter(&mut Vec::new()).map(|(_, c)| c).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        o.validate().unwrap();
        o.clear();
        assert_eq!(o.iter(&mut Vec::new()).count(), 0);
    }
}
