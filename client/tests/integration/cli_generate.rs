//! What a new user meets with `generate` against the mock daemon (see `support`): a plain prompt
//! goes in as a chat message, an empty answer is reported, a constrained output cut short is a
//! failure of its own, and an unreachable bus is explained once. Skips (saying so) where
//! `dbus-daemon` is not installed.

use serde_json::Value;

use crate::support::{MockDaemon, TestBus, cli, text};

#[test]
fn a_plain_prompt_is_sent_as_one_user_message_and_raw_sends_it_as_is() {
    let Some(test_bus) = TestBus::start() else {
        return;
    };
    let _daemon = MockDaemon::start(&test_bus.address);
    let a = test_bus.address.as_str();

    let out = cli(a, &["generate", "What is a lighthouse for?"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "turn 1: What is a lighthouse for?\n");

    let out = cli(a, &["generate", "--raw", "<|im_start|>user"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "echo: <|im_start|>user\n");
}

#[test]
fn a_generation_without_text_says_so_on_stderr() {
    let Some(test_bus) = TestBus::start() else {
        return;
    };
    let _daemon = MockDaemon::start(&test_bus.address);
    let a = test_bus.address.as_str();

    let out = cli(a, &["generate", "silent"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "\n");
    let err = text(&out.stderr);
    assert!(
        err.contains("leanstream: the model produced no text (it ended at once: end of turn)"),
        "{err}"
    );
    assert!(!err.contains("--raw"), "{err}");

    // A raw prompt answered by the end of turn points at the chat form.
    let out = cli(a, &["generate", "--raw", "silent"], "");
    let err = text(&out.stderr);
    assert!(err.contains("produced no text"), "{err}");
    assert!(
        err.contains("without it, it goes in as a chat message"),
        "{err}"
    );

    // A text answer gets no such note.
    let out = cli(a, &["generate", "hello"], "");
    assert!(
        !text(&out.stderr).contains("no text"),
        "{}",
        text(&out.stderr)
    );

    let out = cli(a, &["chat", "--model", "tiny"], "silent\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("the model produced no text"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_constrained_output_cut_by_max_tokens_fails_with_status_4_naming_the_fix() {
    let Some(test_bus) = TestBus::start() else {
        return;
    };
    let _daemon = MockDaemon::start(&test_bus.address);
    let a = test_bus.address.as_str();
    let dir = tempfile::tempdir().expect("tempdir");
    let schema = dir.path().join("action.json");
    std::fs::write(&schema, r#"{"type":"object"}"#).expect("write the schema");
    let schema = schema.to_str().expect("a UTF-8 path");

    let out = cli(
        a,
        &[
            "generate",
            "--json-schema",
            schema,
            "--max-tokens",
            "4",
            "x",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    // The text that came is still printed.
    assert_eq!(text(&out.stdout), "turn\n");
    let err = text(&out.stderr);
    assert!(err.contains("--json-schema output is incomplete"), "{err}");
    assert!(err.contains("--max-tokens reached"), "{err}");
    assert!(
        err.contains("pass a larger --max-tokens (it was 4)"),
        "{err}"
    );

    let out = cli(
        a,
        &[
            "generate",
            "--json-schema",
            schema,
            "--max-tokens",
            "4",
            "--json",
            "x",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("stdout is still one JSON object");
    assert_eq!(v["reason"], "max_tokens");

    // Ended by the model itself, or unconstrained: a success.
    let out = cli(a, &["generate", "--json-schema", schema, "x"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "turn[json_schema] 1: x\n");
    let out = cli(a, &["generate", "--max-tokens", "4", "x"], "");
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn an_unreachable_bus_names_the_os_error_once_and_what_to_do() {
    let address = "unix:path=/nonexistent/socket";
    let out = cli(address, &["generate", "hello"], "");
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let os_error = std::io::Error::from_raw_os_error(libc::ENOENT).to_string();
    assert_eq!(err.matches(&os_error).count(), 1, "{err}");
    assert!(err.contains(address), "{err}");
    assert!(err.contains("with leanstreamd on it?"), "{err}");
    assert!(err.contains("--bus system or --bus session"), "{err}");
}
