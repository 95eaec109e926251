//! Model test: random call sequences run against the crate's `Manager` and against a naive
//! second implementation written from SPEC.md (`model/reference.rs`), comparing every result
//! (lookups, chunk ids, store outcomes with evicted keys in order, `None`s, events, stats) and
//! every observable piece of state (resident chunks, policy order, pool, tracker, request
//! state) after each call, with `Manager::validate()` after each call too. vLLM's LRU and ARC
//! have their own proptests; FIFO, SIEVE, S3-FIFO, 2Q, SLRU, LFU and the paper's ARC (models in
//! `model/reference_policies.rs` and `model/reference_policy.rs`, from the Python reference's
//! rules) have theirs, on smaller caches and more stores.
//!
//! `PROPTEST_CASES=n` overrides the case counts for a deeper run.

#[path = "model/harness.rs"]
mod harness;
#[path = "model/reference.rs"]
mod reference;
#[path = "model/vllm_examples.rs"]
mod vllm_examples;

use harness::{Config, Harness, Illegal, Op, MAX_KEYS};
use kvoffload_core::PolicyKind;
use proptest::collection::vec;
use proptest::prelude::*;

fn config_with(cases: u32) -> ProptestConfig {
    let base = ProptestConfig::default();
    ProptestConfig {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            base.cases
        } else {
            cases
        },
        failure_persistence: None,
        ..base
    }
}

/// A request's token positions (block `h` group `g` at `2h + g`): none known, the same for
/// both groups of a block (as in vLLM), all known, or some. Values come from a small range so
/// that positions tie.
fn positions() -> impl Strategy<Value = Vec<Option<i64>>> {
    prop_oneof![
        1 => Just(vec![None; MAX_KEYS]),
        2 => vec(0i64..4, MAX_KEYS / 2)
            .prop_map(|v| v.into_iter().flat_map(|p| [Some(p), Some(p)]).collect()),
        2 => vec((0i64..4).prop_map(Some), MAX_KEYS),
        2 => vec(prop::option::weighted(0.7, 0i64..4), MAX_KEYS),
    ]
}

/// A configuration with vLLM's policies (LRU or ARC).
fn config() -> impl Strategy<Value = Config> {
    config_of(
        prop_oneof![Just(PolicyKind::Lru), Just(PolicyKind::Arc)],
        prop_oneof![1 => Just(0u32), 12 => 1u32..=5, 3 => 6u32..=16],
        prop_oneof![1 => 1u8..=3, 4 => 4u8..=8],
    )
}

/// kvoffload's other policies, each with its own model in `model/reference_policies.rs` (the
/// paper's ARC in `model/reference_policy.rs`).
const OWN_POLICIES: [PolicyKind; 7] = [
    PolicyKind::Fifo,
    PolicyKind::Sieve,
    PolicyKind::S3Fifo,
    PolicyKind::TwoQ,
    PolicyKind::Slru,
    PolicyKind::Lfu,
    PolicyKind::ArcPaper,
];

/// A configuration with one of [`OWN_POLICIES`]: mostly more keys (block hashes x groups, up
/// to 32) than chunks, so that stores evict and evicted keys come back as ghost hits; pools of
/// up to 34 chunks, where S3-FIFO's small queue, 2Q's A1in and A1out and SLRU's protected
/// segment move well off their minimum sizes.
fn own_config() -> impl Strategy<Value = Config> {
    config_of(
        prop::sample::select(&OWN_POLICIES[..]),
        Just(0u32),
        prop_oneof![1 => 2u8..=5, 2 => 6u8..=10, 2 => 11u8..=16],
    )
    .prop_flat_map(|cfg| {
        let keys = u32::from(cfg.hashes) * cfg.groups.len() as u32;
        let num_chunks = prop_oneof![
            1 => Just(0u32),
            3 => 1u32..=3,
            12 => 1..keys,
            1 => keys..=keys + 2,
        ];
        (Just(cfg), num_chunks).prop_map(|(mut cfg, n)| {
            cfg.num_chunks = n;
            cfg
        })
    })
}

/// A configuration with the paper's ARC, a pool of 2 to 5 chunks and 3 to 12 keys: the ghost
/// lists outgrow the cache and the target takes fractional values (which takes a B2 longer
/// than B1, or the reverse, by a fraction), so that REPLACE meets `|T1| == p` and the directory
/// bounds come into play.
fn arc_paper_config() -> impl Strategy<Value = Config> {
    config_of(Just(PolicyKind::ArcPaper), 2u32..=5, 3u8..=6)
}

/// A configuration with a policy, a pool size and a number of block hashes from the given
/// strategies.
fn config_of(
    policy: impl Strategy<Value = PolicyKind>,
    num_chunks: impl Strategy<Value = u32>,
    hashes: impl Strategy<Value = u8>,
) -> impl Strategy<Value = Config> {
    (
        num_chunks,
        policy,
        prop::bool::weighted(0.8),
        prop_oneof![5 => Just(1u64), 3 => Just(2), 1 => Just(3)],
        prop_oneof![1 => 1usize..=2, 3 => 3usize..=4],
        hashes,
        // Groups 1 and 256 sort differently if the group index is not read big-endian.
        prop_oneof![2 => Just(vec![0]), 3 => Just(vec![0, 1]), 1 => Just(vec![1, 256])],
        vec(positions(), 1..=3),
    )
        .prop_map(
            |(num_chunks, policy, events, threshold, tracker, hashes, groups, positions)| Config {
                num_chunks,
                policy,
                events,
                threshold,
                tracker,
                hashes,
                groups,
                positions,
            },
        )
}

fn picks() -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..=5)
}

const ILLEGAL: [Illegal; 10] = [
    Illegal::LoadAbsent,
    Illegal::LoadPending,
    Illegal::CompleteUnpinned,
    Illegal::CompleteTooMany,
    Illegal::StoreDuplicate,
    Illegal::FinishedLoadsNewKey,
    Illegal::FinishedStoresNewKey,
    Illegal::LoadPositionsMismatch,
    Illegal::StorePositionsMismatch,
    Illegal::FinishPositionsMismatch,
];

/// One legal step.
fn legal_op() -> impl Strategy<Value = Op> {
    let req = 0u8..3;
    prop_oneof![
        1 => any::<u8>().prop_map(Op::Lookup),
        1 => picks().prop_map(Op::LookupPrefix),
        3 => (req.clone(), picks(), any::<bool>())
            .prop_map(|(req, picks, explicit)| Op::Load { req, picks, explicit }),
        1 => picks().prop_map(Op::Read),
        3 => (prop::bool::weighted(0.6), picks())
            .prop_map(|(whole_job, picks)| Op::CompleteLoad { whole_job, picks }),
        2 => picks().prop_map(Op::Touch),
        8 => (req.clone(), vec(any::<u8>(), 1..=5), any::<bool>())
            .prop_map(|(req, keys, explicit)| Op::Store { req, keys, explicit }),
        8 => (prop::bool::weighted(0.7), picks(), prop::bool::weighted(0.8)).prop_map(
            |(whole_job, picks, success)| Op::CompleteStore { whole_job, picks, success }
        ),
        2 => (req.clone(), prop::bool::weighted(0.7))
            .prop_map(|(req, renew)| Op::Finish { req, renew }),
        1 => (req.clone(), positions())
            .prop_map(|(req, positions)| Op::NewRequest { req, positions }),
        1 => (req.clone(), any::<u8>(), prop::option::weighted(0.7, 0i64..4))
            .prop_map(|(req, key, position)| Op::SetPosition { req, key, position }),
        1 => Just(Op::Reset),
        1 => Just(Op::TakeEvents),
        1 => Just(Op::TakeStats),
    ]
}

/// One legal step for [`OWN_POLICIES`]: [`legal_op`]'s mix with more stores, completed stores
/// and touches, so that caches fill and evict, evicted keys come back (ghost hits) and hits
/// promote.
fn own_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => legal_op(),
        1 => (0u8..3, vec(any::<u8>(), 1..=4), any::<bool>())
            .prop_map(|(req, keys, explicit)| Op::Store { req, keys, explicit }),
        1 => picks().prop_map(|picks| Op::CompleteStore { whole_job: true, picks, success: true }),
        1 => picks().prop_map(Op::Touch),
    ]
}

/// Mostly legal steps, about one in five a call that must be refused.
fn mixed_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => legal_op(),
        1 => (prop::sample::select(&ILLEGAL[..]), 0u8..3, picks())
            .prop_map(|(kind, req, picks)| Op::Illegal { kind, req, picks }),
    ]
}

proptest! {
    #![proptest_config(config_with(1024))]

    /// Legal sequences: the crate and the model agree after every call.
    #[test]
    fn manager_matches_model(cfg in config(), ops in vec(legal_op(), 1..=100)) {
        Harness::run(&cfg, &ops);
    }
}

proptest! {
    #![proptest_config(config_with(384))]

    /// Illegal calls mixed into legal sequences: each is refused with the expected error and
    /// changes nothing (the state is compared before and after, and the model, which skips the
    /// call, still agrees with the crate afterwards).
    #[test]
    fn illegal_calls_are_refused_and_change_nothing(
        cfg in config(),
        ops in vec(mixed_op(), 1..=50),
    ) {
        Harness::run(&cfg, &ops);
    }
}

proptest! {
    #![proptest_config(config_with(2048))]

    /// Legal sequences under FIFO, SIEVE, S3-FIFO, 2Q, SLRU, LFU and the paper's ARC: the crate
    /// and the model agree after every call (the policy's order included).
    #[test]
    fn own_policies_match_model(cfg in own_config(), ops in vec(own_op(), 1..=150)) {
        Harness::run(&cfg, &ops);
    }
}

proptest! {
    #![proptest_config(config_with(512))]

    /// Illegal calls mixed into legal sequences under the policies of [`OWN_POLICIES`]: each is
    /// refused and changes nothing.
    #[test]
    fn own_policies_refuse_illegal_calls(
        cfg in own_config(),
        ops in vec(mixed_op(), 1..=50),
    ) {
        Harness::run(&cfg, &ops);
    }
}

proptest! {
    #![proptest_config(config_with(512))]

    /// The paper's ARC on tiny caches with long sequences (see [`arc_paper_config`]).
    #[test]
    fn arc_paper_small_caches_match_model(
        cfg in arc_paper_config(),
        ops in vec(own_op(), 1..=200),
    ) {
        Harness::run(&cfg, &ops);
    }
}

/// A sequence that random search found (shrunk) where the paper's ARC REPLACEs with the target
/// fractional and `|T1|` equal to its integer part, after a B2 ghost hit: `|T1| == p` must
/// compare with the real-valued target, not a rounded one. Random sequences reach this state
/// rarely, so it is kept as a fixed case.
#[test]
fn arc_paper_replace_compares_the_real_target() {
    let cfg = Config {
        num_chunks: 5,
        policy: PolicyKind::ArcPaper,
        events: false,
        threshold: 1,
        tracker: 1,
        hashes: 6,
        groups: vec![0, 1],
        positions: vec![vec![None; MAX_KEYS]; 2],
    };
    let store = |req: u8, keys: &[u8]| Op::Store {
        req,
        keys: keys.to_vec(),
        explicit: false,
    };
    let complete = |whole_job: bool, picks: &[u8], success: bool| Op::CompleteStore {
        whole_job,
        picks: picks.to_vec(),
        success,
    };
    let finish = |req: u8, renew: bool| Op::Finish { req, renew };
    let ops = vec![
        store(0, &[60, 126, 189]),
        complete(true, &[], true),
        Op::Touch(vec![249, 6]),
        store(0, &[56, 109, 14]),
        store(0, &[7]),
        finish(2, true),
        store(0, &[126]),
        finish(2, true),
        store(0, &[252]),
        complete(true, &[4], true),
        complete(true, &[71], true),
        store(1, &[111]),
        store(0, &[90, 59]),
        complete(true, &[128], true),
        store(2, &[12, 212, 127]),
        store(0, &[182, 161, 13]),
        finish(0, false),
        complete(true, &[], true),
        complete(true, &[], true),
        store(0, &[11]),
        Op::Lookup(0),
        store(0, &[117, 89]),
        complete(false, &[], false),
        complete(true, &[], true),
        store(0, &[139, 150]),
        complete(false, &[0], false),
        store(1, &[123, 200, 31]),
    ];
    Harness::run(&cfg, &ops);
}
