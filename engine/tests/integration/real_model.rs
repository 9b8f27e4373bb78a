//! The engine on the real SmolLM2-135M file, from the GGUF and from its `.lsm`, against the
//! independent reference fixture and against our own reference forward pass.

use crate::common;

use std::path::Path;

use crate::common::{FIXTURE, heldout_text, real_gguf, real_lsm, top_n};
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::{generate, score};
use leanstream_engine::kv::KvType;
use leanstream_engine::reference::Reference;
use leanstream_engine::sample::SamplerConfig;

fn check_fixture(path: &Path) {
    let model = Model::load(path).expect("load model");
    for case in &FIXTURE {
        let ids = model.tokenizer.encode(case.prompt).expect("encode");
        assert_eq!(ids, case.prompt_ids, "prompt ids of {:?}", case.prompt);

        let mut session =
            Session::new(model.clone(), 64, Precision::Exact, KvType::F32).expect("session");
        let (last, rest) = ids.split_last().expect("non-empty");
        for &t in rest {
            session.forward(t).expect("forward");
        }
        let top = top_n(session.forward(*last).expect("forward"), 5);
        let mut worst = 0f32;
        for ((id, logit), (want_id, want)) in top.iter().zip(case.top5) {
            assert_eq!(*id, want_id, "top-5 ids of {:?}: {top:?}", case.prompt);
            assert!(
                (logit - want).abs() < 0.05,
                "logit of {id}: {logit} vs reference {want}"
            );
            worst = worst.max((logit - want).abs());
        }
        eprintln!(
            "{}: {:?}: top-5 logits within {worst:.2e} of the reference",
            path.display(),
            case.prompt
        );

        let mut session =
            Session::new(model.clone(), 64, Precision::Exact, KvType::F32).expect("session");
        let eos = model.tokenizer.specials().eos.clone();
        let g = generate(
            &mut session,
            &ids,
            16,
            &SamplerConfig::default(),
            &eos,
            |_| true,
        )
        .expect("generate");
        assert_eq!(g.ids, case.greedy_ids, "greedy ids of {:?}", case.prompt);
    }
}

#[test]
fn gguf_matches_the_independent_reference() {
    check_fixture(&real_gguf());
}

#[test]
fn lsm_matches_the_independent_reference() {
    check_fixture(&real_lsm());
}

#[test]
fn engine_logits_match_our_reference_forward_pass() {
    for path in [real_gguf(), real_lsm()] {
        let model = Model::load(&path).expect("load");
        let mut reference = Reference::new(&model.weights);
        let mut session =
            Session::new(model.clone(), 32, Precision::Exact, KvType::F32).expect("session");
        let ids = model.tokenizer.encode(FIXTURE[0].prompt).expect("encode");
        for &t in &ids {
            let want = reference.forward(t);
            let got = session.forward(t).expect("forward");
            let max_diff = want
                .iter()
                .zip(got.iter())
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                max_diff < 5e-3,
                "{}: max |logit diff| {max_diff} at token {t}",
                path.display()
            );
        }
    }
}

#[test]
fn fast_precision_stays_close_to_exact() {
    let model = Model::load(&real_gguf()).expect("load");
    for case in &FIXTURE {
        let mut exact =
            Session::new(model.clone(), 32, Precision::Exact, KvType::F32).expect("session");
        let mut fast =
            Session::new(model.clone(), 32, Precision::Fast, KvType::F32).expect("session");
        let (last, rest) = case.prompt_ids.split_last().expect("non-empty");
        for &t in rest {
            exact.forward(t).expect("forward");
            fast.forward(t).expect("forward");
        }
        let want = top_n(exact.forward(*last).expect("forward"), 5);
        let got = fast.forward(*last).expect("forward");
        for (id, logit) in want {
            // 8-bit activations, as llama.cpp's Q8_1 path. Measured at most 0.47 here (1.7 % of
            // that logit) with the integer kernels that round as the scalar ones do, which every
            // table's eight-row kernels match bit for bit; the earlier AVX2 one-row kernels summed
            // in another order and measured 0.22. Which activation rounds which way moves single
            // logits by this much; the held-out perplexity below is the measure of the path.
            let diff = (got[id as usize] - logit).abs();
            assert!(diff < 0.6, "fast vs exact logit of top token {id}: {diff}");
        }
    }
    // Over the whole held-out text (four windows of 256 tokens). Which activation rounds which
    // way moves this measure by several tenths of a percent: with the same kernels, fast is
    // +0.71 % here (f32 KV cache) and +0.18 % with an f16 KV cache (`leanstream perplexity
    // --window 256`), while exact is 32.547 with either; a change in the last bit of the down
    // projection's sums moved it from +0.29 % to +0.71 %. Quantising every projection's input,
    // as llama.cpp does, costs +0.72 % on the first window. So the bound is 1 %: a wrong kernel
    // costs far more.
    let ppl = |precision| held_out_perplexity_all_windows(&real_gguf(), precision);
    let (exact, fast) = (ppl(Precision::Exact), ppl(Precision::Fast));
    assert!(
        ((fast - exact) / exact).abs() < 0.01,
        "perplexity exact {exact} vs fast {fast}"
    );
}

/// Perplexity of the whole held-out text, scored in consecutive 256-token windows, each from an
/// empty context (the first token of a window is not predicted).
fn held_out_perplexity_all_windows(path: &Path, precision: Precision) -> f64 {
    let model = Model::load(path).expect("load");
    let ids = model.tokenizer.encode(&heldout_text()).expect("encode");
    let mut session = Session::new(model.clone(), 256, precision, KvType::F32).expect("session");
    let (mut nll, mut n) = (0.0, 0);
    for window in ids.chunks(256).filter(|w| w.len() > 1) {
        session.reset();
        let (w_nll, w_n) = score(&mut session, window).expect("score");
        nll += w_nll;
        n += w_n;
    }
    (nll / n as f64).exp()
}

fn held_out_perplexity(path: &Path, precision: Precision) -> f64 {
    let model = Model::load(path).expect("load");
    let ids = model.tokenizer.encode(&heldout_text()).expect("encode");
    let mut session = Session::new(model.clone(), 256, precision, KvType::F32).expect("session");
    let (nll, n) = score(&mut session, &ids[..256]).expect("score");
    (nll / n as f64).exp()
}

#[test]
fn lsm_and_gguf_agree_on_held_out_perplexity() {
    let ppl = |path: &Path| held_out_perplexity(path, Precision::Exact);
    let (a, b) = (ppl(&real_gguf()), ppl(&real_lsm()));
    assert!(a > 1.0 && a < 100.0, "implausible perplexity {a}");
    assert!(
        ((a - b) / a).abs() < 0.005,
        "GGUF perplexity {a} vs .lsm {b}"
    );
}

#[test]
fn default_q8_0_down_columns_cost_at_most_one_and_a_half_percent_held_out_perplexity() {
    // Measured +0.98 % on these 256 tokens (37.06 → 37.42); f16 columns are within 0.5 %.
    let ppl = |path: &Path| held_out_perplexity(path, Precision::Exact);
    let (a, b) = (ppl(&real_gguf()), ppl(&common::real_lsm_default()));
    assert!(
        ((b - a) / a).abs() < 0.015,
        "GGUF perplexity {a} vs q8_0 .lsm {b}"
    );
}

#[test]
fn batched_prefill_matches_token_by_token() {
    let model = Model::load(&real_gguf()).expect("load");
    let ids = model.tokenizer.encode(&heldout_text()).expect("encode");
    // 45 tokens: a full batch of 32 and a partial one, after a 3-token head start so the batch
    // does not begin at position 0.
    let (head, prompt) = (&ids[..3], &ids[3..48]);
    for precision in [Precision::Exact, Precision::Fast] {
        let mut one = Session::new(model.clone(), 64, precision, KvType::F32).expect("session");
        let mut batched = Session::new(model.clone(), 64, precision, KvType::F32).expect("session");
        for &t in head {
            one.forward(t).expect("forward");
        }
        batched.forward_batch(head).expect("forward_batch");
        for &t in prompt {
            one.forward(t).expect("forward");
        }
        let want = one.forward(ids[48]).expect("forward").to_vec();
        batched.forward_batch(prompt).expect("forward_batch");
        assert_eq!(batched.position(), 48);
        let got = batched.forward(ids[48]).expect("forward");
        let max_diff = want
            .iter()
            .zip(got.iter())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            max_diff <= 1e-4,
            "{precision:?}: max |logit diff| {max_diff}"
        );
    }
}

#[test]
fn forward_batch_rejects_bad_input_before_any_work() {
    let model = Model::load(&real_gguf()).expect("load");
    let mut session =
        Session::new(model.clone(), 4, Precision::Exact, KvType::F32).expect("session");
    assert!(session.forward_batch(&[]).is_err());
    assert!(session.forward_batch(&[1, 2, 3, 4, 5]).is_err());
    assert!(session.forward_batch(&[1, u32::MAX]).is_err());
    assert_eq!(session.position(), 0);
    session.forward_batch(&[1, 2, 3, 4]).expect("fits exactly");
    assert_eq!(session.position(), 4);
}
