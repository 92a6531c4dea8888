#![no_main]

//! The check lives in `tests/fuzz_checks/mod.rs`, shared with the replay of
//! saved inputs in `tests/it/fuzz_regressions.rs`.

#[path = "../../tests/fuzz_checks/mod.rs"]
mod fuzz_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_checks::check_pack(data));
