//! The memory cost of a batched key lookup, with nothing else around it: how much more a key
//! costs in a pool of 10^7 chunks than in one of 10^3 when only the cache lines a lookup must
//! read are read. It bounds from below what any index can achieve against pool size, and so
//! tells which "10^7 within 1.5x of 10^3" targets are within reach of a real manager (whose
//! per-key cost at 10^3 sets the allowance: half of it).
//!
//! Two models of a `lookup_prefix` of a window of 32 keys adjacent in memory (a request's
//! prefix, as `benches/cases.py` picks them), all resident:
//!
//! - `minimal`: the lookup stripped to its memory accesses. Each key (a 64-byte line, standing
//!   for the key object) is read for its hash; one index word per key at a random place (a
//!   hash table of 8-byte words, at most half full, linear probing); then the key's slot (64
//!   bytes holding the key's words), compared with the key. The misses of a window overlap as
//!   the manager overlaps them: every index word is prefetched first, then every slot. The
//!   arrays sit on 2 MiB pages where the kernel grants them (as the manager's tables do).
//! - `pointer`: `minimal` with the key out of its slot, as a slot that refers to the stored key
//!   object instead of holding the key's bytes would have it: the slot holds the place of a
//!   separate line (the stored key, made in store order, so a window's stored keys are adjacent
//!   too), which a third pass prefetches and compares. What the layout that would take kvoffload
//!   to 64 bytes a chunk costs a lookup: one more dependent access per key.
//! - `table`: kvoffload's own chunk table ([`Slots`] filled in key order, then the lock-free
//!   [`ChunkTable::lookup_prefix`] the binding calls), driven from Rust: the manager's index
//!   without the Python call around it.
//!
//! ```text
//! cargo run --release -p kvoffload-core --example memory_floor [--scattered] [--json PATH] [sizes...]
//! ```
//!
//! Prints, per pool size, nanoseconds per key (best of several runs) and the ratio to the
//! smallest size, and the `minimal` and `pointer` models once more for lookups of one key (a
//! window of one: nothing to overlap, as in a `lookup` call). The slots of a window are
//! adjacent too (keys stored in order take consecutive chunks); `--scattered` stores the keys
//! in a random order instead, so every key's slot is at a random place. `--json PATH` also
//! writes the figures as JSON (`benches/make_report.py` puts them on the performance page).

use kvoffload_core::mem::prefetch;
use kvoffload_core::{hash_key, ChunkId, ChunkTable, Slots};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

/// A key object or a slot: one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u64; 8]);

/// Keys of a window, as in the manager's benchmark cases.
const WINDOW: usize = 32;

/// Reproducible pseudo-random numbers: the crate's key hash of a counter.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 += 1;
        hash_key(&self.0.to_le_bytes())
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `n` zeroed values of `T` on 2 MiB pages where the kernel grants them (the mapping lives as
/// long as the process). `T` must be plain integers (all-zero bytes are a valid value).
fn huge_zeroed<T: Copy>(n: usize) -> &'static mut [T] {
    const HUGE: usize = 2 << 20;
    let bytes = (n * std::mem::size_of::<T>()).max(1).next_multiple_of(HUGE);
    // SAFETY: a fresh private anonymous mapping, so no existing memory is touched; the advice
    // only changes how the kernel backs the pages. Anonymous pages read as zeros, a valid `T`
    // (plain integers, per the contract above), and the mapping is page-aligned, which meets
    // `T`'s alignment (64 at most here). It is never unmapped, so the slice may be 'static.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert!(p != libc::MAP_FAILED, "cannot map {bytes} bytes");
        libc::madvise(p, bytes, libc::MADV_HUGEPAGE);
        std::slice::from_raw_parts_mut(p.cast::<T>(), n)
    }
}

/// `n` keys, their slots and an index from hash to slot.
struct Pool {
    keys: &'static mut [Line],
    slots: &'static mut [Line],
    /// The keys again, as the objects a slot would refer to (`pointer`); a slot's last word is
    /// its key's place here.
    stored: &'static mut [Line],
    /// `tag << 32 | slot + 1`, 0 when empty.
    index: &'static mut [u64],
    mask: usize,
}

impl Pool {
    fn new(n: usize, place: &[usize], rng: &mut Rng) -> Self {
        let keys = huge_zeroed::<Line>(n);
        for k in keys.iter_mut() {
            for w in &mut k.0[..5] {
                *w = rng.next();
            }
        }
        let words = (2 * n).next_power_of_two();
        let pool = Self {
            keys,
            slots: huge_zeroed::<Line>(n),
            stored: huge_zeroed::<Line>(n),
            index: huge_zeroed::<u64>(words),
            mask: words - 1,
        };
        for (i, &s) in place.iter().enumerate() {
            pool.slots[s] = pool.keys[i];
            // Stored keys are made in store order: the i-th stored is the i-th made.
            pool.stored[i] = pool.keys[i];
            pool.slots[s].0[7] = i as u64;
            let h = pool.keys[i].0[0];
            let mut at = (h as usize) & pool.mask;
            while pool.index[at] != 0 {
                at = (at + 1) & pool.mask;
            }
            pool.index[at] = (h >> 32) << 32 | (s as u64 + 1);
        }
        pool
    }

    /// Leading keys of `keys[start..start + window]` that are found (all of them, here), the
    /// keys compared in their slots (`pointer`: in the stored keys the slots refer to).
    #[inline(never)]
    fn lookup_prefix(&self, start: usize, window: usize, pointer: bool) -> usize {
        let window = &self.keys[start..start + window];
        let mut at = [0usize; WINDOW];
        for (a, k) in at.iter_mut().zip(window) {
            *a = (k.0[0] as usize) & self.mask;
            prefetch(&self.index[*a]);
        }
        let mut slot = [usize::MAX; WINDOW];
        for ((s, &a), k) in slot.iter_mut().zip(&at).zip(window) {
            let tag = k.0[0] >> 32;
            let mut a = a;
            loop {
                let word = self.index[a];
                if word == 0 {
                    break;
                }
                if word >> 32 == tag {
                    *s = (word as u32 - 1) as usize;
                    prefetch(&self.slots[*s]);
                    break;
                }
                a = (a + 1) & self.mask;
            }
        }
        if pointer {
            let mut obj = [usize::MAX; WINDOW];
            for (o, &s) in obj.iter_mut().zip(&slot[..window.len()]) {
                if s != usize::MAX {
                    *o = self.slots[s].0[7] as usize;
                    prefetch(&self.stored[*o]);
                }
            }
            return obj
                .iter()
                .zip(window)
                .take_while(|&(&o, k)| o != usize::MAX && self.stored[o].0[..5] == k.0[..5])
                .count();
        }
        slot.iter()
            .zip(window)
            .take_while(|&(&s, k)| s != usize::MAX && self.slots[s].0[..5] == k.0[..5])
            .count()
    }
}

/// kvoffload's chunk table holding `n` keys of 36 bytes (a block hash and a group index, as
/// vLLM's), the keys adjacent in one array as the benchmark's key objects are.
struct Table {
    keys: Vec<[u8; 36]>,
    _slots: Slots,
    shared: Arc<ChunkTable>,
}

impl Table {
    fn new(n: usize, place: &[usize], rng: &mut Rng) -> Self {
        let keys: Vec<[u8; 36]> = (0..n)
            .map(|_| {
                let mut k = [0u8; 36];
                for part in k[..32].chunks_exact_mut(8) {
                    part.copy_from_slice(&rng.next().to_le_bytes());
                }
                k
            })
            .collect();
        let chunks = ChunkId::try_from(n).expect("at most 2^32 chunks");
        let mut slots = Slots::new(chunks).expect("the table maps");
        slots.grow(n);
        for (i, &s) in place.iter().enumerate() {
            let c = s as ChunkId;
            slots.insert(c, &keys[i], hash_key(&keys[i]));
            slots.complete_store(c);
        }
        let shared = slots.shared();
        Self {
            keys,
            _slots: slots,
            shared,
        }
    }

    #[inline(never)]
    fn lookup_prefix(&self, start: usize) -> usize {
        let mut window: [&[u8]; WINDOW] = [&[]; WINDOW];
        for (w, k) in window.iter_mut().zip(&self.keys[start..start + WINDOW]) {
            *w = k;
        }
        self.shared.lookup_prefix(&window).unwrap_or(0)
    }
}

/// Nanoseconds per key of `windows` random windows of `window` keys in a pool of `n`, best of
/// `runs`.
fn time(
    n: usize,
    window: usize,
    lookup_prefix: impl Fn(usize) -> usize,
    windows: usize,
    runs: usize,
    rng: &mut Rng,
) -> f64 {
    let starts: Vec<usize> = (0..windows).map(|_| rng.below(n - window + 1)).collect();
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let t = Instant::now();
        let mut hits = 0;
        for &s in &starts {
            hits += lookup_prefix(black_box(s));
        }
        let ns = t.elapsed().as_nanos() as f64 / (windows * window) as f64;
        assert_eq!(
            black_box(hits),
            windows * window,
            "every key is in the pool"
        );
        best = best.min(ns);
    }
    best
}

/// One pool size's figures, ns per key.
struct Row {
    n: usize,
    minimal: f64,
    table: f64,
    pointer: f64,
    single_minimal: f64,
    single_pointer: f64,
}

fn main() {
    let mut scattered = false;
    let mut json = None;
    let mut sizes = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--scattered" {
            scattered = true;
        } else if arg == "--json" {
            json = args.next();
        } else {
            match arg.parse::<f64>() {
                Ok(x) if x >= WINDOW as f64 => sizes.push(x as usize),
                _ => {
                    eprintln!(
                        "usage: memory_floor [--scattered] [--json PATH] [sizes, each >= {WINDOW}]"
                    );
                    std::process::exit(2);
                }
            }
        }
    }
    if sizes.is_empty() {
        sizes = vec![1_000, 100_000, 1_000_000, 10_000_000];
    }
    let mut rng = Rng(0);
    let layout = if scattered { "scattered" } else { "adjacent" };
    println!("lookup_prefix of {WINDOW} adjacent keys, their slots {layout}; ns per key");
    println!(
        "{:>12}  {:>8} {:>7}  {:>8} {:>7}  {:>8} {:>7}  {:>15} {:>15}",
        "chunks", "minimal", "", "table", "", "pointer", "", "single minimal", "single pointer"
    );
    let mut rows: Vec<Row> = Vec::new();
    for &n in &sizes {
        let mut place: Vec<usize> = (0..n).collect();
        if scattered {
            for i in (1..n).rev() {
                place.swap(i, rng.below(i + 1));
            }
        }
        let (minimal, pointer, single_minimal, single_pointer) = {
            let pool = Pool::new(n, &place, &mut rng);
            let mut t = |window, pointer| {
                let f = |s| pool.lookup_prefix(s, window, pointer);
                time(n, window, f, 200_000, 5, &mut rng)
            };
            (t(WINDOW, false), t(WINDOW, true), t(1, false), t(1, true))
        };
        let table = {
            let t = Table::new(n, &place, &mut rng);
            time(n, WINDOW, |s| t.lookup_prefix(s), 200_000, 5, &mut rng)
        };
        let row = Row {
            n,
            minimal,
            table,
            pointer,
            single_minimal,
            single_pointer,
        };
        let first = rows.first().unwrap_or(&row);
        println!(
            "{n:>12}  {minimal:8.2} {:6.2}x  {table:8.2} {:6.2}x  {pointer:8.2} {:6.2}x  \
             {single_minimal:15.2} {single_pointer:15.2}",
            minimal / first.minimal,
            table / first.table,
            pointer / first.pointer,
        );
        rows.push(row);
    }
    if let Some(path) = json {
        let list = |f: &dyn Fn(&Row) -> String| rows.iter().map(f).collect::<Vec<_>>().join(", ");
        let ns = |f: fn(&Row) -> f64| list(&|r| format!("{:.3}", f(r)));
        let doc = format!(
            "{{\"window\": {WINDOW}, \"layout\": \"{layout}\", \"sizes\": [{}], \
             \"minimal_ns\": [{}], \"table_ns\": [{}], \"pointer_ns\": [{}], \
             \"single_minimal_ns\": [{}], \"single_pointer_ns\": [{}]}}\n",
            list(&|r| r.n.to_string()),
            ns(|r| r.minimal),
            ns(|r| r.table),
            ns(|r| r.pointer),
            ns(|r| r.single_minimal),
            ns(|r| r.single_pointer),
        );
        if let Err(e) = std::fs::write(&path, doc) {
            eprintln!("memory_floor: cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
}
