#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;

use super::*;
use crate::backend::cpu::Precision;
use crate::forward::Session;
use crate::model::lsm::LsmFile;
use crate::pipeline::{Executor, ExecutorOptions, Mode, SparseModel};
use crate::predict;
use crate::sample::argmax;

fn tiny(dir: &Path, seed: u64) -> (std::path::PathBuf, SynthReport) {
    let path = dir.join(format!("tiny-{seed}.lsm"));
    let mut opts = SynthOptions::new(SynthShape::TINY);
    opts.seed = seed;
    let mut calls = 0;
    let report = synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |done, total| {
        assert!(done <= total, "{done} > {total}");
        calls += 1;
    })
    .unwrap();
    assert!(
        calls > SynthShape::TINY.n_layers,
        "progress per tensor and layer"
    );
    (path, report)
}

#[test]
fn the_tiny_shape_loads_checks_out_and_is_seed_determined() {
    let dir = tempfile::tempdir().unwrap();
    let (path, report) = tiny(dir.path(), 3);
    let f = LsmFile::open(&path).unwrap();
    f.verify_streamed(&path).unwrap();
    assert_eq!(f.header.config, SynthShape::TINY.config());
    assert_eq!(report.file_bytes, std::fs::metadata(&path).unwrap().len());
    assert_eq!(report.tokenizer_vocab, 128);
    let cal = f.calibration(&path).unwrap();
    let freq = cal.frequencies().unwrap();
    let mean = |f: &[f32]| f.iter().sum::<f32>() / f.len() as f32;
    let (n, f) = (freq[0].len(), &freq[0]);
    assert!((mean(f) - 0.6).abs() < 0.08, "mean activity {}", mean(f));
    let (hot, cold) = (mean(&f[..n / 8]), mean(&f[n - n / 8..]));
    assert!(hot > 0.9 && cold < 0.15, "hot first, skewed: {hot} {cold}");
    predict::load(&cal, PredictorKind::LowRank).unwrap();
    assert!(
        report.sim_recall > 0.9 && report.sim_fetch_fraction < 0.95,
        "{report:?}"
    );

    let again = tiny(dir.path(), 3).0;
    let other = tiny(dir.path(), 4).0;
    let bytes = |p: &Path| std::fs::read(p).unwrap();
    assert!(bytes(&path) == bytes(&again), "same seed, same file");
    assert!(bytes(&path) != bytes(&other), "another seed, another file");
}

#[test]
fn every_down_type_makes_one_neuron_bundles_of_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let d = SynthShape::TINY.d_model;
    for down in [DType::Q8_0, DType::Q5_0, DType::Q4_0, DType::F16] {
        let path = dir.path().join(format!("tiny-{down}.lsm"));
        let mut opts = SynthOptions::new(SynthShape::TINY);
        opts.chunk_neurons = 1;
        opts.down_dtype = down;
        synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |_, _| {}).unwrap();
        let f = LsmFile::open(&path).unwrap();
        f.verify_streamed(&path).unwrap();
        let ffn = &f.header.ffn;
        let rows = 2 * opts.weight_dtype.row_bytes(d).unwrap();
        assert_eq!(ffn.down_dtype, down);
        assert_eq!(ffn.chunk_neurons, 1);
        assert_eq!(
            ffn.bundle_bytes,
            rows + down.row_bytes(d).unwrap(),
            "{down}"
        );
    }
}

#[test]
fn planted_down_values_survive_both_block_layouts_and_keep_their_size() {
    let dir = tempfile::tempdir().unwrap();
    let (d, n_ff) = (SynthShape::TINY.d_model, SynthShape::TINY.n_ff);
    for down in [DType::Q8_0, DType::Q5_0, DType::Q4_0] {
        let path = dir.path().join(format!("tiny-{down}.lsm"));
        let mut opts = SynthOptions::new(SynthShape::TINY);
        opts.chunk_neurons = 1;
        opts.down_dtype = down;
        synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |_, _| {}).unwrap();
        let f = LsmFile::open(&path).unwrap();
        let w = f.weights(&path, f.tokenizer().unwrap()).unwrap();
        for layer in &w.layers {
            let crate::model::Down::Neurons(cols) = &layer.ffn.down else {
                panic!("a .lsm stores down columns");
            };
            // Transposed: the GGUF layout, `d` rows of `n_ff` values.
            let mut col = vec![0f32; d];
            let mut rows = vec![0f32; d * n_ff];
            for i in 0..n_ff {
                cols.dequantize_row(i, &mut col);
                for (j, v) in col.iter().enumerate() {
                    rows[j * n_ff + i] = *v;
                }
            }
            // Each row, quantised along the neuron axis, comes back exactly.
            let (mut bytes, mut back) = (Vec::new(), vec![0f32; n_ff]);
            for row in rows.chunks_exact(n_ff) {
                bytes.clear();
                crate::quant::quantize_row(down, row, &mut bytes);
                crate::quant::dequantize_row(down, &bytes, &mut back);
                assert!(row == back.as_slice(), "{down}: a row does not survive");
            }
            // The planted RMS: FFN_OUT over sqrt(active neurons · 9), as before the grid.
            let rms = (rows.iter().map(|v| v * v).sum::<f32>() / rows.len() as f32).sqrt();
            let want = 0.02 / ((1.0 - opts.sparsity) * n_ff as f32 * 9.0).sqrt();
            assert!(
                (rms / want - 1.0).abs() < 0.1,
                "{down}: down RMS {rms}, planted {want}"
            );
        }
    }
    // The grid's step puts the RMS between a quarter and a half of the extreme code.
    for rms in [1e-6f32, 3e-4, 0.7] {
        let s = weights::down_step(rms, 16.0);
        assert_eq!(s.log2().fract(), 0.0, "{s} is a power of two");
        assert!(rms / s > 4.0 && rms / s <= 8.0, "{rms} / {s}");
    }
}

#[test]
fn the_planted_predictor_and_sparsity_hold_in_the_real_forward_pass() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = tiny(dir.path(), 1);
    let sm = SparseModel::open(&path, true).unwrap();
    let tok = &sm.model.tokenizer;
    let ids = tok
        .encode("the robot arm paused above the belt, waiting for the camera to report")
        .unwrap();

    // Realised sparsity of the thresholds over a dense pass.
    let ppl =
        crate::calibrate::perplexity(&sm.model, &ids, 64, Some(&sm.thresholds), &mut |_, _| {})
            .unwrap();
    assert!(
        (ppl.sparsity - 0.4).abs() < 0.1,
        "sparsity {}",
        ppl.sparsity
    );

    // The pipeline with the planted predictor: recall near the target, not every neuron
    // computed, and greedy decoding walks through more than one token.
    let mut exec = Executor::new(
        &sm,
        ExecutorOptions {
            mode: Mode::LeanStream,
            policy: None,
            cache_bytes: sm.layout.streamed_bytes() / 2,
            io_threads: 2,
            io_gap_bytes: crate::io::DEFAULT_MAX_GAP_BYTES,
            precision: Precision::Exact,
            predictor: Some(PredictorKind::LowRank),
            verify_chunks: true,
        },
    )
    .unwrap();
    exec.measure_recall(true);
    let mut s = Session::new(
        Arc::clone(&sm.model),
        64,
        Precision::Exact,
        crate::kv::KvType::F32,
    )
    .unwrap();
    let mut next = 0;
    for &t in &ids {
        next = argmax(s.forward_with(t, &mut exec).unwrap());
    }
    let mut generated = vec![next];
    for _ in 0..8 {
        next = argmax(s.forward_with(next, &mut exec).unwrap());
        generated.push(next);
    }
    let st = exec.stats();
    let recall = st.recall();
    let computed = st.computed_neurons as f64 / (st.tokens as f64 * 2.0 * 512.0);
    eprintln!(
        "tiny: sparsity {:.3} recall {recall:.3} computed {computed:.3}",
        ppl.sparsity
    );
    assert!(recall > 0.85, "recall {recall}");
    assert!(computed < 0.95, "computed share {computed}");
    assert!(st.misses > 0 && st.bytes_read > 0, "{st:?}");
    generated.sort_unstable();
    generated.dedup();
    assert!(generated.len() > 1, "greedy decoding is stuck on one token");
}

#[test]
fn bad_options_are_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.lsm");
    let mut opts = SynthOptions::new(SynthShape::TINY);
    opts.sparsity = 1.0;
    let err = synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("sparsity"), "{err}");
    let mut opts = SynthOptions::new(SynthShape::LLAMA_7B);
    opts.rank = 1;
    assert!(synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |_, _| {}).is_err());
    // The tiny vocabulary is too small for the 7B shape.
    let opts = SynthOptions::new(SynthShape::LLAMA_7B);
    let err = synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("32000"), "{err}");
    assert!(!path.exists() && !dir.path().join("x.lsm.partial").exists());
}
