//! The CUDA backend (feature `cuda`): every kernel through the conformance bodies the CPU
//! backend also runs (`backend/conformance.rs`); the GPU pass against the CPU's on tiny models
//! of every architecture and under memory plans that stream (`testing::gpu`, the bodies the
//! kernels built for the host also run); then the end-to-end oracles on the real model: greedy
//! ids of the GPU forward pass, dense and streaming, equal the CPU's.
//!
//! They need a GPU and its driver; without one every test prints that it is skipped and why,
//! and passes. Run them with `cargo test -p leanstream-engine --features cuda --test
//! cuda_conformance` (`cuda-kernels/gpu-check` does, on a GPU machine with Rust), or through
//! `scripts/device-check`, whose prebuilt binary runs the oracles on a generated model with
//! SmolLM2's shapes (`$LEANSTREAM_CUDA_ORACLE_LSM`) where the real file cannot travel.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::backend::cuda::CudaBackend;
use leanstream_engine::forward::{GpuModel, GpuSession, Session};
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, SparseModel};
use leanstream_engine::sample::argmax;

/// The backend, or `None` after printing why the test is skipped.
fn gpu(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("{test}: skipped, no usable GPU ({e})");
            None
        }
    }
}

mod kernels {
    leanstream_engine::conformance_tests!(super::gpu);
}

/// Tiny models of every architecture flavour (Gemma 3's QK-norm, post-norms, GeGLU, sliding
/// window and scaled embeddings among them), generated here: the GPU pass equals the CPU's.
#[test]
fn every_architecture_on_the_gpu_equals_the_cpu() {
    let Some(g) = gpu("architectures") else {
        return;
    };
    leanstream_engine::testing::gpu::gpu_pass_equals_cpu_on_every_architecture(Arc::new(g));
}

/// Gemma-3-270M's layer shapes (heads of 256 values, one KV head) with its features.
#[test]
fn a_gemma3_shaped_model_on_the_gpu_equals_the_cpu() {
    let Some(g) = gpu("Gemma-3-shaped") else {
        return;
    };
    leanstream_engine::testing::gpu::gpu_pass_equals_cpu_on_a_gemma3_shaped_model(Arc::new(g));
}

/// Memory plans that stream the layers and the head, on the GPU: the logits of the whole model.
#[test]
fn memory_plans_that_stream_run_on_the_gpu() {
    let Some(g) = gpu("memory plans") else { return };
    let g = Arc::new(g);
    for shape in leanstream_engine::testing::gpu::PlanShape::ALL {
        leanstream_engine::testing::gpu::gpu_pass_runs_a_memory_plan(g.clone(), shape);
    }
    leanstream_engine::testing::gpu::gpu_pass_runs_a_memory_plan_of_an_lsm(g);
}

/// The oracles' model: `$LEANSTREAM_CUDA_ORACLE_LSM`, else the real model as `.lsm`.
fn oracle_lsm() -> PathBuf {
    std::env::var_os("LEANSTREAM_CUDA_ORACLE_LSM")
        .map(PathBuf::from)
        .unwrap_or_else(common::real_lsm)
}

const PROMPT: &[u32] = common::FIXTURE[0].prompt_ids;
const STEPS: usize = 16;

/// Greedy ids after the fixture prompt with `step` running one token and returning its logits.
fn greedy(mut step: impl FnMut(u32) -> Vec<f32>) -> Vec<u32> {
    let mut logits = Vec::new();
    for &t in PROMPT {
        logits = step(t);
    }
    let mut ids = vec![argmax(&logits)];
    while ids.len() < STEPS {
        ids.push(argmax(&step(*ids.last().unwrap())));
    }
    ids
}

fn cpu_ids(sm: &SparseModel) -> Vec<u32> {
    let mut s = Session::new(Arc::clone(&sm.model), 128, Precision::Exact, KvType::F32).unwrap();
    greedy(|t| s.forward(t).unwrap().to_vec())
}

#[test]
fn dense_greedy_ids_on_the_real_model_equal_the_cpu() {
    let Some(g) = gpu("dense oracle") else { return };
    let sm = SparseModel::open(&oracle_lsm(), false).unwrap();
    let want = cpu_ids(&sm);
    let model = Arc::new(GpuModel::new(Arc::new(g), Arc::clone(&sm.model), true).unwrap());
    let mut s = GpuSession::new(Arc::clone(&model), 128).unwrap();
    let got = greedy(|t| s.forward(t).unwrap().to_vec());
    assert_eq!(got, want, "GPU vs CPU greedy ids");

    // The device-side argmax picks the same token as the host's over the same logits.
    let mut s = GpuSession::new(model, 128).unwrap();
    s.forward_batch(&PROMPT[..PROMPT.len() - 1]).unwrap();
    assert_eq!(s.forward_greedy(PROMPT[PROMPT.len() - 1]).unwrap(), want[0]);
}

#[test]
fn streaming_modes_on_the_gpu_equal_the_cpu_with_sparsity_off() {
    let Some(g) = gpu("streaming oracle") else {
        return;
    };
    let g = Arc::new(g);
    let sm = Arc::new(SparseModel::open(&oracle_lsm(), false).unwrap());
    let want = cpu_ids(&sm);
    let model = Arc::new(GpuModel::new(g.clone(), Arc::clone(&sm.model), false).unwrap());
    // A quarter of the FFN: chunks are evicted and read (and copied to the device) again.
    let budget = sm.layout.streamed_bytes() / 4;
    for mode in [Mode::OnDemand, Mode::Prefetch, Mode::LeanStream] {
        let opts = ExecutorOptions {
            mode,
            policy: None,
            cache_bytes: budget,
            io_threads: 2,
            io_gap_bytes: leanstream_engine::io::DEFAULT_MAX_GAP_BYTES,
            precision: Precision::Exact,
            predictor: None,
            verify_chunks: true,
        };
        let mut exec = Executor::new(&sm, opts).unwrap();
        exec.use_cuda(Arc::clone(&g)).unwrap();
        let mut s = GpuSession::new(Arc::clone(&model), 128).unwrap();
        let got = greedy(|t| s.forward_with(t, &mut exec).unwrap().to_vec());
        assert_eq!(got, want, "{mode} on the GPU vs dense on the CPU");
        let stats = exec.stats();
        assert!(stats.misses > 0, "{mode}: {stats:?}");
    }
}
