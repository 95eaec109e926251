//! `EvictionOrder`: the evictable chunks of a policy in ascending order of a sort key.
//!
//! Most insertions carry a key above every key in the order (a fresh rank, a new sequence
//! number): those are appended to an intrusive linked list threaded through a per-chunk node
//! array (key and links side by side), in O(1). So is an insertion right next to the previous
//! one (a request's chunks ranked by token position arrive tail first, each just below the
//! last).
//!
//! Keys may belong to a *group* (LRU: the ranks `(request rank, -position)` of one request).
//! A grouped key that cannot join the list joins its group's *run* instead: a sorted linked
//! list of the group's members (the same per-chunk links), reached through a hash map from the
//! group (the last two groups reached are remembered, so a batch of one request's keys hashes
//! none), and extended at either end in O(1). So a request that ranks more chunks a step after
//! others were ranked (its stores after its prompt was loaded and touched) costs O(1) per chunk,
//! and O(log r) once per run, r being the number of runs, for the run's place in the order.
//! Any other insertion (a chunk whose old rank becomes evictable again, a grouped key that
//! falls inside its run) goes to a B-tree instead, in O(log n). The list, the runs and the
//! tree are each sorted, and iteration merges them, so the order starts at the least key.
//!
//! A member that stops being evictable (pinned by a load) is *held*: it keeps its place, so
//! being pinned and released at the same key costs O(1) and touches no neighbour. Iteration
//! skips held entries and reports them, and the caller detaches them after an eviction scan, so
//! a scan walks past a held chunk at most once per pin: eviction costs amortised O(1) per victim
//! whatever the number of pinned chunks. A chunk that is not evictable (pinned, or a pending
//! store) and gets a new key can be held at it directly (`insert_held`: the policies do so when
//! they re-rank a held chunk or take in a pending one), so its release there is O(1) as well. A
//! held chunk released after being detached (or at another key) is inserted anew.
//!
//! The per-chunk nodes (key and links) can live outside an order: a [`SharedOrder`] is given its
//! node array by each call, so orders over disjoint chunk sets share one array (ARC's T1 and T2:
//! a chunk is in one list at most), and an [`EvictionOrder`] is a `SharedOrder` with an array of
//! its own.

use crate::error::{ensure, Result};
use crate::key::KeyHasher;
use crate::pool::ChunkId;
use hashbrown::HashMap;
use std::collections::BTreeSet;
use std::iter::Peekable;

const NIL: u32 = u32::MAX;

/// How many tying entries a run's end is walked past to place a key among them.
const TIE_WALK: usize = 8;

/// A sort key of an [`EvictionOrder`], and the group it belongs to, if any (see the module
/// docs). Keys of different groups must not interleave: every key of a group sorts below every
/// key of a greater group, and keys without a group sort between groups, never inside one.
pub(crate) trait OrderKey: Ord + Copy + Default {
    /// The key's group (`None`: none).
    fn group(&self) -> Option<u64> {
        None
    }
}

impl OrderKey for u64 {}

/// LRU ranks `(request rank, -position)`: the ranks sharing a request rank form a group (a
/// fresh rank `(k, 0)` is a group of one, and always joins the list at its tail).
impl OrderKey for (u64, i64) {
    fn group(&self) -> Option<u64> {
        Some(self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Out,
    List,
    Tree,
    /// In its group's run.
    Run,
    /// Held (not a member) but still linked in the list, at its key.
    ListHeld,
    /// Held (not a member) but still in the tree, at its key.
    TreeHeld,
    /// Held (not a member) but still in its group's run, at its key.
    RunHeld,
}

/// A chunk's sort key and, when it is in the list or a run, the next (greater) and previous
/// entries there.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Node<K> {
    key: K,
    next: u32,
    prev: u32,
}

/// A group's run: its first and last chunk (the links between them are `next` and `prev`).
#[derive(Debug, Clone, Copy)]
struct Run {
    first: u32,
    last: u32,
}

/// The groups' runs: in a slab, found by group through a map, and the two groups looked up last
/// remembered with their places, so that a batch of one request's keys (joining its run, or
/// leaving it as the request finishes) finds the run without hashing its group each time.
#[derive(Debug, Clone, Default)]
struct Runs {
    slab: Vec<Run>,
    /// Places in `slab` no run holds.
    free: Vec<u32>,
    places: HashMap<u64, u32, KeyHasher>,
    /// The groups looked up last, most recent first, and their places.
    recent: [Option<(u64, u32)>; 2],
}

impl Runs {
    fn len(&self) -> usize {
        self.places.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.places.is_empty()
    }

    fn get(&self, g: u64) -> Option<&Run> {
        let at = match self.recent {
            [Some((r, at)), _] | [_, Some((r, at))] if r == g => at,
            _ => *self.places.get(&g)?,
        };
        Some(&self.slab[at as usize])
    }

    /// Group `g`'s run: the group looked up last is checked first, inline.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn get_mut(&mut self, g: u64) -> Option<&mut Run> {
        let at = match self.recent[0] {
            Some((r, at)) if r == g => at,
            _ => self.look_up(g)?,
        };
        Some(&mut self.slab[at as usize])
    }

    /// [`get_mut`](Self::get_mut)'s place of `g`, when `g` is not the group looked up last.
    #[inline(never)]
    fn look_up(&mut self, g: u64) -> Option<u32> {
        let at = match self.recent[1] {
            Some((r, at)) if r == g => at,
            _ => *self.places.get(&g)?,
        };
        self.recent = [Some((g, at)), self.recent[0]];
        Some(at)
    }

    /// Group `g`'s run, which it has none of yet.
    fn insert(&mut self, g: u64, run: Run) {
        let at = if let Some(at) = self.free.pop() {
            self.slab[at as usize] = run;
            at
        } else {
            self.slab.push(run);
            u32::try_from(self.slab.len() - 1).expect("fewer runs than chunks")
        };
        debug_assert!(!self.places.contains_key(&g));
        self.places.insert(g, at);
        self.recent = [Some((g, at)), self.recent[0]];
    }

    fn remove(&mut self, g: u64) {
        if let Some(at) = self.places.remove(&g) {
            self.free.push(at);
            for r in &mut self.recent {
                if r.is_some_and(|(h, _)| h == g) {
                    *r = None;
                }
            }
        }
    }

    /// Check every slab place is a run's or free, once, and the remembered places are right.
    fn validate(&self) -> Result<()> {
        let mut seen = vec![false; self.slab.len()];
        for &at in self.places.values().chain(&self.free) {
            let at = at as usize;
            ensure!(
                at < seen.len() && !std::mem::replace(&mut seen[at], true),
                "order: run place {at} used twice or out of range"
            );
        }
        ensure!(
            seen.iter().all(|&s| s),
            "order: a run place is neither used nor free"
        );
        for &(g, at) in self.recent.iter().flatten() {
            ensure!(
                self.places.get(&g) == Some(&at),
                "order: group {g}'s remembered run place is stale"
            );
        }
        Ok(())
    }

    fn clear(&mut self) {
        self.slab.clear();
        self.free.clear();
        self.places.clear();
        self.recent = [None; 2];
    }
}

/// An [`EvictionOrder`] whose nodes live outside it, in an array the caller passes to every
/// call: orders over disjoint sets of chunks (ARC's T1 and T2) share one array, a node per chunk
/// in all. Only the place of each chunk is the order's own.
#[derive(Debug, Clone)]
pub(crate) struct SharedOrder<K> {
    place: Vec<Place>,
    head: u32,
    tail: u32,
    /// The list member inserted last (`NIL` when it left the list).
    finger: u32,
    tree: BTreeSet<(K, ChunkId)>,
    /// Each group's run, by group.
    runs: Runs,
    /// The groups that have a run, in order (for iteration).
    run_groups: BTreeSet<u64>,
    /// Members (held entries excluded).
    len: usize,
}

impl<K: OrderKey> SharedOrder<K> {
    pub(crate) fn new() -> Self {
        Self {
            place: Vec::new(),
            head: NIL,
            tail: NIL,
            finger: NIL,
            tree: BTreeSet::new(),
            runs: Runs::default(),
            run_groups: BTreeSet::new(),
            len: 0,
        }
    }

    /// Make room for chunk ids `0..n` (the nodes: [`grow_nodes`]).
    pub(crate) fn grow(&mut self, n: usize) {
        if n > self.place.len() {
            crate::mem::resize_huge(&mut self.place, n, Place::Out);
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
            .is_some_and(|&p| matches!(p, Place::List | Place::Tree | Place::Run))
    }

    /// The sort key of member `c`.
    pub(crate) fn key_of(&self, nodes: &[Node<K>], c: ChunkId) -> Option<K> {
        self.contains(c).then(|| nodes[c as usize].key)
    }

    /// Start loading `c`'s place alone (not its node); changes nothing.
    pub(crate) fn prefetch_place(&self, c: ChunkId) {
        if let Some(p) = self.place.get(c as usize) {
            crate::mem::prefetch(p);
        }
    }

    /// Start loading `c`'s entry into the cache; changes nothing.
    pub(crate) fn prefetch(&self, nodes: &[Node<K>], c: ChunkId) {
        let i = c as usize;
        if i < self.place.len() {
            crate::mem::prefetch(&self.place[i]);
            crate::mem::prefetch(&nodes[i]);
        }
    }

    /// Start loading the links that removing `c` from the list rewrites (its neighbours').
    pub(crate) fn prefetch_neighbours(&self, nodes: &[Node<K>], c: ChunkId) {
        let i = c as usize;
        if i < self.place.len() && matches!(self.place[i], Place::List | Place::ListHeld) {
            let (p, n) = (nodes[i].prev, nodes[i].next);
            if p != NIL {
                crate::mem::prefetch(&nodes[p as usize]);
            }
            if n != NIL {
                crate::mem::prefetch(&nodes[n as usize]);
            }
        }
    }

    /// Give `c`, neither a member nor held, the key a later [`last_key`](Self::last_key)
    /// returns, without inserting it.
    pub(crate) fn set_key(&mut self, nodes: &mut [Node<K>], c: ChunkId, k: K) {
        debug_assert_eq!(self.place[c as usize], Place::Out);
        nodes[c as usize].key = k;
    }

    /// The key `c` is held at, when it is held.
    pub(crate) fn held_key_of(&self, nodes: &[Node<K>], c: ChunkId) -> Option<K> {
        self.place
            .get(c as usize)
            .is_some_and(|&p| matches!(p, Place::ListHeld | Place::TreeHeld | Place::RunHeld))
            .then(|| nodes[c as usize].key)
    }

    /// Add `c` with sort key `k` (`c` must be neither a member nor held).
    pub(crate) fn insert(&mut self, nodes: &mut [Node<K>], c: ChunkId, k: K) {
        let i = c as usize;
        debug_assert_eq!(self.place[i], Place::Out);
        nodes[i].key = k;
        self.len += 1;
        let me = (k, c);
        let entry = |m: u32| (nodes[m as usize].key, m);
        // The member after which `c` belongs, if that spot is the tail or next to the finger.
        let after = if self.tail == NIL || me > entry(self.tail) {
            Some(self.tail)
        } else if self.finger != NIL && me < entry(self.finger) {
            let p = nodes[self.finger as usize].prev;
            (p == NIL || entry(p) < me).then_some(p)
        } else if self.finger != NIL {
            let n = nodes[self.finger as usize].next;
            (n != NIL && me < entry(n)).then_some(self.finger)
        } else {
            None
        };
        if let Some(p) = after {
            self.link_after(nodes, c, p);
        } else if !self.join_run(nodes, c, k) {
            self.place[i] = Place::Tree;
            self.tree.insert(me);
        }
    }

    /// Put `c` (key `k`) at an end of its group's run, or start the run, or among the run's
    /// first or last few entries whose keys tie with `k` (the ranks of one token position in
    /// several KV groups); `false` when `k` has no group or falls elsewhere inside its run.
    fn join_run(&mut self, nodes: &mut [Node<K>], c: ChunkId, k: K) -> bool {
        let Some(g) = k.group() else { return false };
        let i = c as usize;
        let me = (k, c);
        let entry = |nodes: &[Node<K>], m: u32| (nodes[m as usize].key, m);
        match self.runs.get_mut(g) {
            None => {
                self.runs.insert(g, Run { first: c, last: c });
                self.run_groups.insert(g);
                nodes[i].prev = NIL;
                nodes[i].next = NIL;
            }
            Some(run) if me < entry(nodes, run.first) => {
                nodes[i].prev = NIL;
                nodes[i].next = run.first;
                nodes[run.first as usize].prev = c;
                run.first = c;
            }
            Some(run) if me > entry(nodes, run.last) => {
                nodes[i].prev = run.last;
                nodes[i].next = NIL;
                nodes[run.last as usize].next = c;
                run.last = c;
            }
            Some(run) => {
                let Some((before, after)) = Self::among_ties(nodes, *run, me) else {
                    return false;
                };
                nodes[i].prev = before;
                nodes[i].next = after;
                nodes[before as usize].next = c;
                nodes[after as usize].prev = c;
            }
        }
        self.place[i] = Place::Run;
        true
    }

    /// The neighbours `(p, n)` between which `me` (inside `run`, not at an end) belongs, when
    /// that spot is among at most [`TIE_WALK`] entries from an end of the run whose keys equal
    /// `me`'s: walked in O(1), where the tree would take O(log n). (Entries sort by key, then
    /// chunk id: walking from an end whose key is `me`'s, every entry passed ties with it.)
    // Out of line: rare with one KV group, and the insertions around it are hot.
    #[inline(never)]
    fn among_ties(nodes: &[Node<K>], run: Run, me: (K, ChunkId)) -> Option<(u32, u32)> {
        let entry = |m: u32| (nodes[m as usize].key, m);
        if nodes[run.first as usize].key == me.0 {
            let mut p = run.first;
            for _ in 0..TIE_WALK {
                let n = nodes[p as usize].next;
                if n == NIL {
                    return None;
                }
                if entry(n) > me {
                    return Some((p, n));
                }
                p = n;
            }
        } else if nodes[run.last as usize].key == me.0 {
            let mut n = run.last;
            for _ in 0..TIE_WALK {
                let p = nodes[n as usize].prev;
                if p == NIL {
                    return None;
                }
                if entry(p) < me {
                    return Some((p, n));
                }
                n = p;
            }
        }
        None
    }

    /// Link `c`'s neighbours in its chain (the list or a run) to each other; returns them
    /// (`NIL` at an end), for the caller to move the chain's ends.
    fn splice_out(nodes: &mut [Node<K>], c: ChunkId) -> (u32, u32) {
        let Node { prev, next, .. } = nodes[c as usize];
        if prev != NIL {
            nodes[prev as usize].next = next;
        }
        if next != NIL {
            nodes[next as usize].prev = prev;
        }
        (prev, next)
    }

    /// Take `chunk` (in the run of `group`) out of the run; the run goes when it empties.
    fn leave_run(&mut self, nodes: &mut [Node<K>], chunk: ChunkId, group: u64) {
        let (before, after) = Self::splice_out(nodes, chunk);
        match (before, after) {
            (NIL, NIL) => {
                self.runs.remove(group);
                self.run_groups.remove(&group);
            }
            (NIL, _) => {
                if let Some(run) = self.runs.get_mut(group) {
                    run.first = after;
                }
            }
            (_, NIL) => {
                if let Some(run) = self.runs.get_mut(group) {
                    run.last = before;
                }
            }
            _ => {}
        }
    }

    /// Link `c` into the list right after `p` (`NIL`: at the head).
    fn link_after(&mut self, nodes: &mut [Node<K>], c: ChunkId, p: u32) {
        let i = c as usize;
        let n = if p == NIL {
            self.head
        } else {
            nodes[p as usize].next
        };
        self.place[i] = Place::List;
        nodes[i].prev = p;
        nodes[i].next = n;
        if p == NIL {
            self.head = c;
        } else {
            nodes[p as usize].next = c;
        }
        if n == NIL {
            self.tail = c;
        } else {
            nodes[n as usize].prev = c;
        }
        self.finger = c;
    }

    /// Drop `c` if it is a member or held.
    pub(crate) fn remove(&mut self, nodes: &mut [Node<K>], c: ChunkId) {
        let i = c as usize;
        let place = self.place.get(i).copied().unwrap_or(Place::Out);
        match place {
            Place::Out => return,
            Place::Tree | Place::TreeHeld => {
                self.tree.remove(&(nodes[i].key, c));
            }
            Place::Run | Place::RunHeld => {
                if let Some(g) = nodes[i].key.group() {
                    self.leave_run(nodes, c, g);
                }
            }
            Place::List | Place::ListHeld => {
                if self.finger == c {
                    self.finger = NIL;
                }
                let (p, n) = Self::splice_out(nodes, c);
                if p == NIL {
                    self.head = n;
                }
                if n == NIL {
                    self.tail = p;
                }
            }
        }
        self.place[i] = Place::Out;
        if matches!(place, Place::List | Place::Tree | Place::Run) {
            self.len -= 1;
        }
    }

    /// Drop every chunk of `cs` (each a member or held, or absent): at once when they are the
    /// list's first members in order (what an eviction that passed nothing by takes), so no
    /// neighbour between them is relinked; otherwise one by one.
    pub(crate) fn remove_all(&mut self, nodes: &mut [Node<K>], cs: &[ChunkId]) {
        if cs.is_empty() {
            return;
        }
        let mut at = self.head;
        let prefix = cs.iter().all(|&c| {
            let here = at == c && self.place.get(c as usize) == Some(&Place::List);
            if here {
                at = nodes[c as usize].next;
            }
            here
        });
        if !prefix {
            for &c in cs {
                self.remove(nodes, c);
            }
            return;
        }
        self.cut(nodes, cs, at);
    }

    /// [`remove_all`](Self::remove_all) of `cs` that the caller knows to be the list's first
    /// members in order (a scan of a list alone that took every member it met, the held
    /// entries it passed removed since): cut at once, without checking.
    pub(crate) fn cut_prefix(&mut self, nodes: &mut [Node<K>], cs: &[ChunkId]) {
        let Some(&last) = cs.last() else {
            return;
        };
        debug_assert!({
            let mut at = self.head;
            cs.iter().all(|&c| {
                let here = at == c && self.place[c as usize] == Place::List;
                at = nodes[c as usize].next;
                here
            })
        });
        let at = nodes[last as usize].next;
        self.cut(nodes, cs, at);
    }

    /// Drop `cs`, the list's first members in order, `at` the entry after them.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn cut(&mut self, nodes: &mut [Node<K>], cs: &[ChunkId], at: u32) {
        for &c in cs {
            self.place[c as usize] = Place::Out;
            if self.finger == c {
                self.finger = NIL;
            }
        }
        self.head = at;
        if at == NIL {
            self.tail = NIL;
        } else {
            nodes[at as usize].prev = NIL;
        }
        self.len -= cs.len();
    }

    /// Member `c` stops being one but keeps its place (see the module docs).
    pub(crate) fn hold(&mut self, c: ChunkId) {
        let p = &mut self.place[c as usize];
        *p = match *p {
            Place::List => Place::ListHeld,
            Place::Tree => Place::TreeHeld,
            Place::Run => Place::RunHeld,
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
    pub(crate) fn insert_held(&mut self, nodes: &mut [Node<K>], c: ChunkId, k: K) {
        self.insert(nodes, c, k);
        self.hold(c);
    }

    /// Give `c` the key `k`, which must sort above every key in the order (a fresh rank), and
    /// put it at the list's tail: a member stays a member, a held entry stays held. Returns
    /// `false`, changing nothing, when `c` is neither. The same as [`remove`](Self::remove)
    /// then [`insert`](Self::insert) (and [`hold`](Self::hold) for a held entry), with the
    /// list's tail known to be the spot: the move that recency policies make most. Its
    /// unlinking repeats `remove`'s on purpose: sharing one routine cost ~25 instructions a move.
    pub(crate) fn move_to_tail(&mut self, nodes: &mut [Node<K>], c: ChunkId, k: K) -> bool {
        let i = c as usize;
        let Some(&place) = self.place.get(i) else {
            return false;
        };
        let held = match place {
            Place::Out => return false,
            Place::List | Place::ListHeld => {
                let held = place == Place::ListHeld;
                if self.tail == c {
                    // Already last: only the key changes.
                    nodes[i].key = k;
                    self.finger = c;
                    return true;
                }
                let (before, after) = Self::splice_out(nodes, c);
                if before == NIL {
                    self.head = after;
                }
                // `c` is not the tail, so `after` is not NIL and the tail stays.
                held
            }
            Place::Tree | Place::TreeHeld => {
                self.tree.remove(&(nodes[i].key, c));
                place == Place::TreeHeld
            }
            Place::Run | Place::RunHeld => {
                if let Some(g) = nodes[i].key.group() {
                    self.leave_run(nodes, c, g);
                }
                place == Place::RunHeld
            }
        };
        self.link_last(nodes, c, k, held);
        true
    }

    /// Add `c` (neither a member nor held) with key `k`, which must sort above every key in the
    /// order (a fresh rank, a new sequence number): at the list's tail, held when `held`. The
    /// same as [`insert`](Self::insert) (then [`hold`](Self::hold)), in fewer steps.
    pub(crate) fn push_last(&mut self, nodes: &mut [Node<K>], c: ChunkId, k: K, held: bool) {
        debug_assert_eq!(self.place[c as usize], Place::Out);
        self.link_last(nodes, c, k, held);
        if !held {
            self.len += 1;
        }
    }

    /// Link `c`, in no chain, at the list's tail with key `k` (above every key), as a member or
    /// held; the member count is the caller's.
    fn link_last(&mut self, nodes: &mut [Node<K>], c: ChunkId, k: K, held: bool) {
        let i = c as usize;
        debug_assert!(self.tail == NIL || (nodes[self.tail as usize].key, self.tail) < (k, c));
        let tail = self.tail;
        nodes[i] = Node {
            key: k,
            next: NIL,
            prev: tail,
        };
        if tail == NIL {
            self.head = c;
        } else {
            nodes[tail as usize].next = c;
        }
        self.tail = c;
        self.finger = c;
        self.place[i] = if held { Place::ListHeld } else { Place::List };
    }

    /// Make `c` a member again with sort key `k`: in O(1) if it is still held at `k`. (The
    /// policies release at a chunk's own key, [`release_in_place`](Self::release_in_place);
    /// the tests also release at others.)
    #[cfg(test)]
    pub(crate) fn release(&mut self, nodes: &mut [Node<K>], c: ChunkId, k: K) {
        if !(nodes[c as usize].key == k && self.unhold(c)) {
            self.remove(nodes, c);
            self.insert(nodes, c, k);
        }
    }

    /// Make `c` a member again at the key it has ([`last_key`]). A chunk held in place is
    /// released reading its place alone, not its node (in a large pool the node is another
    /// miss); a detached one is inserted anew at that key.
    // Inlined into the policies' releases (a pin's release is one place update), the rare
    // reinsertion left out of line.
    #[inline]
    pub(crate) fn release_in_place(&mut self, nodes: &mut [Node<K>], c: ChunkId) {
        if !self.unhold(c) {
            self.reinsert(nodes, c);
        }
    }

    /// Insert `c`, detached, anew at the key it has.
    #[inline(never)]
    fn reinsert(&mut self, nodes: &mut [Node<K>], c: ChunkId) {
        let k = nodes[c as usize].key;
        self.remove(nodes, c);
        self.insert(nodes, c, k);
    }

    /// A held `c` a member again where it is held (the inverse of [`hold`](Self::hold));
    /// `false`, changing nothing, if `c` is not held.
    #[inline]
    fn unhold(&mut self, c: ChunkId) -> bool {
        let p = &mut self.place[c as usize];
        *p = match *p {
            Place::ListHeld => Place::List,
            Place::TreeHeld => Place::Tree,
            Place::RunHeld => Place::Run,
            _ => return false,
        };
        self.len += 1;
        true
    }

    /// Whether the list alone holds the order's entries (no tree, no runs): a scan then walks
    /// the list from its head.
    pub(crate) fn list_only(&self) -> bool {
        self.tree.is_empty() && self.run_groups.is_empty()
    }

    /// Members in ascending `(key, chunk)` order. Held entries met on the way are appended to
    /// `held`; pass them to [`remove`](Self::remove) once the scan is over.
    pub(crate) fn iter<'a>(
        &'a self,
        nodes: &'a [Node<K>],
        held: &'a mut Vec<ChunkId>,
    ) -> Iter<'a, K> {
        Iter {
            order: self,
            nodes,
            list: self.head,
            tree: self.tree.iter().peekable(),
            groups: self.run_groups.iter(),
            run: NIL,
            more_runs: !self.run_groups.is_empty(),
            list_only: self.list_only(),
            held,
        }
    }

    /// Forget every member.
    pub(crate) fn clear(&mut self) {
        self.place.clear();
        self.head = NIL;
        self.tail = NIL;
        self.finger = NIL;
        self.tree.clear();
        self.runs.clear();
        self.run_groups.clear();
        self.len = 0;
    }

    /// Walk the links from `first` (the list's head, or a run's first entry): every entry in
    /// one of `places` (member, held), of `group` when one is given, linked both ways and
    /// ascending. Returns the last entry, the members and the entries walked.
    fn check_chain(
        &self,
        nodes: &[Node<K>],
        first: u32,
        places: [Place; 2],
        group: Option<u64>,
    ) -> Result<(u32, usize, usize)> {
        let (mut members, mut walked) = (0, 0);
        let (mut prev, mut c) = (NIL, first);
        while c != NIL {
            let i = c as usize;
            ensure!(
                places.contains(&self.place[i])
                    && group.is_none_or(|g| nodes[i].key.group() == Some(g)),
                "order: chunk {c} linked in a chain ({group:?}) it does not belong to"
            );
            ensure!(nodes[i].prev == prev, "order: chunk {c} back link broken");
            if prev != NIL {
                ensure!(
                    (nodes[prev as usize].key, prev) < (nodes[i].key, c),
                    "order: chain ({group:?}) not ascending at chunk {c}"
                );
            }
            members += usize::from(self.place[i] == places[0]);
            walked += 1;
            ensure!(
                walked <= self.place.len(),
                "order: chain longer than the chunk count (cycle?)"
            );
            prev = c;
            c = nodes[i].next;
        }
        Ok((prev, members, walked))
    }

    /// Check the list and the runs are sorted and linked both ways, and the counts add up.
    pub(crate) fn validate(&self, nodes: &[Node<K>]) -> Result<()> {
        let (tail, mut n, linked) =
            self.check_chain(nodes, self.head, [Place::List, Place::ListHeld], None)?;
        ensure!(tail == self.tail, "order: tail is not the last list member");
        for &(k, c) in &self.tree {
            let i = c as usize;
            ensure!(
                matches!(self.place[i], Place::Tree | Place::TreeHeld) && nodes[i].key == k,
                "order: stale tree entry for chunk {c}"
            );
            n += usize::from(self.place[i] == Place::Tree);
        }
        ensure!(
            self.runs.len() == self.run_groups.len(),
            "order: runs and run groups differ"
        );
        self.runs.validate()?;
        let mut in_runs = 0;
        for &g in &self.run_groups {
            let first = self.runs.get(g).map_or(NIL, |r| r.first);
            ensure!(first != NIL, "order: group {g} listed without a run");
            let (last, members, walked) =
                self.check_chain(nodes, first, [Place::Run, Place::RunHeld], Some(g))?;
            ensure!(
                self.runs.get(g).is_some_and(|r| r.last == last),
                "order: group {g}'s run ends elsewhere"
            );
            n += members;
            in_runs += walked;
        }
        ensure!(n == self.len, "order: member count drifted");
        let in_place = |p: Place| self.place.iter().filter(|&&q| q == p).count();
        ensure!(
            in_place(Place::ListHeld) + in_place(Place::List) == linked
                && in_place(Place::TreeHeld) + in_place(Place::Tree) == self.tree.len()
                && in_place(Place::RunHeld) + in_place(Place::Run) == in_runs,
            "order: a chunk is marked linked but is not, or the reverse"
        );
        let members = in_place(Place::List) + in_place(Place::Tree) + in_place(Place::Run);
        ensure!(
            members == self.len,
            "order: {members} chunks marked, count says {}",
            self.len
        );
        Ok(())
    }
}

/// The key `c` was last given in `nodes` (by an insertion or `set_key`), whatever
/// its place now: a removal keeps it, so a policy can keep each chunk's key here alone.
pub(crate) fn last_key<K: Copy>(nodes: &[Node<K>], c: ChunkId) -> K {
    nodes[c as usize].key
}

/// Make room in a node array for chunk ids `0..n`.
pub(crate) fn grow_nodes<K: OrderKey>(nodes: &mut Vec<Node<K>>, n: usize) {
    if n > nodes.len() {
        let blank = Node {
            key: K::default(),
            next: NIL,
            prev: NIL,
        };
        crate::mem::resize_huge(nodes, n, blank);
    }
}

/// An ordered set of chunks keyed by `(K, chunk)`; see the module docs. A [`SharedOrder`] with
/// a node array of its own.
#[derive(Debug, Clone)]
pub(crate) struct EvictionOrder<K> {
    order: SharedOrder<K>,
    /// Each chunk's key and links, side by side: an insertion or removal reads and writes one
    /// line per chunk it touches (the chunk, its neighbours), not one per array.
    nodes: Vec<Node<K>>,
}

impl<K: OrderKey> EvictionOrder<K> {
    pub(crate) fn new() -> Self {
        Self {
            order: SharedOrder::new(),
            nodes: Vec::new(),
        }
    }

    /// Make room for chunk ids `0..n`.
    pub(crate) fn grow(&mut self, n: usize) {
        self.order.grow(n);
        grow_nodes(&mut self.nodes, n);
    }

    /// Number of members.
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether `c` is a member (held entries are not).
    pub(crate) fn contains(&self, c: ChunkId) -> bool {
        self.order.contains(c)
    }

    /// See [`SharedOrder::prefetch`].
    pub(crate) fn prefetch(&self, c: ChunkId) {
        self.order.prefetch(&self.nodes, c);
    }

    /// See [`SharedOrder::prefetch_neighbours`].
    pub(crate) fn prefetch_neighbours(&self, c: ChunkId) {
        self.order.prefetch_neighbours(&self.nodes, c);
    }

    /// See [`last_key`].
    pub(crate) fn last_key(&self, c: ChunkId) -> K {
        last_key(&self.nodes, c)
    }

    /// See [`SharedOrder::set_key`].
    pub(crate) fn set_key(&mut self, c: ChunkId, k: K) {
        self.order.set_key(&mut self.nodes, c, k);
    }

    /// See [`SharedOrder::held_key_of`].
    pub(crate) fn held_key_of(&self, c: ChunkId) -> Option<K> {
        self.order.held_key_of(&self.nodes, c)
    }

    /// See [`SharedOrder::insert`].
    pub(crate) fn insert(&mut self, c: ChunkId, k: K) {
        self.order.insert(&mut self.nodes, c, k);
    }

    /// See [`SharedOrder::remove`].
    pub(crate) fn remove(&mut self, c: ChunkId) {
        self.order.remove(&mut self.nodes, c);
    }

    /// See [`SharedOrder::remove_all`].
    pub(crate) fn remove_all(&mut self, cs: &[ChunkId]) {
        self.order.remove_all(&mut self.nodes, cs);
    }

    /// See [`SharedOrder::hold`].
    pub(crate) fn hold(&mut self, c: ChunkId) {
        self.order.hold(c);
    }

    /// See [`SharedOrder::insert_held`].
    pub(crate) fn insert_held(&mut self, c: ChunkId, k: K) {
        self.order.insert_held(&mut self.nodes, c, k);
    }

    /// See [`SharedOrder::move_to_tail`].
    pub(crate) fn move_to_tail(&mut self, c: ChunkId, k: K) -> bool {
        self.order.move_to_tail(&mut self.nodes, c, k)
    }

    /// See [`SharedOrder::push_last`].
    pub(crate) fn push_last(&mut self, c: ChunkId, k: K, held: bool) {
        self.order.push_last(&mut self.nodes, c, k, held);
    }

    /// See [`SharedOrder::release`].
    #[cfg(test)]
    pub(crate) fn release(&mut self, c: ChunkId, k: K) {
        self.order.release(&mut self.nodes, c, k);
    }

    /// See [`SharedOrder::release_in_place`].
    pub(crate) fn release_in_place(&mut self, c: ChunkId) {
        self.order.release_in_place(&mut self.nodes, c);
    }

    /// See [`SharedOrder::iter`].
    pub(crate) fn iter<'a>(&'a self, held: &'a mut Vec<ChunkId>) -> Iter<'a, K> {
        self.order.iter(&self.nodes, held)
    }

    /// Forget every member.
    pub(crate) fn clear(&mut self) {
        self.order.clear();
        self.nodes.clear();
    }

    /// See [`SharedOrder::validate`].
    pub(crate) fn validate(&self) -> Result<()> {
        self.order.validate(&self.nodes)
    }
}

/// Merge of the list, the runs and the tree, ascending, skipping (and reporting) held entries.
pub(crate) struct Iter<'a, K> {
    order: &'a SharedOrder<K>,
    nodes: &'a [Node<K>],
    list: u32,
    tree: Peekable<std::collections::btree_set::Iter<'a, (K, ChunkId)>>,
    /// The groups whose runs are still to come, and the next entry of the current run.
    groups: std::collections::btree_set::Iter<'a, u64>,
    run: u32,
    /// Whether `groups` may have more.
    more_runs: bool,
    /// The tree and the runs are empty: the list alone is the order.
    list_only: bool,
    held: &'a mut Vec<ChunkId>,
}

impl<K: OrderKey> Iter<'_, K> {
    /// The next entry of the merge, held or not. The list alone (the usual order) is walked
    /// inline; the merge with the tree and the runs is out of line.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn next_entry(&mut self) -> Option<(K, ChunkId)> {
        if self.list_only {
            let c = self.list;
            let node = self.nodes.get(c as usize)?;
            self.list = node.next;
            return Some((node.key, c));
        }
        self.next_merged()
    }

    /// [`next_entry`](Self::next_entry) of an order with a tree or runs.
    #[inline(never)]
    fn next_merged(&mut self) -> Option<(K, ChunkId)> {
        let o = self.order;
        if self.run == NIL && self.more_runs {
            match self.groups.next() {
                Some(&g) => self.run = o.runs.get(g).map_or(NIL, |r| r.first),
                None => self.more_runs = false,
            }
        }
        let from_list = (self.list != NIL).then(|| (self.nodes[self.list as usize].key, self.list));
        let from_tree = self.tree.peek().map(|&&t| t);
        // The lesser of the list's and the tree's heads, then of that and the run's.
        let (mut best, mut from) = match (from_list, from_tree) {
            (Some(l), Some(t)) if t < l => (Some(t), Source::Tree),
            (Some(l), _) => (Some(l), Source::List),
            (None, t) => (t, Source::Tree),
        };
        if self.run != NIL {
            let r = (self.nodes[self.run as usize].key, self.run);
            if best.is_none_or(|b| r < b) {
                (best, from) = (Some(r), Source::Run);
            }
        }
        let (k, c) = best?;
        match from {
            Source::List => self.list = self.nodes[c as usize].next,
            Source::Run => self.run = self.nodes[c as usize].next,
            Source::Tree => {
                self.tree.next();
            }
        }
        Some((k, c))
    }
}

/// Where the merge's next entry comes from.
#[derive(Clone, Copy)]
enum Source {
    List,
    Run,
    Tree,
}

impl<K: OrderKey> Iterator for Iter<'_, K> {
    type Item = (K, ChunkId);

    // Inlined into the eviction scans: out of line, its result went back through memory, and
    // the caller's wider reads of it waited on the narrower writes (store-forwarding stalls).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn next(&mut self) -> Option<(K, ChunkId)> {
        loop {
            let (k, c) = self.next_entry()?;
            if matches!(
                self.order.place[c as usize],
                Place::List | Place::Tree | Place::Run
            ) {
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
    fn remove_all_cuts_a_head_prefix_or_removes_one_by_one() {
        let build = || {
            let mut o: EvictionOrder<u64> = EvictionOrder::new();
            o.grow(8);
            for c in 0..6 {
                o.insert(c, 10 * u64::from(c) + 10);
            }
            o.insert(6, 5); // below the tail: the tree, first in the order
            o
        };
        let order = |o: &EvictionOrder<u64>| -> Vec<ChunkId> {
            o.iter(&mut Vec::new()).map(|(_, c)| c).collect()
        };
        // The list's first members: cut at once.
        let mut o = build();
        o.remove_all(&[0, 1, 2]);
        o.validate().unwrap();
        assert_eq!(order(&o), vec![6, 3, 4, 5]);
        assert_eq!(o.len(), 4);
        // The whole list, then an insert at the tail.
        o.remove_all(&[3, 4, 5]);
        o.validate().unwrap();
        assert_eq!(order(&o), vec![6]);
        o.insert(7, 100);
        o.validate().unwrap();
        assert_eq!(order(&o), vec![6, 7]);
        // `cut_prefix`, told so, cuts the same (the finger, at 5, goes with the whole list).
        let mut o = build();
        o.order.cut_prefix(&mut o.nodes, &[0, 1, 2]);
        o.validate().unwrap();
        assert_eq!((order(&o), o.len()), (vec![6, 3, 4, 5], 4));
        o.order.cut_prefix(&mut o.nodes, &[]);
        o.order.cut_prefix(&mut o.nodes, &[3, 4, 5]);
        o.validate().unwrap();
        assert_eq!(order(&o), vec![6]);
        o.grow(9);
        o.insert(7, 100);
        o.insert(8, 99); // below the tail: next to the finger (7) if it is kept, else the tree
        o.validate().unwrap();
        assert_eq!(order(&o), vec![6, 8, 7]);
        // Not a prefix (a gap, the tree, out of order, held): one by one, the same result.
        for cs in [&[0, 2][..], &[6, 0], &[1, 0], &[0, 1]] {
            let mut o = build();
            if cs == [0, 1] {
                o.hold(1);
            }
            o.remove_all(cs);
            o.validate().unwrap();
            let mut want = build();
            if cs == [0, 1] {
                want.hold(1);
            }
            for &c in cs {
                want.remove(c);
            }
            assert_eq!(order(&o), order(&want), "{cs:?}");
            assert_eq!(o.len(), want.len(), "{cs:?}");
        }
    }

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
        assert!(
            o.order.tree.is_empty(),
            "each went next to the previous insert"
        );
        o.insert(4, (3, 0));
        o.insert(5, (2, -40)); // between 2 and 3, not next to the finger (4): group 2's run
        o.validate().unwrap();
        assert_eq!(
            o.iter(&mut Vec::new()).map(|(_, c)| c).collect::<Vec<_>>(),
            vec![0, 3, 5, 2, 1, 4]
        );
        o.remove(4);
        o.insert(6, (2, -20)); // finger gone, below the tail: the run's new last entry
        o.validate().unwrap();
        assert_eq!(
            o.iter(&mut Vec::new()).map(|(_, c)| c).collect::<Vec<_>>(),
            vec![0, 3, 5, 2, 6, 1]
        );
    }

    #[test]
    fn a_group_ranked_later_forms_a_run_merged_in_order() {
        let mut o: EvictionOrder<(u64, i64)> = EvictionOrder::new();
        o.grow(12);
        // Request 1 ranks a chunk; fresh ranks 2 and 3 follow; then request 1 ranks more.
        o.insert(0, (1, 0));
        o.insert(1, (2, 0));
        o.insert(2, (3, 0));
        o.insert(3, (1, -16)); // below the tail, not next to the finger: starts group 1's run
        o.insert(4, (1, -32)); // below the run's first
        o.insert(5, (1, -8)); // above the run's last
        o.insert(6, (1, -20)); // inside the run: the tree
        assert_eq!(
            (
                o.order.runs.len(),
                o.order.run_groups.len(),
                o.order.tree.len()
            ),
            (1, 1, 1)
        );
        o.validate().unwrap();
        let all = |o: &EvictionOrder<(u64, i64)>| {
            o.iter(&mut Vec::new()).map(|(_, c)| c).collect::<Vec<_>>()
        };
        assert_eq!(all(&o), vec![4, 6, 3, 5, 0, 1, 2]);
        // A second group's run sorts after the first's.
        o.insert(7, (2, -4));
        o.insert(8, (2, -12));
        assert_eq!(o.order.runs.len(), 2);
        assert_eq!(all(&o), vec![4, 6, 3, 5, 0, 8, 7, 1, 2]);
        // Held run entries keep their place; a scan reports them; leaving ends the run's ends.
        o.hold(4);
        o.hold(3);
        assert!(!o.contains(4) && o.held_key_of(4) == Some((1, -32)));
        o.release(3, (1, -16)); // same key: back in place
        let mut held = Vec::new();
        let seen: Vec<ChunkId> = o.iter(&mut held).map(|(_, c)| c).collect();
        assert_eq!((seen, held), (vec![6, 3, 5, 0, 8, 7, 1, 2], vec![4]));
        o.validate().unwrap();
        o.remove(4); // the run's first
        o.remove(5); // its last
        o.validate().unwrap();
        assert_eq!(o.order.runs.get(1).map(|r| r.first), Some(3));
        assert_eq!(o.order.runs.get(1).map(|r| r.last), Some(3));
        o.remove(3); // its only entry: the run goes
        o.remove(7);
        o.remove(8);
        assert!(o.order.runs.is_empty() && o.order.run_groups.is_empty());
        assert_eq!(all(&o), vec![6, 0, 1, 2]);
        assert_eq!(o.len(), 4);
        o.validate().unwrap();
        o.insert(9, (3, -1));
        o.clear();
        assert!(o.order.runs.is_empty() && o.order.run_groups.is_empty());
        o.validate().unwrap();
    }

    #[test]
    fn validate_catches_a_broken_run() {
        let mut o: EvictionOrder<(u64, i64)> = EvictionOrder::new();
        o.grow(4);
        o.insert(0, (1, 0));
        o.insert(1, (2, 0));
        o.insert(2, (1, -8));
        o.insert(3, (1, -16));
        o.validate().unwrap();
        o.order.runs.get_mut(1).unwrap().last = 3;
        assert!(o.validate().is_err());
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
    fn release_in_place_restores_a_held_entry_and_reinserts_a_detached_one() {
        let mut o: EvictionOrder<(u64, i64)> = EvictionOrder::new();
        o.grow(6);
        o.insert(0, (1, 0)); // the list
        o.insert(1, (2, 0));
        o.insert(2, (3, 0));
        o.insert(3, (1, -16)); // group 1's run
        o.insert(4, (1, -32));
        o.insert(5, (1, -20)); // inside the run: the tree
        let places = |o: &EvictionOrder<(u64, i64)>| o.order.place[..6].to_vec();
        let before = places(&o);
        assert_eq!(
            &before[1..],
            [
                Place::List,
                Place::List,
                Place::Run,
                Place::Run,
                Place::Tree
            ]
        );
        for c in [1, 3, 5] {
            o.hold(c);
        }
        o.validate().unwrap();
        for c in [1, 3, 5] {
            o.release_in_place(c); // back where each was, at its own key, in O(1)
        }
        assert_eq!((places(&o), o.len()), (before, 6));
        o.validate().unwrap();
        let all = |o: &EvictionOrder<(u64, i64)>| {
            o.iter(&mut Vec::new()).map(|(_, c)| c).collect::<Vec<_>>()
        };
        assert_eq!(all(&o), vec![4, 5, 3, 0, 1, 2]);
        // Detached by a scan: inserted anew, at the key it had.
        o.hold(0);
        let mut held = Vec::new();
        assert_eq!(o.iter(&mut held).count(), 5);
        for c in held {
            o.remove(c);
        }
        o.release_in_place(0);
        assert_eq!((all(&o), o.last_key(0)), (vec![4, 5, 3, 0, 1, 2], (1, 0)));
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
        assert!(o.order.tree.is_empty());
        assert_eq!((o.len(), o.held_key_of(0)), (1, Some(30)));
        o.insert(2, 40);
        o.validate().unwrap();
        let mut held = Vec::new();
        assert_eq!(o.iter(&mut held).count(), 2);
        assert_eq!(held, vec![0]);
        o.release(0, 30); // no scan detached it: back in place, not in the tree
        assert!(o.order.tree.is_empty());
        assert_eq!(
            o.iter(&mut Vec::new()).collect::<Vec<_>>(),
            vec![(20, 1), (30, 0), (40, 2)]
        );
        o.validate().unwrap();
    }

    #[test]
    fn move_to_tail_of_the_last_entry_changes_its_key_alone() {
        let mut o: EvictionOrder<(u64, i64)> = EvictionOrder::new();
        o.grow(3);
        o.insert(0, (1, 0));
        o.insert(1, (2, 0));
        assert!(o.move_to_tail(1, (3, 0)));
        assert!(
            !o.move_to_tail(2, (4, 0)),
            "not in the order: nothing changes"
        );
        assert_eq!(o.last_key(2), (0, 0));
        o.hold(0);
        assert!(o.move_to_tail(0, (5, 0)));
        assert_eq!((o.len(), o.held_key_of(0)), (1, Some((5, 0))));
        o.validate().unwrap();
        let mut held = Vec::new();
        assert_eq!(o.iter(&mut held).collect::<Vec<_>>(), vec![((3, 0), 1)]);
        assert_eq!(held, vec![0]);
    }

    /// One step of [`fresh_keys_to_the_tail_match_the_general_steps`]: on chunk `c` (of 8), with a
    /// request rank (`group`) and a position for the keys that need them.
    #[derive(Debug, Clone)]
    enum Op {
        /// Insert at a fresh rank, or at `(group, -pos)` when `pos` is given.
        Insert(ChunkId, Option<(u64, i64)>),
        /// Insert held at a fresh rank (a pending store).
        InsertHeld(ChunkId),
        Hold(ChunkId),
        Release(ChunkId),
        Remove(ChunkId),
        /// Detach every held entry, as an eviction scan does.
        Scan,
        /// A fresh rank, to the tail.
        Refresh(ChunkId),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let c = 0u32..8;
        prop_oneof![
            (c.clone(), proptest::option::of((0u64..3, 0i64..6)))
                .prop_map(|(c, r)| Op::Insert(c, r)),
            c.clone().prop_map(Op::InsertHeld),
            c.clone().prop_map(Op::Hold),
            c.clone().prop_map(Op::Release),
            c.clone().prop_map(Op::Remove),
            Just(Op::Scan),
            c.prop_map(Op::Refresh),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 256, failure_persistence: None, ..Default::default()
        })]

        /// Inserts and removes of grouped keys with many ties iterate exactly as a sorted set
        /// of `(key, chunk)` does, and the order stays valid. Four groups: more than the runs
        /// remember (two), so their lookups also miss, and runs end and start again.
        #[test]
        fn tied_ranks_iterate_as_a_sorted_set(
            ops in proptest::collection::vec((0u32..16, proptest::option::of((1u64..5, 0i64..4))), 1..120)
        ) {
            let mut o: EvictionOrder<(u64, i64)> = EvictionOrder::new();
            o.grow(16);
            let mut model: BTreeSet<((u64, i64), ChunkId)> = BTreeSet::new();
            for (c, rank) in ops {
                let inside = model.iter().find(|&&(_, m)| m == c).copied();
                match (rank, inside) {
                    (Some(r), None) => {
                        o.insert(c, r);
                        model.insert((r, c));
                    }
                    (None, Some(entry)) => {
                        o.remove(c);
                        model.remove(&entry);
                    }
                    _ => {}
                }
                o.validate().unwrap();
                let seen: Vec<((u64, i64), ChunkId)> = o.iter(&mut Vec::new()).collect();
                proptest::prop_assert_eq!(seen, model.iter().copied().collect::<Vec<_>>());
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 512, failure_persistence: None, ..Default::default()
        })]

        /// `move_to_tail` and `push_last` leave the order exactly as the general steps would
        /// (same members, held entries, keys, iteration order and counts), whatever state the
        /// entry is in.
        #[test]
        fn fresh_keys_to_the_tail_match_the_general_steps(ops in proptest::collection::vec(op(), 1..80)) {
            let mut fast: EvictionOrder<(u64, i64)> = EvictionOrder::new();
            let mut slow: EvictionOrder<(u64, i64)> = EvictionOrder::new();
            fast.grow(8);
            slow.grow(8);
            // Fresh ranks start above every request rank a test uses.
            let mut next = 10u64;
            for op in ops {
                // A fresh rank: the fast order takes it through `push_last`.
                if let Op::Insert(c, None) | Op::InsertHeld(c) = op {
                    if slow.order.place[c as usize] == Place::Out {
                        let held = matches!(op, Op::InsertHeld(_));
                        fast.push_last(c, (next, 0), held);
                        if held {
                            slow.insert_held(c, (next, 0));
                        } else {
                            slow.insert(c, (next, 0));
                        }
                    }
                }
                for o in [&mut fast, &mut slow] {
                    match op {
                        Op::Insert(c, Some((g, p))) if o.order.place[c as usize] == Place::Out => {
                            o.insert(c, (g, -p));
                        }
                        Op::Hold(c) if o.contains(c) => o.hold(c),
                        Op::Release(c) => {
                            if let Some(k) = o.held_key_of(c) {
                                o.release(c, k);
                            }
                        }
                        Op::Remove(c) => o.remove(c),
                        Op::Scan => {
                            let mut held = Vec::new();
                            o.iter(&mut held).for_each(drop);
                            for c in held {
                                o.remove(c);
                            }
                        }
                        _ => {}
                    }
                }
                if let Op::Insert(_, None) | Op::InsertHeld(_) = op {
                    next += 1;
                }
                if let Op::Refresh(c) = op {
                    let k = (next, 0);
                    next += 1;
                    let moved = fast.move_to_tail(c, k);
                    if slow.contains(c) {
                        slow.remove(c);
                        slow.insert(c, k);
                    } else if slow.held_key_of(c).is_some() {
                        slow.remove(c);
                        slow.insert_held(c, k);
                    } else {
                        proptest::prop_assert!(!moved);
                    }
                }
                fast.validate().unwrap();
                slow.validate().unwrap();
                let (mut hf, mut hs) = (Vec::new(), Vec::new());
                let af: Vec<_> = fast.iter(&mut hf).collect();
                let as_: Vec<_> = slow.iter(&mut hs).collect();
                proptest::prop_assert_eq!(af, as_);
                proptest::prop_assert_eq!(hf, hs);
                proptest::prop_assert_eq!(fast.len(), slow.len());
                for c in 0..8 {
                    proptest::prop_assert_eq!(fast.held_key_of(c), slow.held_key_of(c));
                    proptest::prop_assert_eq!(fast.order.key_of(&fast.nodes, c), slow.order.key_of(&slow.nodes, c));
                }
            }
        }
    }

    #[test]
    fn ties_at_a_run_end_stay_in_the_run() {
        // The ranks of one token position in two KV groups tie. Prefix order with ascending
        // chunk ids puts each second key just behind the run's first; the other way round,
        // just ahead of its last.
        let mut o: EvictionOrder<(u64, i64)> = EvictionOrder::new();
        o.grow(24);
        o.insert(20, (9, 0)); // a later fresh rank: the run is ranked below the list's tail
        for p in 0..6u32 {
            o.insert(2 * p, (1, -i64::from(p)));
            o.insert(2 * p + 1, (1, -i64::from(p)));
        }
        for p in (0..4u32).rev() {
            o.insert(19 - 2 * p, (2, -i64::from(p)));
            o.insert(18 - 2 * p, (2, -i64::from(p)));
        }
        o.validate().unwrap();
        assert!(o.order.tree.is_empty(), "every tie joined its run");
        let seen: Vec<ChunkId> = o.iter(&mut Vec::new()).map(|(_, c)| c).collect();
        assert_eq!(
            seen,
            vec![10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1, 12, 13, 14, 15, 16, 17, 18, 19, 20]
        );
        // More ties than the walk passes go to the tree, still in order.
        for c in 21..24 {
            o.insert(c, (1, -5));
        }
        o.validate().unwrap();
        let seen: Vec<ChunkId> = o.iter(&mut Vec::new()).map(|(_, c)| c).collect();
        assert_eq!(&seen[..5], &[10, 11, 21, 22, 23]);
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
