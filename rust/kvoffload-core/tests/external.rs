//! An external policy that fails: `Manager::with_policy` undoes `prepare_load` and
//! `prepare_store` (evictions before a failed `insert` aside) and keeps its invariants.
//!
//! `Flaky` wraps the built-in LRU and reports a failure from one armed method without letting
//! the LRU act (the manager takes a failed method not to have changed the policy). Random calls
//! run with a random method armed before many of them; after each call the manager validates
//! (the LRU's own structures included), a prepare call must fail exactly when the armed method
//! was reached (and failed) during it, and a failed prepare call must have left the observable
//! state as it was.

use kvoffload_core::policy::{Access, CachePolicy, FinishedKey, PolicyState, RequestRank};
use kvoffload_core::{
    Admission, ChunkId, CoreError, Manager, ManagerConfig, PolicyKind, RequestState, Result, Slots,
};
use proptest::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    Insert,
    Evict,
    OnStoreMiss,
    OnRequestAccess,
    MarkNonEvictable,
}

struct Flaky {
    inner: Box<dyn CachePolicy>,
    armed: Option<Method>,
    failed: bool,
}

impl Flaky {
    /// Whether method `m` fails now (it then must not act).
    fn fails(&mut self, m: Method) -> bool {
        if self.armed == Some(m) {
            self.armed = None;
            self.failed = true;
            return true;
        }
        false
    }
}

impl CachePolicy for Flaky {
    fn grow(&mut self, n: usize) {
        self.inner.grow(n);
    }
    fn insert(&mut self, chunk: ChunkId, key: Access<'_>, rank: &mut RequestRank) {
        if !self.fails(Method::Insert) {
            self.inner.insert(chunk, key, rank);
        }
    }
    fn remove(&mut self, chunk: ChunkId) {
        self.inner.remove(chunk);
    }
    fn touch(&mut self, keys: &[Access<'_>], refs: &Slots) {
        self.inner.touch(keys, refs);
    }
    fn on_store_miss(&mut self, keys: &[Access<'_>]) {
        if !self.fails(Method::OnStoreMiss) {
            self.inner.on_store_miss(keys);
        }
    }
    fn on_request_access(&mut self, keys: &[Access<'_>], rank: &mut RequestRank) {
        if !self.fails(Method::OnRequestAccess) {
            self.inner.on_request_access(keys, rank);
        }
    }
    fn on_request_finished(&mut self, keys: &[FinishedKey<'_>]) {
        self.inner.on_request_finished(keys);
    }
    fn evict(
        &mut self,
        n: usize,
        protected: &dyn Fn(ChunkId) -> bool,
        keys: &Slots,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        !self.fails(Method::Evict) && self.inner.evict(n, protected, keys, out)
    }
    fn clear(&mut self) {
        self.inner.clear();
    }
    fn mark_evictable(&mut self, chunk: ChunkId) {
        self.inner.mark_evictable(chunk);
    }
    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        if !self.fails(Method::MarkNonEvictable) {
            self.inner.mark_non_evictable(chunk);
        }
    }
    fn state(&self) -> PolicyState {
        self.inner.state()
    }
    fn validate(&self, resident: &[bool], refs: &Slots) -> Result<()> {
        self.inner.validate(resident, refs)
    }
    fn failed(&mut self) -> bool {
        std::mem::take(&mut self.failed)
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

fn flaky(m: &mut Manager) -> &mut Flaky {
    let any = m.policy_mut().as_any_mut().expect("an external policy");
    any.downcast_mut::<Flaky>().expect("Flaky")
}

fn arm(m: &mut Manager, method: Option<Method>) {
    flaky(m).armed = method;
}

/// A prepare call's result `got` is a policy error exactly when the method armed before the call
/// (if any) was reached during it and failed (a failure disarms it).
fn fails_as_armed<T: std::fmt::Debug>(
    m: &mut Manager,
    armed: Option<usize>,
    got: &Result<T>,
) -> std::result::Result<(), TestCaseError> {
    let fired = armed.is_some() && flaky(m).armed.is_none();
    prop_assert_eq!(matches!(got, Err(CoreError::Policy(_))), fired, "{:?}", got);
    Ok(())
}

type Snapshot = (
    Vec<(Vec<u8>, ChunkId, i32)>,
    (u32, Vec<ChunkId>),
    Vec<(Vec<u8>, u64)>,
);

fn snapshot(m: &Manager) -> Snapshot {
    let mut resident: Vec<_> = m
        .resident()
        .into_iter()
        .map(|(k, c, r)| (k.to_vec(), c, r))
        .collect();
    resident.sort();
    let (fresh, free) = m.pool_state();
    let tracker = m
        .tracker()
        .map(|t| t.entries().map(|(k, c)| (k.to_vec(), c)).collect())
        .unwrap_or_default();
    (resident, (fresh, free.to_vec()), tracker)
}

const METHODS: [Method; 5] = [
    Method::Insert,
    Method::Evict,
    Method::OnStoreMiss,
    Method::OnRequestAccess,
    Method::MarkNonEvictable,
];

#[derive(Clone, Debug)]
enum Op {
    Store(Vec<u8>, usize),
    Complete(bool),
    Load(Vec<u8>, usize),
    Unload,
    Finish(usize),
}

fn op() -> impl Strategy<Value = (Op, Option<usize>)> {
    let keys = proptest::collection::vec(0u8..12, 1..5);
    let call = prop_oneof![
        3 => (keys.clone(), 0usize..3).prop_map(|(k, r)| Op::Store(k, r)),
        2 => any::<bool>().prop_map(Op::Complete),
        2 => (keys, 0usize..3).prop_map(|(k, r)| Op::Load(k, r)),
        1 => Just(Op::Unload),
        1 => (0usize..3).prop_map(Op::Finish),
    ];
    (call, proptest::option::weighted(0.5, 0usize..METHODS.len()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn failures_leave_the_manager_consistent(
        ops in proptest::collection::vec(op(), 1..120),
        threshold in 1u64..3,
    ) {
        let config = ManagerConfig {
            num_chunks: 5,
            policy: PolicyKind::Lru,
            enable_events: true,
            store_threshold: threshold,
            max_tracker_size: 6,
            admission: Admission::default(),
        };
        let flaky = Flaky { inner: PolicyKind::Lru.build(5), armed: None, failed: false };
        let mut m = Manager::with_policy(&config, Box::new(flaky)).unwrap();
        let mut reqs: Vec<RequestState> = (0..3).map(|_| m.new_request_state()).collect();
        let mut pins: Vec<Vec<u8>> = Vec::new();
        for (op, armed) in ops {
            arm(&mut m, armed.map(|i| METHODS[i]));
            let before = snapshot(&m);
            let key = |k: &u8| vec![b'k', *k];
            match op {
                Op::Store(ks, r) => {
                    let mut keys: Vec<Vec<u8>> = ks.iter().map(key).collect();
                    keys.sort();
                    keys.dedup();
                    let slices: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                    let got = m.prepare_store(&slices, None, &mut reqs[r]);
                    fails_as_armed(&mut m, armed, &got)?;
                    match got {
                        Err(CoreError::Policy(msg)) => {
                            let after = snapshot(&m);
                            if msg.contains("insert") {
                                // The evictions stand; nothing else changed.
                                prop_assert_eq!(&after.2, &before.2);
                                prop_assert!(after.0.iter().all(|e| before.0.contains(e)));
                            } else {
                                prop_assert_eq!(after, before);
                            }
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                        Ok(_) => {}
                    }
                }
                Op::Complete(success) => {
                    let pending: Vec<Vec<u8>> = m
                        .resident()
                        .into_iter()
                        .filter(|r| r.2 == -1)
                        .map(|r| r.0.to_vec())
                        .collect();
                    let slices: Vec<&[u8]> = pending.iter().map(Vec::as_slice).collect();
                    m.complete_store(&slices, success);
                }
                Op::Load(ks, r) => {
                    let keys: Vec<Vec<u8>> = ks
                        .iter()
                        .map(key)
                        .filter(|k| m.resident().iter().any(|e| e.0.as_slice() == k.as_slice() && e.2 >= 0))
                        .collect();
                    let slices: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                    let got = m.prepare_load(&slices, None, &mut reqs[r]);
                    fails_as_armed(&mut m, armed, &got)?;
                    match got {
                        Ok(_) => pins.extend(keys.iter().cloned()),
                        Err(CoreError::Policy(_)) => prop_assert_eq!(snapshot(&m), before),
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                    }
                }
                Op::Unload => {
                    if let Some(k) = pins.pop() {
                        m.complete_load(&[k.as_slice()]).unwrap();
                    }
                }
                Op::Finish(r) => {
                    let positions = vec![None; reqs[r].seen_keys().len()];
                    m.on_request_finished(&mut reqs[r], &positions).unwrap();
                    reqs[r] = m.new_request_state();
                }
            }
            m.validate().map_err(|e| TestCaseError::fail(format!("{e}")))?;
        }
    }
}
