//! Compiles arbitrary text as a JSON Schema, a Lark grammar or a regex (the first byte picks)
//! through the daemon's entry point, `Grammar::new` (the limit checks, then llguidance), and
//! masks a few steps of a generation. Errors are fine; panics, aborts and stack overflows are
//! bugs the daemon would have. The input format and the seeds are in `src/grammar_input.rs`.
//!
//! libFuzzer runs this on the main thread (8 MiB of stack); the limits are set to hold on 2 MiB
//! (`engine/src/constrain/limits.rs`), and the sanitizer's frames are two to three times the
//! size of plain ones, so an input that needs more than 2 MiB without the sanitizer is likely,
//! not certain, to overflow here. The engine's test of the seeds runs them on 2 MiB.
#![no_main]

#[path = "../src/grammar_input.rs"]
mod grammar_input;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    grammar_input::run(data);
});
