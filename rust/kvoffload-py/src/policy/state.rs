//! A policy's order as the Python dict `policy_state()` returns, one layout for the manager and
//! for `PolicyCore`. Key bytes are copied out while the Rust lock is held ([`state_keys`]); the
//! dict is built after it is released ([`state_dict`]).

use kvoffload_core::{ChunkId, KeyBuf, PolicyState};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// The key bytes every list of `state` names, list by list, in the order [`state_dict`] reads.
pub(crate) fn state_keys(
    state: &PolicyState,
    key: impl Fn(ChunkId) -> Vec<u8>,
) -> Vec<Vec<Vec<u8>>> {
    let keys = |cs: &mut dyn Iterator<Item = ChunkId>| cs.map(&key).collect::<Vec<_>>();
    match state {
        PolicyState::Lru { ranks, .. } => vec![keys(&mut ranks.iter().map(|r| r.0))],
        PolicyState::Arc { t1, t2, .. } => {
            vec![keys(&mut t1.iter().copied()), keys(&mut t2.iter().copied())]
        }
        PolicyState::Queue {
            queue,
            parked,
            hand,
        } => vec![
            keys(&mut queue.iter().map(|e| e.0)),
            keys(&mut parked.iter().map(|e| e.0)),
            keys(&mut hand.iter().copied()),
        ],
        PolicyState::Queues { linked, parked, .. } => linked
            .iter()
            .chain(parked)
            .map(|q| keys(&mut q.iter().map(|e| e.0)))
            .collect(),
        PolicyState::External => Vec::new(),
    }
}

fn bytes_list<'py>(py: Python<'py>, ks: &[impl AsRef<[u8]>]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, ks.iter().map(|k| PyBytes::new(py, k.as_ref())))
}

/// The dict of `state` for the policy called `policy`; `keys` comes from [`state_keys`].
///
/// - lru: `ranks` `{key: (major, minor)}` and `next_rank`;
/// - arc: `t1`, `t2`, `b1`, `b2` (oldest first) and `target_t1_size`;
/// - fifo, sieve: `queue` `[(key, visited)]` oldest first, `parked` (sorted) and `hand`;
/// - s3fifo, 2q, slru: each queue `[(key, frequency)]` oldest first under its name, `parked`
///   `[(key, queue, frequency)]` sorted, and `ghosts` oldest first;
/// - an external policy: only `policy` (its class name).
pub(crate) fn state_dict<'py>(
    py: Python<'py>,
    policy: &str,
    state: PolicyState,
    keys: &[Vec<Vec<u8>>],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("policy", policy)?;
    match state {
        PolicyState::Lru { ranks, next_rank } => {
            let r = PyDict::new(py);
            for ((_, rank), k) in ranks.iter().zip(&keys[0]) {
                r.set_item(PyBytes::new(py, k), *rank)?;
            }
            d.set_item("ranks", r)?;
            d.set_item("next_rank", next_rank)?;
        }
        PolicyState::Arc { b1, b2, target, .. } => {
            d.set_item("t1", bytes_list(py, &keys[0])?)?;
            d.set_item("t2", bytes_list(py, &keys[1])?)?;
            d.set_item("b1", bytes_list(py, &b1)?)?;
            d.set_item("b2", bytes_list(py, &b2)?)?;
            d.set_item("target_t1_size", target)?;
        }
        PolicyState::Queue { queue, parked, .. } => {
            let entries = |cs: &[(ChunkId, bool)], ks: &[Vec<u8>]| {
                PyList::new(
                    py,
                    cs.iter()
                        .zip(ks)
                        .map(|((_, visited), k)| (PyBytes::new(py, k), *visited)),
                )
            };
            d.set_item("queue", entries(&queue, &keys[0])?)?;
            // Parked entries in key order, so that any implementation lists them alike.
            let parked = entries(&parked, &keys[1])?;
            parked.sort()?;
            d.set_item("parked", parked)?;
            d.set_item("hand", keys[2].first().map(|k| PyBytes::new(py, k)))?;
        }
        PolicyState::Queues {
            names,
            linked,
            parked,
            ghosts,
        } => queues_state(&d, names, &linked, &parked, keys, &ghosts)?,
        PolicyState::External => {}
    }
    Ok(d)
}

/// The queue-based part of [`state_dict`]: `keys` holds the keys of every linked queue, then of
/// every parked list.
fn queues_state(
    d: &Bound<'_, PyDict>,
    names: &[&str],
    linked: &[Vec<(ChunkId, u8)>],
    parked: &[Vec<(ChunkId, u8)>],
    keys: &[Vec<Vec<u8>>],
    ghosts: &[KeyBuf],
) -> PyResult<()> {
    let py = d.py();
    for (q, name) in names.iter().enumerate() {
        let entries = linked[q]
            .iter()
            .zip(&keys[q])
            .map(|((_, freq), k)| (PyBytes::new(py, k), *freq));
        d.set_item(*name, PyList::new(py, entries)?)?;
    }
    let all_parked = PyList::empty(py);
    for (q, name) in names.iter().enumerate() {
        for ((_, freq), k) in parked[q].iter().zip(&keys[names.len() + q]) {
            all_parked.append((PyBytes::new(py, k), *name, *freq))?;
        }
    }
    all_parked.sort()?;
    d.set_item("parked", all_parked)?;
    d.set_item("ghosts", bytes_list(py, ghosts)?)?;
    Ok(())
}
