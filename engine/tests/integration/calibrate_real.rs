//! Calibration of the real SmolLM2-135M `.lsm` on a few hundred tokens: the data reads back,
//! predictors beat chance, a file without calibration names the fix, and the reordered file
//! generates the same greedy tokens as the original with the dense path.

use crate::common::real_lsm;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::calibrate::{self, CALIBRATION_TEXT, CalibrateOptions, HELDOUT_TEXT};
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::generate;
use leanstream_engine::kv::KvType;
use leanstream_engine::model::lsm::{LsmFile, PredictorKind};
use leanstream_engine::predict;
use leanstream_engine::sample::SamplerConfig;

fn greedy(path: &std::path::Path, prompt: &str, n: usize) -> Vec<u32> {
    let model = Model::load(path).expect("load");
    let ids = model.tokenizer.encode(prompt).expect("encode");
    let mut s = Session::new(model.clone(), 128, Precision::Exact, KvType::F32).expect("session");
    generate(&mut s, &ids, n, &SamplerConfig::default(), &[], |_| true)
        .expect("generate")
        .ids
}

#[test]
fn calibrate_the_real_model() {
    let src = real_lsm();
    let err = LsmFile::open(&src)
        .expect("open")
        .calibration(&src)
        .expect_err("converted files are not calibrated")
        .to_string();
    assert!(err.contains("run `leanstream calibrate"), "{err}");

    let dir = tempfile::tempdir().expect("tempdir");
    let dst = dir.path().join("calibrated.lsm");
    let opts = CalibrateOptions {
        max_tokens: 384,
        eval_tokens: 192,
        window: 192,
        reorder: true,
        ..Default::default()
    };
    let report = calibrate::calibrate(
        &src,
        &dst,
        CALIBRATION_TEXT,
        HELDOUT_TEXT,
        &opts,
        &mut |_, _, _| {},
    )
    .expect("calibrate");
    eprintln!("{report:#?}");

    // Thresholding 40 % of the activations costs little perplexity.
    let change = report.thresholded.ppl() / report.dense.ppl() - 1.0;
    assert!((0.0..0.05).contains(&change), "perplexity change {change}");
    assert!((report.thresholded.sparsity - 0.4).abs() < 0.05);

    let f = LsmFile::open(&dst).expect("open calibrated");
    let cal = f.calibration(&dst).expect("calibration");
    assert_eq!(cal.thresholds().len(), 30);
    assert_eq!(cal.frequencies().expect("frequencies").len(), 30);
    for kind in PredictorKind::ALL {
        let meta = cal.predictor_meta(kind).expect("meta");
        let p = predict::load(&cal, kind).expect("predictor");
        assert_eq!(p.bytes(), meta.bytes);
        // Measured on held-out text (deterministic; measured 0.93 / 0.90 for low-rank and
        // 0.88 / 0.82 for hashing): recall near the 0.95 target, while fetching clearly fewer
        // neurons than a random pick with the same recall would (a fraction equal to the recall).
        assert!(meta.heldout_recall > 0.85, "{meta:?}");
        assert!(
            meta.heldout_fetch_fraction < meta.heldout_recall - 0.02,
            "{meta:?}"
        );
        // Per-neuron selection probabilities average to the fetch fraction; per-layer quality
        // costs (relative error of the sparse FFN output) are small but not zero.
        let q = (0..30)
            .map(|l| cal.selection_for(kind, l).expect("selection"))
            .collect::<Vec<_>>();
        let mean = q.iter().flatten().map(|&p| f64::from(p)).sum::<f64>() / (30.0 * 1536.0);
        assert!(
            (mean - f64::from(meta.heldout_fetch_fraction)).abs() < 1e-4,
            "{mean} vs {meta:?}"
        );
        let cost = cal.quality_cost_for(kind).expect("quality cost");
        eprintln!("{kind}: quality cost per layer {cost:?}");
        assert!(cost.iter().all(|c| (0.0..0.5).contains(c)), "{cost:?}");
    }

    // The reordered file is the same model: same greedy tokens on the dense path.
    let prompt = "<|im_start|>user\nHow do I repot a plant?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(greedy(&src, prompt, 12), greedy(&dst, prompt, 12));
}
