//! Calibration on a tiny seeded model: windowed perplexity (batched attention, the FFN through an
//! executor) agrees with scoring token by token, calibration data
//! round-trips through the file, reordering keeps the model's function, and damaged or missing
//! calibration gives clear errors.

use std::path::{Path, PathBuf};

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::calibrate::{self, CalibrateOptions, perplexity};
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::score;
use leanstream_engine::kv::KvType;
use leanstream_engine::model::gguf::TinyArch;
use leanstream_engine::model::lsm::{LsmFile, PredictorKind};
use leanstream_engine::predict;
use leanstream_engine::testing;

const TEXT: &str = "the cat sat on the mat and the dog sat on the log. a bird sang in the tree \
    while the sun went down over the hill, and the cat and the dog went home to eat.";

fn tiny_lsm(dir: &Path) -> PathBuf {
    let out = dir.join("tiny.lsm");
    testing::tiny_lsm(5, &dir.join("tiny.gguf"), &out).expect("tiny .lsm");
    out
}

fn options(reorder: bool) -> CalibrateOptions {
    CalibrateOptions {
        window: 32,
        reorder,
        ..Default::default()
    }
}

fn dense_ppl(path: &Path, ids: &[u32]) -> f64 {
    let model = Model::load(path).expect("load");
    perplexity(&model, ids, 32, None, &mut |_, _| {})
        .expect("perplexity")
        .nll
}

#[test]
fn windowed_perplexity_agrees_with_token_by_token_scoring_for_every_architecture() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in TinyArch::ALL {
        let path = dir.path().join(format!("{arch:?}.lsm"));
        testing::tiny_lsm_of(arch, 6, &dir.path().join("src.gguf"), &path).expect("tiny .lsm");
        let model = Model::load(&path).expect("load");
        let ids = model.tokenizer.encode(TEXT).expect("encode");
        let ids = &ids[..ids.len().min(32)];
        let mut session =
            Session::new(model.clone(), 32, Precision::Exact, KvType::F32).expect("session");
        let (sum, n) = score(&mut session, ids).expect("score");
        let p = perplexity(&model, ids, 32, None, &mut |_, _| {}).expect("perplexity");
        let session_nll = sum / n as f64;
        assert!(
            (p.nll - session_nll).abs() < 1e-4 * session_nll.abs().max(1.0),
            "{arch:?}: windowed NLL {} vs session {session_nll}",
            p.nll
        );
    }
}

#[test]
fn windowed_perplexity_agrees_with_token_by_token_scoring() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny_lsm(dir.path());
    let model = Model::load(&path).expect("load");
    let ids = model.tokenizer.encode(TEXT).expect("encode");
    let ids = &ids[..ids.len().min(32)];
    let mut session =
        Session::new(model.clone(), 32, Precision::Exact, KvType::F32).expect("session");
    let (sum, n) = score(&mut session, ids).expect("score");
    let p = perplexity(&model, ids, 32, None, &mut |_, _| {}).expect("perplexity");
    assert_eq!(p.tokens, n);
    let session_nll = sum / n as f64;
    assert!(
        (p.nll - session_nll).abs() < 1e-4 * session_nll.abs().max(1.0),
        "windowed NLL {} vs session {session_nll}",
        p.nll
    );
    // Thresholds of zero change nothing; large ones zero everything and change the result.
    let zero = vec![0.0; 2];
    let same = perplexity(&model, ids, 32, Some(&zero), &mut |_, _| {}).expect("ppl");
    assert!((same.nll - p.nll).abs() < 1e-9);
    let big = vec![1e9; 2];
    let all = perplexity(&model, ids, 32, Some(&big), &mut |_, _| {}).expect("ppl");
    assert_eq!(all.sparsity, 1.0);
    assert!((all.nll - p.nll).abs() > 1e-6);
}

#[test]
fn calibration_round_trips_and_reordering_keeps_the_function() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = tiny_lsm(dir.path());
    let dst = dir.path().join("calibrated.lsm");
    let report = calibrate::calibrate(&src, &dst, TEXT, TEXT, &options(true), &mut |_, _, _| {})
        .expect("calibrate");
    assert_eq!(report.thresholds.len(), 2);

    let f = LsmFile::open(&dst).expect("open");
    f.verify_streamed(&dst).expect("fresh chunk checksums");
    let cal = f.calibration(&dst).expect("calibration");
    assert_eq!(cal.thresholds(), &report.thresholds[..]);
    assert!(cal.thresholds().iter().all(|&t| t > 0.0));
    let freq = cal.frequencies().expect("frequencies");
    assert_eq!(freq.len(), 2);
    for f in &freq {
        assert_eq!(f.len(), 128);
        // Reordered by frequency: stored order is hottest first.
        assert!(f.windows(2).all(|w| w[0] >= w[1]), "not sorted: {f:?}");
        let mean: f32 = f.iter().sum::<f32>() / 128.0;
        assert!(
            (mean - 0.6).abs() < 0.05,
            "active fraction {mean} at sparsity 0.4"
        );
    }
    let perm = &f.header.ffn.permutation;
    assert_eq!(perm.len(), 2);
    assert_ne!(
        perm[0],
        (0..128).collect::<Vec<u32>>(),
        "neurons were reordered"
    );

    for kind in PredictorKind::ALL {
        let p = predict::load(&cal, kind).expect("predictor");
        assert_eq!(p.kind(), kind);
        assert!(p.bytes() > 0);
        let meta = cal.predictor_meta(kind).expect("meta");
        assert_eq!(meta.cutoffs.len(), 2);
        let mut scratch = p.scratch();
        let mut out = vec![0f32; 128];
        p.score(1, &[0.5; 64], &mut scratch, &mut out);
        assert!(out.iter().all(|s| s.is_finite()));
    }
    // Same text, so recall at the calibrated cut-offs is the target recall (up to ties).
    let lowrank = &report.predictors[0];
    assert!(lowrank.heldout_recall >= 0.94, "{lowrank:?}");

    // Reordering permutes whole neurons: the model computes the same function.
    let model = Model::load(&src).expect("load");
    let ids = model.tokenizer.encode(TEXT).expect("encode");
    let (before, after) = (dense_ppl(&src, &ids), dense_ppl(&dst, &ids));
    assert!(
        (before - after).abs() < 1e-4,
        "NLL {before} vs reordered {after}"
    );

    // Calibrating the calibrated file again composes the permutations.
    let again = dir.path().join("again.lsm");
    calibrate::calibrate(&dst, &again, TEXT, TEXT, &options(true), &mut |_, _, _| {})
        .expect("recalibrate");
    let f2 = LsmFile::open(&again).expect("open");
    assert!(f2.calibration(&again).is_ok());
    assert!((dense_ppl(&again, &ids) - before).abs() < 1e-4);
}

#[test]
fn missing_or_damaged_calibration_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = tiny_lsm(dir.path());
    let err = LsmFile::open(&src)
        .expect("open")
        .calibration(&src)
        .expect_err("no calibration yet")
        .to_string();
    assert!(err.contains("leanstream calibrate"), "{err}");
    assert!(err.contains("tiny.lsm"), "{err}");

    let dst = dir.path().join("cal.lsm");
    calibrate::calibrate(&src, &dst, TEXT, TEXT, &options(false), &mut |_, _, _| {})
        .expect("calibrate");
    let bytes = std::fs::read(&dst).expect("read");
    let f = LsmFile::open(&dst).expect("open");
    let section = f
        .header
        .calibration
        .as_ref()
        .and_then(|c| c.section.clone())
        .expect("section");

    // One flipped byte inside the calibration section.
    let mut bad = bytes.clone();
    bad[section.offset as usize + 10] ^= 0x40;
    let path = dir.path().join("flipped.lsm");
    std::fs::write(&path, &bad).expect("write");
    let err = LsmFile::open(&path)
        .expect("the rest of the file is fine")
        .calibration(&path)
        .expect_err("corrupt section")
        .to_string();
    assert!(err.contains("calibration section checksum"), "{err}");

    // Truncated inside the calibration section.
    let path = dir.path().join("short.lsm");
    std::fs::write(&path, &bytes[..section.offset as usize + 8]).expect("write");
    let err = match LsmFile::open(&path) {
        Ok(f) => f.calibration(&path).expect_err("truncated").to_string(),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("truncated"), "{err}");

    // Bad options are refused before any work.
    let opts = CalibrateOptions {
        sparsity: 1.5,
        ..options(false)
    };
    let e = calibrate::calibrate(&src, &dst, TEXT, TEXT, &opts, &mut |_, _, _| {})
        .expect_err("sparsity 1.5");
    assert!(e.to_string().contains("sparsity"), "{e}");
}

#[test]
fn selection_probabilities_and_quality_costs_are_stored_and_follow_the_reordering() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = tiny_lsm(dir.path());
    let mut stored = Vec::new();
    for reorder in [false, true] {
        let dst = dir.path().join(format!("cal-{reorder}.lsm"));
        let report =
            calibrate::calibrate(&src, &dst, TEXT, TEXT, &options(reorder), &mut |_, _, _| {})
                .expect("calibrate");
        let f = LsmFile::open(&dst).expect("open");
        let cal = f.calibration(&dst).expect("calibration");
        for (j, kind) in PredictorKind::ALL.into_iter().enumerate() {
            let q: Vec<Vec<f32>> = (0..2)
                .map(|l| cal.selection_for(kind, l).expect("selection"))
                .collect();
            assert!(q.iter().flatten().all(|p| (0.0..=1.0).contains(p)), "{q:?}");
            // q_i and the fetch fraction count the same held-out scores: the mean of q over a
            // layer's neurons is the layer's fetch fraction, and over the layers the file's.
            let mean = q.iter().flatten().map(|&p| f64::from(p)).sum::<f64>() / 256.0;
            let fetch = f64::from(report.predictors[j].heldout_fetch_fraction);
            assert!(
                (mean - fetch).abs() < 1e-4,
                "{kind}: mean q {mean} vs fetch {fetch}"
            );
            let cost = cal.quality_cost_for(kind).expect("quality cost");
            assert_eq!(cost, report.quality_cost[j].1);
            assert_eq!(cost.len(), 2);
            assert!(
                cost.iter().all(|c| c.is_finite() && *c >= 0.0 && *c < 1.0),
                "{cost:?}"
            );
        }
        assert_eq!(
            cal.selection_probabilities().expect("default"),
            (0..2)
                .map(|l| cal.selection_for(PredictorKind::DEFAULT, l).expect("q"))
                .collect::<Vec<_>>()
        );
        assert!(cal.meta.quality_cost_source.starts_with("heldout"));
        stored.push((
            cal.selection_probabilities().expect("q"),
            cal.frequencies().expect("freq"),
            f.header.ffn.permutation.clone(),
        ));
    }
    // Reordering permutes q with the neurons: new neuron k of layer l is old neuron perm[l][k].
    let ((q, freq, _), (q2, freq2, perm)) = (&stored[0], &stored[1]);
    assert_eq!(perm.len(), 2);
    for l in 0..2 {
        assert_ne!(
            perm[l],
            (0..128).collect::<Vec<u32>>(),
            "a real permutation"
        );
        for (k, &old) in perm[l].iter().enumerate() {
            assert_eq!(freq2[l][k], freq[l][old as usize], "layer {l} neuron {k}");
            assert!(
                (q2[l][k] - q[l][old as usize]).abs() < 1e-6,
                "layer {l} neuron {k}: {} vs {}",
                q2[l][k],
                q[l][old as usize]
            );
        }
    }
}

#[test]
fn a_file_calibrated_before_selection_statistics_still_loads() {
    use leanstream_engine::model::lsm::{CalTensor, write_calibrated};
    let dir = tempfile::tempdir().expect("tempdir");
    let src = tiny_lsm(dir.path());
    let new = dir.path().join("new.lsm");
    calibrate::calibrate(&src, &new, TEXT, TEXT, &options(false), &mut |_, _, _| {})
        .expect("calibrate");
    // Rewrite it without the selection and quality-cost tensors, as older versions wrote it.
    let f = LsmFile::open(&new).expect("open");
    let cal = f.calibration(&new).expect("calibration");
    let tensors: Vec<CalTensor> = cal
        .meta
        .tensors
        .iter()
        .filter(|e| !e.name.starts_with("select.") && !e.name.starts_with("quality_cost"))
        .map(|e| CalTensor {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            layer: e.layer,
            neuron_major: e.neuron_major,
            bytes: cal
                .tensor(&e.name, e.dtype, &e.shape)
                .expect("tensor")
                .data
                .as_slice()
                .to_vec(),
        })
        .collect();
    let mut meta = cal.meta.clone();
    meta.quality_cost_source = String::new();
    let old = dir.path().join("old.lsm");
    write_calibrated(&f, &old, meta, tensors, None).expect("rewrite");

    let f = LsmFile::open(&old).expect("open");
    let cal = f.calibration(&old).expect("older calibration still loads");
    assert_eq!(cal.frequencies().expect("freq").len(), 2);
    for kind in PredictorKind::ALL {
        predict::load(&cal, kind).expect("predictor");
    }
    for err in [
        cal.selection(0).expect_err("no q").to_string(),
        cal.quality_cost().expect_err("no cost").to_string(),
    ] {
        assert!(err.contains("predates"), "{err}");
        assert!(err.contains("leanstream calibrate"), "{err}");
        assert!(err.contains("old.lsm"), "{err}");
    }
}
