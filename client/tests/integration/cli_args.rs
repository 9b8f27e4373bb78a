//! Argument errors of the daemon and offline commands: rejected by the CLI itself (exit 2) before
//! any bus or file is touched.

use std::process::{Command, Output};

fn leanstream(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(args)
        .output()
        .expect("run leanstream")
}

fn usage_error(args: &[&str], needle: &str) {
    let out = leanstream(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: expected {needle:?} in {err}"
    );
}

#[test]
fn bad_arguments_exit_2_with_the_reason() {
    usage_error(&["generate"], "<PROMPT>");
    usage_error(&["generate", "--temperature=-1", "x"], "outside 0..=100");
    usage_error(&["generate", "--temperature", "nan", "x"], "not finite");
    usage_error(&["generate", "--top-p", "0", "x"], "outside (0, 1]");
    usage_error(&["generate", "--max-tokens=-3", "x"], "--max-tokens");
    usage_error(&["generate", "--seed", "many", "x"], "--seed");
    usage_error(&["--bus", "sytem", "models"], "invalid bus \"sytem\"");
    usage_error(&["load"], "<NAME>");
    usage_error(&["status", "--table"], "--table");
}

#[test]
fn negative_numbers_reach_the_range_checks_as_values() {
    // `-1` after a numeric option is its value, not an unknown flag: the range check answers.
    let cases: [(&[&str], &str); 10] = [
        (&["generate", "--temperature", "-1", "x"], "outside 0..=100"),
        (&["generate", "--top-p", "-0.5", "x"], "outside (0, 1]"),
        (
            &["generate", "--repetition-penalty", "-1", "x"],
            "repetition",
        ),
        (&["generate", "--max-tokens", "-3", "x"], "-3 is negative"),
        (&["generate", "--top-k", "-1", "x"], "-1 is negative"),
        (&["generate", "--seed", "-5", "x"], "-5 is negative"),
        (&["generate", "--context", "-1", "x"], "-1 is negative"),
        (
            &["generate", "--first-token-deadline-ms", "-1", "x"],
            "-1 is negative",
        ),
        (&["generate", "--deadline-ms", "-1", "x"], "-1 is negative"),
        (&["chat", "--temperature", "-1"], "outside 0..=100"),
    ];
    for (args, needle) in cases {
        usage_error(args, needle);
        let err = String::from_utf8_lossy(&leanstream(args).stderr).into_owned();
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

#[test]
fn help_lists_the_daemon_commands_and_the_bus_flag() {
    let out = leanstream(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for word in [
        "models", "load", "unload", "generate", "chat", "status", "--bus",
    ] {
        assert!(help.contains(word), "{word} missing from:\n{help}");
    }
}

#[test]
fn storage_types_are_spelled_as_the_model_formats_spell_them() {
    // `q8_0`, not clap's derived `q8-0`: what `convert` prints and GGUF tools call the type.
    usage_error(
        &["convert", "a.gguf", "-o", "b.lsm", "--down-type", "q8-0"],
        "q8_0",
    );
    usage_error(&["synth", "-o", "b.lsm", "--weight-type", "q4-1"], "q4_1");
    let out = leanstream(&["convert", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("q8_0") && help.contains("f16"), "{help}");
}
