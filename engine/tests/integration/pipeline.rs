//! The sparse pipelines on the real model: with sparsity off every mode equals the dense forward
//! pass; bad budgets, uncalibrated files and failing reads give clear errors, and a failed read
//! ends only the token that needed it.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::Session;
use leanstream_engine::io::{DirectFile, Fault, FaultKind, FaultyReader, ThreadPoolIo};
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::{
    Executor, ExecutorOptions, Mode, Policy, Selector, SparseModel, StreamingFfn,
};
use leanstream_engine::sample::argmax;

const PROMPT: &[u32] = common::FIXTURE[0].prompt_ids;

/// Greedy ids and the first step's logits of the dense path.
fn dense_run(sm: &SparseModel, steps: usize) -> (Vec<u32>, Vec<f32>) {
    let mut s = Session::new(Arc::clone(&sm.model), 64, Precision::Exact, KvType::F32).unwrap();
    let first = s.forward_batch(PROMPT).unwrap().to_vec();
    let mut ids = vec![argmax(&first)];
    for _ in 1..steps {
        let next = argmax(s.forward(*ids.last().unwrap()).unwrap());
        ids.push(next);
    }
    (ids, first)
}

fn sparse_run(sm: &SparseModel, exec: &mut Executor, steps: usize) -> (Vec<u32>, Vec<f32>) {
    let mut s = Session::new(Arc::clone(&sm.model), 64, Precision::Exact, KvType::F32).unwrap();
    let mut first = Vec::new();
    for &t in PROMPT {
        first = s.forward_with(t, exec).unwrap().to_vec();
    }
    let mut ids = vec![argmax(&first)];
    for _ in 1..steps {
        let next = argmax(s.forward_with(*ids.last().unwrap(), exec).unwrap());
        ids.push(next);
    }
    (ids, first)
}

fn options(mode: Mode, cache_bytes: usize) -> ExecutorOptions {
    leanstream_engine::testing::exact_options(mode, cache_bytes)
}

#[test]
fn every_mode_with_sparsity_off_equals_the_dense_forward_pass() {
    let sm = SparseModel::open(&common::real_lsm(), false).unwrap();
    let (dense_ids, dense_logits) = dense_run(&sm, 8);
    // A quarter of the FFN: chunks are evicted and read again on every token.
    let budget = sm.layout.streamed_bytes() / 4;
    for mode in [Mode::Mmap, Mode::OnDemand, Mode::Prefetch, Mode::LeanStream] {
        let sm = SparseModel::open_for_mode(&common::real_lsm(), mode, false).unwrap();
        let mut exec = Executor::new(&sm, options(mode, budget)).unwrap();
        let (ids, logits) = sparse_run(&sm, &mut exec, 8);
        let diff = dense_logits
            .iter()
            .zip(&logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(diff < 2e-3, "{mode}: logits differ by {diff}");
        assert_eq!(ids, dense_ids, "{mode}: greedy ids");
        let stats = exec.stats();
        if mode.uses_cache() {
            assert!(
                stats.misses > 0 && stats.bytes_read > 0,
                "{mode}: {stats:?}"
            );
            assert_eq!(stats.hits + stats.misses, stats.chunks_needed, "{mode}");
        }
    }
}

#[test]
fn a_cache_smaller_than_one_layer_is_refused_with_the_size_needed() {
    let sm = SparseModel::open(&common::real_lsm(), false).unwrap();
    let one_layer = sm.layout.chunks_per_layer * sm.layout.chunk_bytes;
    let err = Executor::new(&sm, options(Mode::LeanStream, one_layer / 2)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&one_layer.to_string()), "{msg}");
}

#[test]
fn an_uncalibrated_file_asks_for_leanstream_calibrate() {
    let err = SparseModel::open(&common::real_lsm(), true).unwrap_err();
    assert!(err.to_string().contains("leanstream calibrate"), "{err}");
}

#[test]
fn a_failing_read_ends_that_token_with_an_error_and_the_pipeline_goes_on() {
    let sm = SparseModel::open(&common::real_lsm(), false).unwrap();
    let (dense_ids, _) = dense_run(&sm, 3);
    let file = DirectFile::open(&sm.path).unwrap();
    // Every read fails for a while (longer than the retries), then the disk recovers.
    let fault = Fault::every(1, FaultKind::Error(std::io::ErrorKind::Other)).times(40);
    let faulty = FaultyReader::new(Arc::new(file), vec![fault]);
    let io = ThreadPoolIo::new(Arc::new(faulty), 1, Default::default()).unwrap();
    let policy = Policy::for_mode(Mode::OnDemand).unwrap();
    let selector = Selector::new(sm.scorer(None).unwrap(), sm.layout.n_ff);
    let budget = sm.layout.streamed_bytes();
    let ffn = StreamingFfn::new(
        Arc::clone(&sm),
        selector,
        policy,
        budget,
        Box::new(io),
        Precision::Exact,
    )
    .unwrap();
    let mut exec = Executor::Streaming(Box::new(ffn));
    let mut s = Session::new(Arc::clone(&sm.model), 64, Precision::Exact, KvType::F32).unwrap();
    let err = s.forward_with(PROMPT[0], &mut exec).unwrap_err();
    assert!(err.to_string().contains("chunk"), "{err}");
    // The same pipeline serves a fresh session once reads succeed again.
    let mut errors = 1;
    let ids = loop {
        let mut s = Session::new(Arc::clone(&sm.model), 64, Precision::Exact, KvType::F32).unwrap();
        let run = (|| {
            let mut last = Vec::new();
            for &t in PROMPT {
                last = s.forward_with(t, &mut exec)?.to_vec();
            }
            let mut ids = vec![argmax(&last)];
            for _ in 1..3 {
                ids.push(argmax(s.forward_with(*ids.last().unwrap(), &mut exec)?));
            }
            Ok::<_, leanstream_engine::Error>(ids)
        })();
        match run {
            Ok(ids) => break ids,
            Err(_) if errors < 20 => errors += 1,
            Err(e) => panic!("reads never recovered: {e}"),
        }
    };
    assert_eq!(ids, dense_ids);
}

#[test]
fn every_named_sparse_policy_parses_and_the_ladder_ends_at_leanstream() {
    assert_eq!(Policy::names().len(), 7);
    for name in Policy::names() {
        assert!(Policy::named(name).is_ok(), "{name}");
    }
    assert_eq!(
        Policy::named("leanstream"),
        Ok(Policy::for_mode(Mode::LeanStream).unwrap())
    );
    assert_eq!(
        Policy::named("serial"),
        Ok(Policy::for_mode(Mode::OnDemand).unwrap())
    );
    let ladder = Policy::ablation();
    // Each step changes the one before it.
    assert!(ladder.windows(2).all(|w| w[0].1 != w[1].1));
    let e = Policy::named("fast").unwrap_err();
    assert!(e.contains("refined-retention"), "{e}");
}
