//! The model checked against vLLM 0.33.0's exact results from SCENARIOS.md, so that the model
//! and the crate cannot agree on a misreading of the spec. Every call is made on both (and
//! compared) with one shared request context, as vLLM's own manager tests make them.

use crate::reference::{Model, Policy, Req};
use kvoffload_core::{
    ChunkId, Lookup, Manager, ManagerConfig, PolicyKind, PolicyState, RawStats, RequestState,
};

/// The crate and the model side by side. Each call asserts that both agree and returns the
/// result.
struct Twin {
    mgr: Manager,
    model: Model,
    state: RequestState,
    req: Req,
}

/// vLLM's test keys: the decimal string of a small integer plus group 0.
fn key(n: u32) -> Vec<u8> {
    let mut k = n.to_string().into_bytes();
    k.extend_from_slice(&[0; 4]);
    k
}

fn name(key: &[u8]) -> u32 {
    std::str::from_utf8(&key[..key.len() - 4])
        .unwrap()
        .parse()
        .unwrap()
}

fn keys(ns: &[u32]) -> Vec<Vec<u8>> {
    ns.iter().map(|&n| key(n)).collect()
}

fn names<K: AsRef<[u8]>>(keys: &[K]) -> Vec<u32> {
    keys.iter().map(|k| name(k.as_ref())).collect()
}

impl Twin {
    fn new(num_chunks: u32, policy: PolicyKind, threshold: u64, tracker: usize) -> Self {
        let mgr = Manager::new(&ManagerConfig {
            num_chunks,
            policy,
            enable_events: true,
            store_threshold: threshold,
            max_tracker_size: tracker,
            admission: kvoffload_core::Admission::default(),
        })
        .unwrap();
        let model = Model::new(num_chunks, policy, true, threshold, tracker);
        Self {
            state: mgr.new_request_state(),
            req: model.new_request(),
            mgr,
            model,
        }
    }

    /// `(stored, chunk ids, evicted)` by key name, or `None`.
    fn store(&mut self, ns: &[u32]) -> Option<(Vec<u32>, Vec<ChunkId>, Vec<u32>)> {
        let ks = keys(ns);
        let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
        let got = self
            .mgr
            .prepare_store(&refs, None, &mut self.state)
            .unwrap();
        let want = self
            .model
            .prepare_store(&ks, &vec![None; ks.len()], &mut self.req)
            .unwrap();
        assert_eq!(got, want);
        self.mgr.validate().unwrap();
        want.map(|o| {
            let stored = o.to_store.iter().map(|&i| ns[i]).collect();
            (stored, o.chunks, names(&o.evicted))
        })
    }

    fn complete_store(&mut self, ns: &[u32], success: bool) {
        let ks = keys(ns);
        let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
        self.mgr.complete_store(&refs, success);
        let _ = self.model.complete_store(&ks, success);
        self.mgr.validate().unwrap();
    }

    fn load(&mut self, ns: &[u32]) -> Vec<ChunkId> {
        let ks = keys(ns);
        let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
        let got = self.mgr.prepare_load(&refs, None, &mut self.state).unwrap();
        let want = self
            .model
            .prepare_load(&ks, &vec![None; ks.len()], &mut self.req)
            .unwrap();
        assert_eq!(got, want);
        want
    }

    fn complete_load(&mut self, ns: &[u32]) {
        let ks = keys(ns);
        let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
        self.mgr.complete_load(&refs).unwrap();
        self.model.complete_load(&ks).unwrap();
    }

    fn touch(&mut self, ns: &[u32]) {
        let ks = keys(ns);
        let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
        self.mgr.touch(&refs);
        self.model.touch(&ks);
    }

    fn hits(&self, ns: &[u32]) -> Vec<Lookup> {
        let got: Vec<Lookup> = ns.iter().map(|&n| self.mgr.lookup(&key(n))).collect();
        let want: Vec<Lookup> = ns.iter().map(|&n| self.model.lookup(&key(n))).collect();
        assert_eq!(got, want);
        want
    }

    /// `(removed, metadata_only, keys)` of each event.
    fn events(&mut self) -> Vec<(bool, bool, Vec<u32>)> {
        let got = self.mgr.take_events();
        let want = self.model.take_events();
        assert_eq!(got, want);
        want.iter()
            .map(|e| (e.removed, e.metadata_only, names(&e.keys)))
            .collect()
    }

    fn stats(&mut self) -> RawStats {
        let got = self.mgr.take_stats();
        let want = self.model.take_stats();
        assert_eq!(got, want);
        want
    }

    /// ARC's `(t1, t2, b1, b2, target)` by key name.
    fn arc(&self) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>, f64) {
        let PolicyState::Arc {
            t1,
            t2,
            b1,
            b2,
            target,
        } = self.mgr.policy_state()
        else {
            panic!("not ARC")
        };
        let by_chunk = |v: &[ChunkId]| -> Vec<u32> {
            v.iter()
                .map(|&c| name(&self.mgr.key_of(c).unwrap()))
                .collect()
        };
        let Policy::Arc {
            t1: m1,
            t2: m2,
            b1: g1,
            b2: g2,
            target: mt,
            ..
        } = &self.model.policy
        else {
            panic!("model not ARC")
        };
        let ours = (by_chunk(&t1), by_chunk(&t2), names(&b1), names(&b2), target);
        assert_eq!(ours, (names(m1), names(m2), names(g1), names(g2), *mt));
        ours
    }
}

/// SCENARIOS.md section 2: vLLM 0.33.0's LRU walk-through, step by step.
#[test]
fn lru_walkthrough_matches_vllm() {
    use Lookup::{Hit, Miss};
    let mut t = Twin::new(4, PolicyKind::Lru, 1, 64);
    assert_eq!(t.store(&[1, 2]), Some((vec![1, 2], vec![0, 1], vec![])));
    t.complete_store(&[1, 2], true);
    assert_eq!(
        t.store(&[2, 3, 4, 5]),
        Some((vec![3, 4, 5], vec![2, 3, 0], vec![1]))
    );
    assert_eq!(t.store(&[1, 6]), None, "3, 4, 5 are still being written");
    t.complete_store(&[3, 4, 5], true);
    assert_eq!(
        t.hits(&[1, 0, 2, 3, 4, 5]),
        [Miss, Miss, Hit, Hit, Hit, Hit]
    );
    assert_eq!(t.load(&[2, 3]), [1, 2]);
    assert_eq!(t.store(&[6, 7, 8]), None, "2 and 3 are being loaded");
    t.complete_load(&[2, 3]);
    assert_eq!(
        t.store(&[6, 7, 8]),
        Some((vec![6, 7, 8], vec![3, 2, 1], vec![2, 3, 4]))
    );
    t.complete_store(&[6, 7, 8], true);
    t.touch(&[5, 6, 7]);
    assert_eq!(t.store(&[9]), Some((vec![9], vec![1], vec![8])));
    t.complete_store(&[7, 9], false);
    assert_eq!(t.hits(&[7, 9]), [Hit, Miss]);
    assert_eq!(
        t.events(),
        [
            (false, false, vec![1, 2]),
            (true, false, vec![1]),
            (false, false, vec![3, 4, 5]),
            (true, false, vec![2, 3, 4]),
            (false, false, vec![6, 7, 8]),
            (true, false, vec![8]),
            (true, true, vec![9]),
        ]
    );
}

/// SCENARIOS.md section 5: ARC placement, ghosts and eviction, with 0.33.0's exact results.
#[test]
fn arc_examples_match_vllm() {
    let mut t = Twin::new(4, PolicyKind::Arc, 1, 64);
    t.store(&[1, 2, 3, 4]);
    t.complete_store(&[1, 2, 3, 4], true);
    assert_eq!(t.arc().0, [1, 2, 3, 4], "completed chunks sit in T1");
    t.load(&[1, 2]);
    assert_eq!(t.store(&[5, 6, 7]), None);
    t.complete_load(&[1, 2]);
    assert_eq!(
        t.store(&[5, 6, 7]),
        Some((vec![5, 6, 7], vec![2, 1, 0], vec![1, 2, 3]))
    );

    // Capacity 2: evicting 1 puts it in B1; touching it there raises the target 0 -> 1.
    let mut t = Twin::new(2, PolicyKind::Arc, 1, 64);
    t.store(&[1, 2]);
    t.complete_store(&[1, 2], true);
    assert_eq!(t.store(&[3]), Some((vec![3], vec![0], vec![1])));
    assert_eq!(t.arc().2, [1]);
    t.touch(&[1]);
    assert!((t.arc().4 - 1.0).abs() < f64::EPSILON);
    // 17 more single stores: no ghost list outgrows the capacity.
    for n in 10..27 {
        t.complete_store(&[n - 1], true);
        t.store(&[n]);
        let (_, _, b1, b2, _) = t.arc();
        assert!(b1.len() <= 2 && b2.len() <= 2);
    }

    // touch([1, 3, 4]) runs last to first: T2 ends up 4, 3, 1 (1 newest); then 5 evicts 2.
    let mut t = Twin::new(4, PolicyKind::Arc, 1, 64);
    t.store(&[1, 2, 3, 4]);
    t.complete_store(&[1, 2, 3, 4], true);
    t.touch(&[3, 4]);
    t.touch(&[1, 3, 4]);
    assert_eq!(t.arc().0, [2]);
    assert_eq!(t.arc().1, [4, 3, 1]);
    assert_eq!(t.store(&[5]), Some((vec![5], vec![1], vec![2])));

    // The full scenario: 4 is evicted from T1 and five events are queued.
    let mut t = Twin::new(4, PolicyKind::Arc, 1, 64);
    t.store(&[1, 2]);
    t.complete_store(&[1, 2], true);
    assert_eq!(t.store(&[3, 4, 5]).unwrap().2.len(), 1);
    t.complete_store(&[3, 4, 5], true);
    t.touch(&[2, 3]);
    assert_eq!((t.arc().0, t.arc().1), (vec![4, 5], vec![3, 2]));
    assert_eq!(t.store(&[6]).unwrap().2, [4]);
    t.complete_store(&[6], true);
    assert_eq!(t.hits(&[2, 3]), [Lookup::Hit, Lookup::Hit]);
    assert_eq!(t.events().len(), 5);
}

/// SCENARIOS.md sections 6 and 7: the store threshold, skipped counts and allocation sizes.
#[test]
fn threshold_and_stats_match_vllm() {
    let mut t = Twin::new(4, PolicyKind::Lru, 2, 3);
    assert_eq!(t.store(&[1, 2, 3]), Some((vec![], vec![], vec![])));
    assert_eq!(t.stats().stores_skipped, Some(3));
    assert_eq!(t.stats().stores_skipped, Some(0));
    assert_eq!(t.store(&[1, 2]), Some((vec![1, 2], vec![0, 1], vec![])));

    let mut t = Twin::new(4, PolicyKind::Lru, 1, 64);
    t.store(&[1, 2]);
    t.complete_store(&[1, 2], true);
    t.store(&[1, 2, 3]);
    let s = t.stats();
    assert_eq!((s.allocation_sizes, s.stores_skipped), (vec![2, 1], None));
    assert!(t.stats().allocation_sizes.is_empty());
    t.load(&[1]);
    let s = t.stats();
    assert_eq!(
        (s.num_used, s.num_pending),
        (2, 1),
        "3 in flight, 1 loading"
    );

    // One chunk being written: the next offer returns None but still takes its sample.
    let mut t = Twin::new(1, PolicyKind::Lru, 1, 64);
    t.store(&[1]);
    t.stats();
    assert_eq!(t.store(&[2]), None);
    assert_eq!(t.stats().allocation_sizes, [1]);
}
