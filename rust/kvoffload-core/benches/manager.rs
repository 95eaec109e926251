//! Criterion benchmarks of the core manager (placeholder until the full bench lands).
fn main() {}
