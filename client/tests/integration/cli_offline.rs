//! The offline CLI end to end: the real `leanstream` binary on the real SmolLM2 file and on tiny
//! generated models, including bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leanstream_engine::model::gguf::TinyLlama;
use leanstream_engine::quant::DType;
use serde_json::Value;

use crate::support::ids;

fn real_gguf() -> PathBuf {
    leanstream_engine::testing::real_model()
}

fn leanstream(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(args)
        .output()
        .expect("run leanstream")
}

fn ok_json(args: &[&str]) -> Value {
    let out = leanstream(args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

fn err_text(args: &[&str]) -> String {
    let out = leanstream(args);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Fast precision loads the projections as tiles of eight rows; every thread count splits them
/// on tile boundaries and gives the same tokens. Five threads split SmolLM2's 1,536 FFN rows
/// into tasks of 77, which are rounded up to whole tiles.
#[test]
fn fast_runs_on_tiles_give_the_same_ids_at_any_thread_count() {
    let m = real_gguf();
    let run = |threads: &str| {
        let v = ok_json(&[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "Once upon a time, there was a little",
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--precision",
            "fast",
            "--threads",
            threads,
            "--json",
        ]);
        ids(&v["ids"])
    };
    let one = run("1");
    assert_eq!(one.len(), 12);
    assert_eq!(run("5"), one);
}

#[test]
fn run_json_gives_the_fixture_greedy_ids() {
    let m = real_gguf();
    let v = ok_json(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "Once upon a time, there was a little",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--json",
    ]);
    assert_eq!(
        ids(&v["prompt_ids"]),
        [6403, 1980, 253, 655, 28, 665, 436, 253, 1838]
    );
    assert_eq!(
        ids(&v["ids"]),
        [
            8180, 3365, 20391, 617, 5732, 288, 1238, 281, 260, 2388, 30, 2306, 736, 1129, 685, 288
        ]
    );
    assert_eq!(
        v["text"],
        " girl named Emma who loved to play in the sun. She would often go to"
    );
    assert_eq!(
        v["stats"]["backend"], "cpu",
        "auto picks the CPU in this build"
    );
    for key in [
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "peak_rss_bytes",
    ] {
        assert!(
            v["stats"][key].as_f64().expect(key) > 0.0,
            "{key} missing or zero"
        );
    }
}

#[test]
fn run_streams_the_same_text_and_a_summary() {
    let m = real_gguf();
    let args = [
        "run",
        "--model",
        m.to_str().unwrap(),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "12",
    ];
    let out = leanstream(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert!(text.contains("Paris"), "{text:?}");
    let summary = String::from_utf8_lossy(&out.stderr);
    assert!(
        summary.contains("tok/s") && summary.contains("peak RSS"),
        "{summary}"
    );
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let v = ok_json(&json_args);
    assert_eq!(format!("{}\n", v["text"].as_str().expect("text")), text);
    // The chat template wrapped the prompt: it opens with <|im_start|> and ends "assistant\n".
    let p = ids(&v["prompt_ids"]);
    assert_eq!(p[0], 1);
    assert_eq!(p[p.len() - 3..], [520, 9531, 198]);
}

#[test]
fn sampling_is_repeatable_by_seed() {
    let m = real_gguf();
    let run = |seed: &str| {
        ids(&ok_json(&[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "The robot",
            "--max-tokens",
            "12",
            "--temperature",
            "1.0",
            "--top-k",
            "40",
            "--top-p",
            "0.95",
            "--seed",
            seed,
            "--json",
        ])["ids"])
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
}

#[test]
fn run_json_schema_constrains_the_text_and_a_bad_schema_is_refused() {
    let m = real_gguf();
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("command.json");
    std::fs::write(
        &schema,
        r#"{"type":"object","properties":{"action":{"enum":["pick","place"]},"object":{"type":"string","maxLength":12}},"required":["action","object"],"additionalProperties":false}"#,
    )
    .unwrap();
    let v = ok_json(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--chat",
        "--prompt",
        "Pick up the cup.",
        "--max-tokens",
        "48",
        "--json-schema",
        schema.to_str().unwrap(),
        "--json",
    ]);
    let text = v["text"].as_str().expect("text");
    let out: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        ["pick", "place"].contains(&out["action"].as_str().unwrap_or("")),
        "{text}"
    );
    assert!(
        out["object"]
            .as_str()
            .is_some_and(|o| o.chars().count() <= 12),
        "{text}"
    );
    assert_eq!(v["stop_reason"], "eos");
    assert_eq!(v["constraint"]["kind"], "JSON Schema");
    assert_eq!(v["constraint"]["complete"], true);

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"type": "strnig"}"#).unwrap();
    let e = err_text(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "hi",
        "--json-schema",
        bad.to_str().unwrap(),
    ]);
    assert!(
        e.contains("bad.json") && e.contains("invalid JSON Schema"),
        "{e}"
    );
}

#[test]
fn perplexity_json_reports_tokens_nll_and_ppl() {
    let m = real_gguf();
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/text/heldout-eval.txt");
    let v = ok_json(&[
        "perplexity",
        "--model",
        m.to_str().unwrap(),
        "--file",
        text,
        "--window",
        "128",
        "--json",
    ]);
    let (n, nll, ppl) = (
        v["tokens"].as_u64().unwrap(),
        v["nll"].as_f64().unwrap(),
        v["ppl"].as_f64().unwrap(),
    );
    assert!(n > 900, "{n} tokens");
    assert!((ppl - nll.exp()).abs() < 1e-6 * ppl);
    assert!(ppl > 2.0 && ppl < 100.0, "implausible perplexity {ppl}");
}

fn tiny(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    TinyLlama::new(21)
        .write_gguf(&p, DType::Q8_0)
        .expect("write tiny model");
    p
}

#[test]
fn convert_then_run_the_lsm() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny(dir.path());
    let dst = dir.path().join("tiny.lsm");
    let out = leanstream(&[
        "convert",
        src.to_str().unwrap(),
        "-o",
        dst.to_str().unwrap(),
        "--chunk-neurons",
        "8",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("relative RMS error"), "{report}");
    let run = |m: &Path| {
        ids(&ok_json(&[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "abc def",
            "--max-tokens",
            "6",
            "--json",
        ])["ids"])
    };
    assert_eq!(run(&src), run(&dst));
    let e = err_text(&[
        "convert",
        dst.to_str().unwrap(),
        "-o",
        dir.path().join("again.lsm").to_str().unwrap(),
    ]);
    assert!(e.contains("already a .lsm"), "{e}");
}

#[test]
fn export_gguf_then_run_both_and_bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let lsm = dir.path().join("synth.lsm");
    let out = leanstream(&[
        "synth",
        "--shape",
        "tiny",
        "--chunk-neurons",
        "1",
        "--down-type",
        "q5_0",
        "-o",
        lsm.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let gguf = dir.path().join("synth.gguf");
    let out = leanstream(&[
        "export-gguf",
        lsm.to_str().unwrap(),
        "-o",
        gguf.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("architecture llama, vocabulary 128 tokens"),
        "{stdout}"
    );
    assert!(
        stdout.contains("ffn_down re-encoded as q5_0 rows: lossless"),
        "{stdout}"
    );
    let run = |m: &Path| {
        ids(&ok_json(&[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "abc def",
            "--max-tokens",
            "6",
            "--json",
        ])["ids"])
    };
    assert_eq!(run(&lsm), run(&gguf));

    let missing = dir.path().join("missing.lsm");
    let e = err_text(&[
        "export-gguf",
        missing.to_str().unwrap(),
        "-o",
        dir.path().join("x.gguf").to_str().unwrap(),
    ]);
    assert!(
        e.contains("missing.lsm") && e.contains("No such file"),
        "{e}"
    );
    let e = err_text(&[
        "export-gguf",
        gguf.to_str().unwrap(),
        "-o",
        dir.path().join("x.gguf").to_str().unwrap(),
    ]);
    assert!(
        e.contains("synth.gguf") && e.contains("not a LeanStream .lsm file"),
        "{e}"
    );
    assert!(!dir.path().join("x.gguf").exists());
    assert!(!dir.path().join("x.gguf.partial").exists());
    let e = err_text(&["export-gguf", lsm.to_str().unwrap()]);
    assert!(e.contains("--output"), "{e}");
}

#[test]
fn a_saved_tokenizer_serves_synth_without_its_donor() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("tokenizer.json");
    let out = leanstream(&[
        "synth",
        "--shape",
        "tiny",
        "--save-tokenizer",
        saved.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lsm = dir.path().join("synth.lsm");
    let out = leanstream(&[
        "synth",
        "--shape",
        "tiny",
        "--tokenizer-from",
        saved.to_str().unwrap(),
        "-o",
        lsm.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("tokenizer: tiny test vocabulary (128 ids)"),
        "{stdout}"
    );
    assert!(lsm.is_file());

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{}").unwrap();
    let e = err_text(&[
        "synth",
        "--shape",
        "tiny",
        "--tokenizer-from",
        bad.to_str().unwrap(),
        "-o",
        "x.lsm",
    ]);
    assert!(
        e.contains("not a tokenizer saved by --save-tokenizer"),
        "{e}"
    );
}

#[test]
fn synth_then_bench_reports_the_disk_figures() {
    // On the crate's disk, where O_DIRECT works (/tmp may be tmpfs).
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let lsm = dir.path().join("synth.lsm");
    let out = leanstream(&["synth", "--shape", "tiny", "-o", lsm.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("SYNTHETIC") && stdout.contains("planted"),
        "{stdout}"
    );
    let json = dir.path().join("rows.json");
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "the cat sat on\n").unwrap();
    let out = leanstream(&[
        "bench",
        "--model",
        lsm.to_str().unwrap(),
        "--modes",
        "dense,on-demand",
        "--ffn-budget",
        "50%",
        "--tokens",
        "4",
        "--prompts",
        prompts.to_str().unwrap(),
        "--heldout-tokens",
        "4",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("disk busy") && stdout.contains("O_DIRECT"),
        "{stdout}"
    );
    let rows: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert!(
        rows[0]["disk_bandwidth"].is_null(),
        "dense reads nothing: {}",
        rows[0]
    );
    let r = &rows[1];
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
    assert!(
        f("disk_bandwidth") > 0.0 && f("io_bytes_per_s") > 0.0,
        "{r}"
    );
    assert!((f("disk_busy_share") - f("io_bytes_per_s") / f("disk_bandwidth")).abs() < 1e-9);
    let bound = f("disk_bandwidth") / f("missing_bytes_per_token");
    assert!(
        (f("storage_bound_tok_s") - bound).abs() < 1e-6 * bound,
        "{r}"
    );
}

#[test]
fn calibrate_reorder_then_run_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny(dir.path());
    let lsm = dir.path().join("tiny.lsm");
    let (src, lsm_s) = (src.to_str().unwrap(), lsm.to_str().unwrap());
    assert!(
        leanstream(&["convert", src, "-o", lsm_s, "--chunk-neurons", "8"])
            .status
            .success()
    );
    let text = dir.path().join("calib.txt");
    std::fs::write(
        &text,
        "the cat sat on the mat and the dog ran after it. ".repeat(8),
    )
    .unwrap();
    let eval = dir.path().join("eval.txt");
    std::fs::write(
        &eval,
        "a bird sang in a tree by the river at noon. ".repeat(4),
    )
    .unwrap();
    let cal = dir.path().join("cal.lsm");
    let (t, e, c) = (
        text.to_str().unwrap(),
        eval.to_str().unwrap(),
        cal.to_str().unwrap(),
    );
    let out = leanstream(&["calibrate", lsm_s, "--text", t, "--eval-text", e, "-o", c]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8_lossy(&out.stdout);
    for want in [
        "held-out perplexity",
        "lowrank",
        "hashing",
        "reordering by frequency",
    ] {
        assert!(report.contains(want), "no {want:?} in {report}");
    }
    let run = |m: &str| {
        ids(&ok_json(&[
            "run",
            "--model",
            m,
            "--prompt",
            "abc def",
            "--max-tokens",
            "6",
            "--json",
        ])["ids"])
    };
    assert_eq!(run(lsm_s), run(c));

    let e = err_text(&["calibrate", src, "-o", c]);
    assert!(e.contains("tiny.gguf"), "{e}");
    let e = err_text(&["calibrate", lsm_s, "--text", "/no/such/text.txt"]);
    assert!(e.contains("/no/such/text.txt"), "{e}");
}

#[test]
fn bad_input_gets_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let m = m.to_str().unwrap();

    let e = err_text(&["run", "--model", "/no/such/model.gguf", "--prompt", "hi"]);
    assert!(
        e.contains("/no/such/model.gguf") && e.contains("No such file"),
        "{e}"
    );

    let junk = dir.path().join("junk.bin");
    std::fs::write(&junk, b"definitely not a model").unwrap();
    let e = err_text(&["run", "--model", junk.to_str().unwrap(), "--prompt", "hi"]);
    assert!(e.contains("junk.bin") && e.contains("unknown magic"), "{e}");

    let e = err_text(&[
        "run",
        "--model",
        m,
        "--prompt",
        "a b c d e f g h i j k l",
        "--context",
        "4",
    ]);
    assert!(
        e.contains("prompt") && e.contains("do not fit in the context"),
        "{e}"
    );

    let e = err_text(&["run", "--model", m, "--prompt", ""]);
    assert!(e.contains("prompt") && e.contains("empty"), "{e}");

    let e = err_text(&["run", "--model", m, "--prompt", "hi", "--temperature=-1"]);
    assert!(e.contains("temperature"), "{e}");

    let e = err_text(&["run", "--model", m, "--prompt", "hi", "--context", "100000"]);
    assert!(e.contains("max_context"), "{e}");

    let bad_text = dir.path().join("latin1.txt");
    std::fs::write(&bad_text, [0x66, 0x6f, 0xe9, 0x0a]).unwrap();
    let e = err_text(&[
        "perplexity",
        "--model",
        m,
        "--file",
        bad_text.to_str().unwrap(),
    ]);
    assert!(e.contains("latin1.txt") && e.contains("not UTF-8"), "{e}");
}

/// `--backend cuda` in a build without the feature is refused with the reason, never run on the
/// CPU behind the user's back; `auto` says on stderr which backend it took and why.
#[cfg(not(feature = "cuda"))]
#[test]
fn backend_choice_is_reported_and_cuda_without_the_feature_is_refused() {
    let m = real_gguf();
    let m = m.to_str().unwrap();
    let run = |backend: &str| {
        leanstream(&[
            "run",
            "--model",
            m,
            "--prompt",
            "Hi",
            "--max-tokens",
            "2",
            "--backend",
            backend,
        ])
    };
    let out = run("cuda");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("feature `cuda`"), "{err}");
    let out = run("auto");
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("compute backend: cpu (auto: using the CPU because"),
        "{err}"
    );
    let err = err_text(&["run", "--model", m, "--prompt", "Hi", "--backend", "gpu"]);
    assert!(err.contains("auto, cpu, cuda"), "{err}");
}

#[test]
fn a_memory_budget_streams_weights_and_gives_the_same_greedy_ids() {
    let m = real_gguf();
    let m = m.to_str().unwrap();
    let args = |budget: Option<&'static str>| {
        let mut a: Vec<&str> = vec![
            "run",
            "--model",
            m,
            "--prompt",
            "Once upon a time, there was a little",
            "--max-tokens",
            "16",
            "--context",
            "64",
            "--json",
        ];
        if let Some(b) = budget {
            a.extend(["--memory-budget", b]);
        }
        a
    };
    let full = ok_json(&args(None));
    let planned = ok_json(&args(Some("50MB")));
    assert_eq!(ids(&planned["ids"]), ids(&full["ids"]));
    let plan = &planned["plan"];
    assert!(
        plan["planned_bytes"].as_u64().unwrap() <= 50_000_000,
        "{plan}"
    );
    assert!(plan["streamed_layers"].as_u64().unwrap() > 0, "{plan}");
    assert_eq!(
        plan["head"], "streamed",
        "50 MB cannot keep the 30 MB head and the floor"
    );
    assert!(planned["stream"]["bytes_read"].as_u64().unwrap() > 0);
    assert!(full["plan"].is_null());

    let out = leanstream(&["plan", "--model", m, "--budget", "50MB", "--context", "64"]);
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("streamed") && table.contains("read per token"),
        "{table}"
    );

    let err = err_text(&[
        "run",
        "--model",
        m,
        "--prompt",
        "hi",
        "--memory-budget",
        "8MB",
    ]);
    assert!(
        err.contains("runtime") && err.contains("tokenizer"),
        "{err}"
    );
}
