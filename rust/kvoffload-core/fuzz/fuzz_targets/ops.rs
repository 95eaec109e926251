//! libFuzzer target: the input is a manager configuration and a call sequence (`driver.rs`).
#![no_main]

#[path = "../driver.rs"]
mod driver;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    driver::run(data);
});
