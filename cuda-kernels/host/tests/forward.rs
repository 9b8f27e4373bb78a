//! The GPU's forward pass (`forward/gpu.rs`: [`GpuModel`], [`GpuSession`]) run on the kernels
//! built for the host, against the CPU's forward pass on the same file: tiny models of every
//! architecture flavour the engine reads (Llama, Qwen 2 with biases, Qwen 3 with QK-norm, Gemma 3
//! with QK-norm, post-norms, GeGLU, scaled embeddings and sliding windows), a prompt longer than
//! Gemma's window, then greedy decode steps. What a GPU would compute differs from the CPU only
//! in summation order, so the logits agree to f32 rounding and the greedy tokens are the same.
//! Then the same under memory plans that stream layers and the head through the weight stream.

use std::sync::Arc;

use leanstream_cuda_host::HostKernels;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::backend::device::Device;
use leanstream_engine::forward::{GpuModel, GpuSession, Model, Session};
use leanstream_engine::kv::KvType;
use leanstream_engine::model::gguf::{TinyArch, TinyLlama};
use leanstream_engine::plan::{Floor, Placement, Plan};
use leanstream_engine::quant::DType;
use leanstream_engine::sample::argmax;

/// Longer than Gemma's 4-position window, so its local layers drop positions.
const PROMPT: [u32; 6] = [1, 40, 41, 100, 7, 99];
const STEPS: usize = 3;

/// The largest difference over the largest value: f32 summation order moves it by ~1e-6.
fn error(got: &[f32], want: &[f32]) -> f32 {
    let diff = got.iter().zip(want).map(|(g, w)| (g - w).abs());
    let scale = want.iter().fold(0f32, |m, w| m.max(w.abs())).max(1e-6);
    diff.fold(0f32, f32::max) / scale
}

/// Logits after the prompt and after each greedy step, with `step` running one token.
fn run(mut step: impl FnMut(u32) -> Vec<f32>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let mut logits = Vec::new();
    for &t in prompt {
        logits = step(t);
    }
    out.push(logits);
    for _ in 0..STEPS {
        let next = argmax(out.last().expect("logits"));
        out.push(step(next));
    }
    out
}

const CONTEXT: usize = 64;

/// The CPU's logits for `model` (loaded whole).
fn cpu_logits(model: &Arc<Model>) -> Vec<Vec<f32>> {
    let mut cpu =
        Session::new(Arc::clone(model), CONTEXT, Precision::Exact, KvType::F32).expect("cpu");
    run(|t| cpu.forward(t).expect("cpu step").to_vec(), &PROMPT)
}

/// The GPU pass's logits for `model` (whole or planned) on the host kernels, checked against
/// `want`.
fn check_gpu(model: Arc<Model>, want: &[Vec<f32>], what: &str) {
    let dev: Arc<dyn Device> = Arc::new(HostKernels);
    let gpu_model = Arc::new(GpuModel::new(dev, model, true).expect("upload"));
    let mut gpu = GpuSession::new(gpu_model, CONTEXT).expect("gpu session");
    let got = run(|t| gpu.forward(t).expect("gpu step").to_vec(), &PROMPT);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = error(g, w);
        assert!(e < 1e-4, "{what}: logits of step {i} differ by {e}");
        assert_eq!(argmax(g), argmax(w), "{what}: greedy token of step {i}");
    }
    assert!(
        gpu.position() == PROMPT.len() + STEPS,
        "{what}: positions held"
    );
}

fn same_as_cpu(arch: TinyArch, dtype: DType) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyLlama::with_arch(5, arch)
        .write_gguf(&path, dtype)
        .expect("write");
    let model = Model::load(&path).expect("load");
    let want = cpu_logits(&model);
    check_gpu(model, &want, &format!("{arch:?} {dtype}"));
}

/// One weight type per flavour (each launch starts a block's worth of host threads, so the
/// models are few): a 32-value block type with an offset, f16, and 8-bit blocks.
#[test]
fn the_gpu_pass_on_the_host_kernels_equals_the_cpu_pass_on_every_architecture() {
    let types = [DType::Q4_1, DType::F16, DType::Q8_0, DType::Q8_0];
    for (arch, dtype) in TinyArch::ALL.into_iter().zip(types) {
        same_as_cpu(arch, dtype);
    }
}

/// Pieces of a few rows: every projection and the head are cut in several, so each piece's
/// rows land at their own outputs.
const PIECE_BYTES: usize = 8 << 10;

/// The smallest budget whose plan `wanted` accepts, scanning up from the floor in pages.
fn budget_for(model: &Model, wanted: impl Fn(&Plan) -> bool) -> u64 {
    let floor = Floor::of(model, CONTEXT, KvType::default());
    let mut b = floor.total();
    loop {
        if let Ok(p) = Plan::in_pieces(&model.weights, b, floor, model.piece_bytes)
            && wanted(&p)
        {
            return b;
        }
        b += 4096;
        assert!(b < floor.total() + (64 << 20), "no budget gives that plan");
    }
}

/// A Gemma-3-shaped model deep enough to plan (6 layers, f32) under budgets that stream the
/// layers and part of the head, and some of the layers: the pieces go through the weight
/// stream and the session's staging buffer, and the logits stay the whole model's.
#[test]
fn the_gpu_pass_runs_memory_plans_that_stream_layers_and_the_head() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyLlama::with_layers(9, TinyArch::Gemma3, 6)
        .write_gguf(&path, DType::F32)
        .expect("write");
    let full = Model::load_in_pieces(&path, PIECE_BYTES).expect("load");
    let want = cpu_logits(&full);
    let streamed = |p: &Plan| {
        p.layers
            .iter()
            .filter(|l| **l == Placement::Streamed)
            .count()
    };
    let n = full.weights.layers.len();
    let shapes: [(&str, Box<dyn Fn(&Plan) -> bool>); 2] = [
        (
            "the head's first rows resident, the rest and every layer streamed",
            Box::new(|p| {
                p.head == Placement::Streamed && p.head_resident_rows > 0 && streamed(p) == n
            }),
        ),
        (
            "some layers resident",
            Box::new(|p| (1..n).contains(&streamed(p))),
        ),
    ];
    for (what, shape) in shapes {
        eprintln!("{what}");
        let budget = budget_for(&full, &shape);
        let planned =
            Model::load_within_in_pieces(&path, budget, CONTEXT, KvType::default(), PIECE_BYTES)
                .expect("plan");
        assert!(
            shape(planned.plan().expect("a plan")),
            "{what}: the plan's shape"
        );
        check_gpu(planned, &want, what);
    }
}
