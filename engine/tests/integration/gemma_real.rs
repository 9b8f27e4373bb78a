//! The engine on the real Gemma-3-270M (Q4_K_M GGUF: q8_0, q5_0, q4_k and q6_k tensors; GeGLU,
//! post-norms, QK-norm, sliding-window layers) against the independent numpy reference of
//! `scripts/reference/gemma3.py`, whose fixture is `tests/fixtures/gemma3-270m.json` (prompt ids
//! from llama.cpp's tokenizer, greedy ids, first-step top-5 logits, a held-out NLL).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::score;
use leanstream_engine::kv::KvType;
use leanstream_engine::model::lsm;
use leanstream_engine::pipeline::{Executor, Mode, SparseModel};
use leanstream_engine::sample::argmax;
use leanstream_engine::testing;
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    model_sha256: String,
    prompts: Vec<Case>,
    heldout: Heldout,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    top5_first: Vec<(u32, f32)>,
    /// Per greedy step, the reference's gap between its first and second logit.
    greedy_gaps: Vec<f32>,
}

#[derive(Deserialize)]
struct Heldout {
    ids: Vec<u32>,
    mean_nll: f64,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let text = include_str!("../fixtures/gemma3-270m.json");
        serde_json::from_str(text).expect("the Gemma fixture parses")
    })
}

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| Model::load(&testing::gemma_model()).expect("load Gemma"))
        .clone()
}

/// A difference of top logits below this is a near-tie: f32 rounding in a different summation
/// order may flip it, so a greedy path may part from the reference's there (and only there).
const NEAR_TIE: f32 = 0.1;

/// Greedy decoding of `prompt` for `n` tokens; also the first step's logits.
fn greedy(session: &mut Session, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let first = session.forward_batch(prompt).expect("prefill").to_vec();
    let mut ids = vec![argmax(&first)];
    while ids.len() < n {
        let next = argmax(session.forward(*ids.last().expect("one")).expect("forward"));
        ids.push(next);
    }
    (ids, first)
}

/// Asserts `got` follows the reference's greedy ids, parting only at a near-tie.
fn assert_follows(case: &Case, got: &[u32], what: &str) {
    if let Some(i) = got.iter().zip(&case.greedy_ids).position(|(a, b)| a != b) {
        assert!(
            case.greedy_gaps[i] < NEAR_TIE,
            "{what}: {}: greedy ids part from the reference at step {i} (gap {}): {got:?} vs {:?}",
            case.name,
            case.greedy_gaps[i],
            case.greedy_ids
        );
        eprintln!("{what}: {}: parts at a near-tie at step {i}", case.name);
    }
}

fn top5(logits: &[f32]) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    idx.into_iter()
        .take(5)
        .map(|i| (i, logits[i as usize]))
        .collect()
}

/// The importer reads what the file describes (scripts/fetch-model has checked the file is the
/// one of the fixture's `model_sha256`).
#[test]
fn the_config_has_every_gemma_feature() {
    let c = &model().weights.config;
    assert_eq!(c.architecture.name(), "gemma3");
    assert_eq!(
        (c.n_layers, c.d_model, c.n_ff, c.head_dim),
        (18, 640, 2048, 256)
    );
    assert!(c.qk_norm && c.post_norms && c.tied_embeddings);
    let sw = c.sliding_window.expect("sliding window");
    assert_eq!(
        (sw.window, sw.global_every, sw.rope_base),
        (512, 6, 10_000.0)
    );
    assert_eq!(c.rope_base, 1_000_000.0);
    assert_eq!(c.embedding_scale, 640f32.sqrt());
    assert_eq!(fixture().model_sha256.len(), 64);
}

#[test]
fn the_tokenizer_matches_llama_cpp_on_every_prompt() {
    let m = model();
    for case in &fixture().prompts {
        let ids = m.tokenizer.encode(&case.text).expect("encode");
        assert_eq!(ids, case.prompt_ids, "{}", case.name);
    }
    let heldout = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/text/heldout-eval.txt"
    ))
    .expect("held-out text");
    let ids = m.tokenizer.encode(&heldout).expect("encode");
    assert_eq!(ids[..257], fixture().heldout.ids[..], "held-out text");
}

#[test]
fn exact_path_follows_the_reference_on_every_prompt() {
    let m = model();
    for case in &fixture().prompts {
        let mut s = Session::new(m.clone(), 160, Precision::Exact, KvType::F32).expect("session");
        let (ids, first) = greedy(&mut s, &case.prompt_ids, case.greedy_ids.len());
        let top = top5(&first);
        let mut worst = 0f32;
        for ((id, logit), (want_id, want)) in top.iter().zip(&case.top5_first) {
            assert_eq!(id, want_id, "{}: top-5 ids {top:?}", case.name);
            worst = worst.max((logit - want).abs());
        }
        assert!(worst < 0.05, "{}: top-5 logits off by {worst}", case.name);
        eprintln!(
            "{}: top-5 logits within {worst:.2e} of the reference",
            case.name
        );
        assert_follows(case, &ids, "exact");
    }
}

fn heldout_nll(path: &Path, precision: Precision) -> f64 {
    let m = Model::load(path).expect("load");
    let mut s = Session::new(m, 300, precision, KvType::F32).expect("session");
    let (nll, n) = score(&mut s, &fixture().heldout.ids).expect("score");
    nll / n as f64
}

#[test]
fn held_out_nll_is_within_half_a_percent_and_the_fast_path_within_two() {
    let want = fixture().heldout.mean_nll;
    let exact = heldout_nll(&testing::gemma_model(), Precision::Exact);
    let rel = (exact - want).abs() / want;
    eprintln!(
        "held-out NLL: exact {exact:.5} vs reference {want:.5} ({:+.3} %)",
        rel * 100.0
    );
    assert!(rel < 0.005, "exact NLL {exact} vs reference {want}");
    let fast = heldout_nll(&testing::gemma_model(), Precision::Fast);
    let rel = (fast - want).abs() / want;
    eprintln!("held-out NLL: fast {fast:.5} ({:+.3} %)", rel * 100.0);
    assert!(rel < 0.02, "fast NLL {fast} vs reference {want}");
}

/// The `.lsm` conversion (default q8_0 down columns) and the streaming modes on it: with
/// sparsity off every mode computes what the dense path on the same file does, and the file
/// stays within the perplexity bound of its GGUF.
#[test]
fn lsm_and_streaming_modes_follow_the_dense_path() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("gemma.lsm");
    let imported =
        leanstream_engine::model::load_imported(&testing::gemma_model()).expect("import");
    lsm::convert(
        &imported,
        &out,
        &lsm::ConvertOptions::default(),
        &mut |_, _| {},
    )
    .expect("convert");
    drop(imported);
    let gguf = heldout_nll(&testing::gemma_model(), Precision::Exact);
    let file = heldout_nll(&out, Precision::Exact);
    eprintln!("held-out NLL: .lsm {file:.5} vs GGUF {gguf:.5}");
    assert!(
        (file - gguf).abs() / gguf < 0.015,
        ".lsm NLL {file} vs GGUF {gguf}"
    );

    let case = &fixture().prompts[0];
    let sm = SparseModel::open(&out, false).expect("open");
    let mut s = Session::new(sm.model.clone(), 64, Precision::Exact, KvType::F32).expect("s");
    let (dense, _) = greedy(&mut s, &case.prompt_ids, 8);
    for mode in [Mode::Mmap, Mode::Prefetch, Mode::LeanStream] {
        let sm = SparseModel::open_for_mode(&out, mode, false).expect("open");
        let budget = sm.layout.streamed_bytes() / 4;
        let mut exec = Executor::new(&sm, testing::exact_options(mode, budget)).expect("executor");
        let mut s = Session::new(sm.model.clone(), 64, Precision::Exact, KvType::F32).expect("s");
        let mut logits = Vec::new();
        for &t in &case.prompt_ids {
            logits = s.forward_with(t, &mut exec).expect("forward").to_vec();
        }
        let mut ids = vec![argmax(&logits)];
        while ids.len() < dense.len() {
            let next = argmax(
                s.forward_with(*ids.last().expect("one"), &mut exec)
                    .expect("f"),
            );
            ids.push(next);
        }
        assert_eq!(ids, dense, "{mode}: greedy ids");
        if mode.uses_cache() {
            assert!(exec.stats().bytes_read > 0, "{mode} streamed nothing");
        }
    }
}
