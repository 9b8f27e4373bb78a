//! Argument errors of the daemon commands: rejected by the CLI itself (exit 2) before any bus is
//! touched.

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
    usage_error(&["generate", "--temperature=-1", "x"], "is negative");
    usage_error(&["generate", "--temperature", "nan", "x"], "not finite");
    usage_error(&["generate", "--top-p", "0", "x"], "not in (0, 1]");
    usage_error(&["generate", "--max-tokens=-3", "x"], "--max-tokens");
    usage_error(&["generate", "--seed", "many", "x"], "--seed");
    usage_error(&["--bus", "sytem", "models"], "invalid bus \"sytem\"");
    usage_error(&["load"], "<NAME>");
    usage_error(&["status", "--table"], "--table");
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
