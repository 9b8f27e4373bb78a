//! Shared helpers for integration tests on the real SmolLM2 model.
#![allow(dead_code)]

use std::path::PathBuf;

/// The real test model. CI fetches it with `scripts/fetch-model`; a missing file fails loudly.
pub fn real_gguf() -> PathBuf {
    leanstream_engine::testing::real_model()
}

/// The real model converted to `.lsm` with f16 down columns, so that the tests can hold it to
/// the GGUF's fixtures ([`leanstream_engine::testing::real_lsm`]).
pub fn real_lsm() -> PathBuf {
    leanstream_engine::testing::real_lsm(leanstream_engine::quant::DType::F16)
}

/// The real model converted to `.lsm` with every default (q8_0 down columns).
pub fn real_lsm_default() -> PathBuf {
    leanstream_engine::testing::real_lsm(
        leanstream_engine::model::lsm::ConvertOptions::default().down_dtype,
    )
}

/// One case of the independent reference (a numpy f32 implementation; values inlined below).
pub struct FixtureCase {
    pub prompt: &'static str,
    pub prompt_ids: &'static [u32],
    pub greedy_ids: &'static [u32],
    pub top5: [(u32, f32); 5],
}

pub const FIXTURE: [FixtureCase; 2] = [
    FixtureCase {
        prompt: "Once upon a time, there was a little",
        prompt_ids: &[6403, 1980, 253, 655, 28, 665, 436, 253, 1838],
        greedy_ids: &[
            8180, 3365, 20391, 617, 5732, 288, 1238, 281, 260, 2388, 30, 2306, 736, 1129, 685, 288,
        ],
        top5: [
            (8180, 17.550_9),
            (3102, 17.057_7),
            (6560, 15.064_3),
            (5432, 14.987_7),
            (7706, 14.951_7),
        ],
    },
    FixtureCase {
        prompt: "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        prompt_ids: &[
            1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
        ],
        greedy_ids: &[504, 3575, 282, 4649, 314, 7042, 30, 2],
        top5: [
            (504, 27.858_8),
            (60, 26.129_5),
            (38634, 26.101_5),
            (15319, 25.962_3),
            (7026, 25.181_4),
        ],
    },
];

/// The `n` largest logits as `(id, logit)`, largest first.
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    idx.into_iter()
        .take(n)
        .map(|i| (i, logits[i as usize]))
        .collect()
}

/// The held-out evaluation text shipped with the repository.
pub fn heldout_text() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/text/heldout-eval.txt"
    ))
    .expect("data/text/heldout-eval.txt")
}
