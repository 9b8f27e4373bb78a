//! A loaded model owns its bytes: cutting its file to half and overwriting the rest with garbage
//! changes nothing the model computes (with a memory-mapped model this was a SIGBUS).

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, SparseModel};

const TOKENS: [u32; 6] = [1, 40, 41, 42, 100, 7];

fn logits(model: &Arc<Model>) -> Vec<Vec<f32>> {
    let mut s = Session::new(Arc::clone(model), 16, Precision::Exact, KvType::F32).unwrap();
    TOKENS
        .iter()
        .map(|&t| s.forward(t).unwrap().to_vec())
        .collect()
}

/// Cuts `path` to half its length and fills what is left with garbage.
fn vandalise(path: &Path) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let half = f.metadata().unwrap().len() / 2;
    f.set_len(half).unwrap();
    let garbage: Vec<u8> = (0..half).map(|i| (i * 131 % 256) as u8 ^ 0x5a).collect();
    f.write_all_at(&garbage, 0).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn a_loaded_model_computes_the_same_logits_after_its_file_is_cut_and_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    let lsm = dir.path().join("tiny.lsm");
    leanstream_engine::testing::tiny_lsm(21, &gguf, &lsm).unwrap();
    for path in [&gguf, &lsm] {
        let model = Model::load(path).unwrap();
        let before = logits(&model);
        vandalise(path);
        assert_eq!(logits(&model), before, "{}", path.display());
        assert!(
            Model::load(path).is_err(),
            "the vandalised file no longer loads"
        );
    }
}

#[test]
fn a_streaming_models_resident_weights_survive_the_file_being_overwritten() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let gguf = dir.path().join("tiny.gguf");
    let lsm = dir.path().join("tiny.lsm");
    leanstream_engine::testing::tiny_lsm(22, &gguf, &lsm).unwrap();
    let sm = SparseModel::open(&lsm, false).unwrap();
    assert!(!sm.file.is_mapped());
    let before = streamed_logits(&sm);
    // Garbage over everything before the streamed section: header and resident weights.
    let f = std::fs::OpenOptions::new().write(true).open(&lsm).unwrap();
    let first_chunk = sm.layout.file_offset(0);
    f.write_all_at(&vec![0xa5; first_chunk as usize], 0)
        .unwrap();
    f.sync_all().unwrap();
    let after = streamed_logits(&sm);
    let diff = before
        .iter()
        .zip(&after)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(diff < 1e-4, "logits differ by {diff}");
}

/// The last token's logits through a fresh `leanstream` pipeline (a cold cache).
fn streamed_logits(sm: &Arc<SparseModel>) -> Vec<f32> {
    let mut s = Session::new(Arc::clone(&sm.model), 16, Precision::Exact, KvType::F32).unwrap();
    let mut exec = executor(sm, Mode::LeanStream);
    let mut last = Vec::new();
    for &t in &TOKENS {
        last = s.forward_with(t, &mut exec).unwrap().to_vec();
    }
    last
}

#[test]
fn mmap_mode_needs_a_mapped_model_and_says_how_to_open_one() {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, lsm) = (dir.path().join("t.gguf"), dir.path().join("t.lsm"));
    leanstream_engine::testing::tiny_lsm(23, &gguf, &lsm).unwrap();
    let owned = SparseModel::open(&lsm, false).unwrap();
    let err = Executor::new(&owned, options(Mode::Mmap, 0)).unwrap_err();
    assert!(err.to_string().contains("open_for_mode"), "{err}");
    let mapped = SparseModel::open_for_mode(&lsm, Mode::Mmap, false).unwrap();
    assert!(mapped.file.is_mapped());
    Executor::new(&mapped, options(Mode::Mmap, 0)).unwrap();
}

fn options(mode: Mode, cache_bytes: usize) -> ExecutorOptions {
    ExecutorOptions {
        io_threads: 1,
        ..leanstream_engine::testing::exact_options(mode, cache_bytes)
    }
}

fn executor(sm: &Arc<SparseModel>, mode: Mode) -> Executor {
    Executor::new(sm, options(mode, sm.layout.streamed_bytes())).unwrap()
}
