//! `leanstream run`'s benchmark flags on a tiny generated model: `--ignore-eos` decodes exactly
//! `--max-tokens` tokens, `--prompt-tokens` makes the prompt exactly N tokens, and `--warmup`
//! leaves the timed generation as it would have been without it.

use std::path::{Path, PathBuf};
use std::process::Command;

use leanstream_engine::model::gguf::TinyLlama;
use leanstream_engine::quant::DType;
use serde_json::Value;

use crate::support::ids;

/// A tiny model whose end-of-sequence id is `eos` (the weights do not depend on it).
fn tiny_with_eos(dir: &Path, eos: Option<u32>) -> PathBuf {
    let mut m = TinyLlama::new(21);
    let name = match eos {
        Some(id) => {
            m.eos = id;
            format!("tiny-eos-{id}.gguf")
        }
        None => "tiny.gguf".to_owned(),
    };
    let p = dir.join(name);
    m.write_gguf(&p, DType::Q8_0).expect("write tiny model");
    p
}

/// `leanstream run --json` on `model` with `extra` arguments, greedy, prompt `abc def`.
fn run(model: &Path, extra: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(["run", "--json", "--model"])
        .arg(model)
        .args(["--prompt", "abc def", "--temperature", "0"])
        .args(extra)
        .output()
        .expect("run leanstream");
    assert!(
        out.status.success(),
        "{extra:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

#[test]
fn ignore_eos_decodes_exactly_max_tokens_past_an_end_of_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let plain = tiny_with_eos(dir.path(), None);
    let all = run(&plain, &["--max-tokens", "12", "--ignore-eos"]);
    let want = ids(&all["ids"]);
    assert_eq!(want.len(), 12);
    assert_eq!(all["stop_reason"], "max_tokens");
    assert_eq!(all["stats"]["generated_tokens"], 12);

    // The same weights with the third generated id as end-of-sequence: greedy decoding stops
    // there unless told to ignore it.
    let eos_model = tiny_with_eos(dir.path(), Some(want[2] as u32));
    let stopped = run(&eos_model, &["--max-tokens", "12"]);
    assert_eq!(stopped["stop_reason"], "eos");
    assert!(ids(&stopped["ids"]).len() <= 3, "{stopped}");
    let ignored = run(&eos_model, &["--max-tokens", "12", "--ignore-eos"]);
    assert_eq!(ids(&ignored["ids"]), want);
    assert_eq!(ignored["stop_reason"], "max_tokens");
}

#[test]
fn prompt_tokens_repeats_or_cuts_the_prompt_to_exactly_n_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_with_eos(dir.path(), None);
    let natural = ids(&run(&model, &["--max-tokens", "1"])["prompt_ids"]);
    assert!(natural.len() > 2, "{natural:?}");

    let cut = run(&model, &["--max-tokens", "1", "--prompt-tokens", "2"]);
    assert_eq!(ids(&cut["prompt_ids"]), natural[..2]);
    assert_eq!(cut["stats"]["prompt_tokens"], 2);

    let long = run(&model, &["--max-tokens", "1", "--prompt-tokens", "64"]);
    let long_ids = ids(&long["prompt_ids"]);
    assert_eq!(long_ids.len(), 64);
    assert_eq!(long["stats"]["prompt_tokens"], 64);
    assert_eq!(long_ids[0], natural[0]);
}

#[test]
fn warmup_leaves_the_generation_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_with_eos(dir.path(), None);
    let args = ["--max-tokens", "8", "--ignore-eos", "--prompt-tokens", "40"];
    let cold = run(&model, &args);
    let warm = run(&model, &[&args[..], &["--warmup"]].concat());
    assert_eq!(ids(&warm["ids"]), ids(&cold["ids"]));
    assert_eq!(warm["stats"]["generated_tokens"], 8);
    assert_eq!(warm["stats"]["prompt_tokens"], 40);
}
