//! The fuzz driver (`fuzz/driver.rs`) on stable Rust: seeded pseudo-random byte strings instead
//! of libFuzzer's coverage-guided ones, for a bounded time. `KVOFFLOAD_FUZZ_SECONDS` sets it
//! (default 2); `KVOFFLOAD_FUZZ_SEED` picks another sequence of inputs.
//!
//! ```text
//! KVOFFLOAD_FUZZ_SECONDS=600 cargo test --release -p kvoffload-core --test fuzz_ops -- --nocapture
//! ```

#[path = "../fuzz/driver.rs"]
mod driver;

use std::time::{Duration, Instant};

/// xorshift64*: a small, seedable generator (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn random_call_sequences_keep_every_invariant() {
    let budget = Duration::from_secs(env("KVOFFLOAD_FUZZ_SECONDS", 2));
    let mut rng = Rng(env("KVOFFLOAD_FUZZ_SEED", 0x5eed) | 1);
    let start = Instant::now();
    let (mut inputs, mut calls) = (0u64, 0usize);
    while start.elapsed() < budget {
        let len = (rng.next() % 1500) as usize;
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        calls += driver::run(&data);
        inputs += 1;
    }
    println!(
        "fuzz_ops: {inputs} inputs, {calls} calls in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    assert!(inputs > 0);
}
