//! The grammar fuzz target's seeds run as ordinary tests, on a thread with a 2 MiB stack (what
//! a thread spawned with Rust's default has): each compiles or is refused as its seed says,
//! the reproducers among the refused, and none crashes.

use leanstream_engine::Error;
use leanstream_engine::constrain::Grammar;

use crate::grammar_input::{self, Seed};

/// Runs `seed` through the fuzz target's body on a 2 MiB stack; returns whether it compiled.
fn run_on_2_mib(seed: &Seed) -> bool {
    let input = grammar_input::encode(seed.kind, &seed.text);
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || grammar_input::run(&input))
        .expect("spawn")
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

#[test]
fn every_seed_compiles_or_is_refused_as_it_says_on_a_2_mib_stack() {
    for seed in grammar_input::seeds() {
        assert_eq!(run_on_2_mib(&seed), seed.compiles, "{}", seed.name);
    }
}

#[test]
fn the_reproducers_are_refused_as_invalid_grammars_in_one_line() {
    let vocab = grammar_input::vocab();
    let reproducers = grammar_input::seeds().into_iter();
    let reproducers: Vec<Seed> = reproducers
        .filter(|s| s.name.starts_with("reproducer_"))
        .collect();
    assert_eq!(reproducers.len(), 6);
    for seed in reproducers {
        match Grammar::new(vocab, seed.kind, &seed.text) {
            Err(Error::InvalidGrammar { kind, reason }) => {
                assert_eq!(kind, seed.kind, "{}", seed.name);
                assert!(reason.contains("; at most "), "{}: {reason}", seed.name);
                assert!(!reason.contains('\n'), "{}: {reason}", seed.name);
            }
            other => panic!("{}: expected InvalidGrammar, got {other:?}", seed.name),
        }
    }
}

#[test]
fn inputs_round_trip_through_the_fuzz_format() {
    for seed in grammar_input::seeds().into_iter().take(3) {
        let input = grammar_input::encode(seed.kind, &seed.text);
        assert_eq!(
            grammar_input::decode(&input),
            Some((seed.kind, seed.text.as_str()))
        );
    }
    assert_eq!(grammar_input::decode(&[]), None);
    assert_eq!(grammar_input::decode(&[1, 0xFF]), None);
}
