//! Model test: random call sequences run against the crate's `Manager` and against a naive
//! second implementation written from SPEC.md (`model/reference.rs`), comparing every result
//! (lookups, chunk ids, store outcomes with evicted keys in order, `None`s, events, stats) and
//! every observable piece of state (resident chunks, policy order, pool, tracker, request
//! state) after each call, with `Manager::validate()` after each call too.
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

fn config() -> impl Strategy<Value = Config> {
    (
        prop_oneof![1 => Just(0u32), 12 => 1u32..=5, 3 => 6u32..=16],
        prop_oneof![Just(PolicyKind::Lru), Just(PolicyKind::Arc)],
        prop::bool::weighted(0.8),
        prop_oneof![5 => Just(1u64), 3 => Just(2), 1 => Just(3)],
        prop_oneof![1 => 1usize..=2, 3 => 3usize..=4],
        prop_oneof![1 => 1u8..=3, 4 => 4u8..=8],
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
