//! The GPU's forward pass ([`GpuModel`], [`GpuSession`]) against the CPU's, on any [`Device`]:
//! the bodies the kernels built for the host run in the test command
//! (`cuda-kernels/host/tests/forward.rs`) and the CUDA backend runs on a GPU
//! (`engine/tests/cuda_conformance.rs`, through `scripts/device-check`).
//!
//! Tiny models of every architecture flavour the engine reads (Llama, Qwen 2 with biases,
//! Qwen 3 with QK-norm, Gemma 3 with QK-norm, post-norms, GeGLU, scaled embeddings and sliding
//! windows) take a prompt longer than Gemma's window, then greedy decode steps. A GPU computes
//! what the CPU computes up to summation order, so the logits agree to f32 rounding and the
//! greedy tokens are the same. Then the same under memory plans that stream the layers and the
//! head through the weight stream, cut into pieces of a few rows.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::cpu::Precision;
use crate::backend::device::Device;
use crate::forward::{GpuModel, GpuSession, Model, Session};
use crate::kv::KvType;
use crate::model::gguf::{TinyArch, TinyLlama, TinyShape};
use crate::model::lsm;
use crate::plan::{Placement, Plan};
use crate::quant::DType;
use crate::sample::argmax;

/// A directory of its own under the system's temporary directory, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> ScratchDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("leanstream-gpu-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        ScratchDir(dir)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

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
fn check_gpu(dev: &Arc<dyn Device>, model: Arc<Model>, want: &[Vec<f32>], what: &str) {
    let dev = Arc::clone(dev);
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

fn same_as_cpu(dev: &Arc<dyn Device>, arch: TinyArch, dtype: DType) {
    let dir = ScratchDir::new();
    let path = dir.0.join("tiny.gguf");
    TinyLlama::with_arch(5, arch)
        .write_gguf(&path, dtype)
        .expect("write");
    let model = Model::load(&path).expect("load");
    let want = cpu_logits(&model);
    check_gpu(dev, model, &want, &format!("{arch:?} {dtype}"));
}

/// One weight type per flavour (each launch starts a block's worth of host threads, so the
/// models are few): a 32-value block type with an offset, f16, and 8-bit blocks.
pub fn gpu_pass_equals_cpu_on_every_architecture(dev: Arc<dyn Device>) {
    let types = [DType::Q4_1, DType::F16, DType::Q8_0, DType::Q8_0];
    for (arch, dtype) in TinyArch::ALL.into_iter().zip(types) {
        same_as_cpu(&dev, arch, dtype);
    }
}

/// Pieces of a few rows: every projection and the head are cut in several, so each piece's
/// rows land at their own outputs.
const PIECE_BYTES: usize = 8 << 10;

/// A model with Gemma-3-270M's layers (18 of d_model 640, heads of 256 values, one KV head, the
/// tiny vocabulary) and Gemma 3's features, in 8-bit blocks: the GPU pass equals the CPU's. Too
/// many launches for the kernels built for the host; the GPU check runs it.
pub fn gpu_pass_equals_cpu_on_a_gemma3_shaped_model(dev: Arc<dyn Device>) {
    let dir = ScratchDir::new();
    let path = dir.0.join("gemma3-270m-shaped.gguf");
    TinyLlama::with_shape(11, TinyArch::Gemma3, TinyShape::GEMMA3_270M)
        .write_gguf(&path, DType::Q8_0)
        .expect("write");
    let model = Model::load(&path).expect("load");
    let want = cpu_logits(&model);
    check_gpu(&dev, model, &want, "Gemma-3-270M-shaped");
}

/// Which memory plan [`gpu_pass_runs_a_memory_plan`] loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanShape {
    /// Every layer and all but the head's first rows streamed.
    EveryLayerStreamed,
    /// Some layers resident (uploaded), the others streamed (the planner keeps the head first).
    SomeLayersResident,
}

impl PlanShape {
    pub const ALL: [PlanShape; 2] = [PlanShape::EveryLayerStreamed, PlanShape::SomeLayersResident];

    fn accepts(self, p: &Plan, n_layers: usize) -> bool {
        let streamed = p
            .layers
            .iter()
            .filter(|l| **l == Placement::Streamed)
            .count();
        let head = p.head == Placement::Streamed && p.head_resident_rows > 0;
        match self {
            PlanShape::EveryLayerStreamed => head && streamed == n_layers,
            PlanShape::SomeLayersResident => (1..n_layers).contains(&streamed),
        }
    }
}

/// A Gemma-3-shaped model deep enough to plan (6 layers, f32, cut in pieces of a few rows)
/// under the smallest budget that gives `shape`: the streamed pieces go through the weight
/// stream (read in place where the device maps host memory, staged where it does not), and the
/// logits stay the whole model's.
pub fn gpu_pass_runs_a_memory_plan(dev: Arc<dyn Device>, shape: PlanShape) {
    let dir = ScratchDir::new();
    let path = dir.0.join("tiny.gguf");
    TinyLlama::with_layers(9, TinyArch::Gemma3, 6)
        .write_gguf(&path, DType::F32)
        .expect("write");
    let full = Model::load_in_pieces(&path, PIECE_BYTES).expect("load");
    let want = cpu_logits(&full);
    let n = full.weights.layers.len();
    let budget = super::budget_for(&full, CONTEXT, |p| shape.accepts(p, n));
    let planned =
        Model::load_within_in_pieces(&path, budget, CONTEXT, KvType::default(), PIECE_BYTES)
            .expect("plan");
    let plan = planned.plan().expect("a plan");
    assert!(shape.accepts(plan, n), "{shape:?}: the plan's shape");
    check_gpu(&dev, planned, &want, &format!("{shape:?}"));
}

/// Pieces of several 16-neuron chunks of the `.lsm` below (four, 64 neurons): a piece's chunks
/// lie one after another in its slot.
const LSM_PIECE_BYTES: usize = 40 << 10;

/// A Llama-flavoured model as a `.lsm` file (chunks of 16 neurons), every layer streamed: the
/// pieces are neuron bundles, which the gathered FFN kernels compute chunk by chunk where they
/// lie.
pub fn gpu_pass_runs_a_memory_plan_of_an_lsm(dev: Arc<dyn Device>) {
    let dir = ScratchDir::new();
    let (gguf, path) = (dir.0.join("tiny.gguf"), dir.0.join("tiny.lsm"));
    TinyLlama::with_layers(9, TinyArch::Llama, 6)
        .write_gguf(&gguf, DType::F32)
        .expect("write");
    let m = crate::model::load_imported(&gguf).expect("import");
    let opts = lsm::ConvertOptions {
        chunk_neurons: Some(16),
        ..Default::default()
    };
    lsm::convert(&m, &path, &opts, &mut |_, _| {}).expect("convert");
    let full = Model::load_in_pieces(&path, LSM_PIECE_BYTES).expect("load");
    let want = cpu_logits(&full);
    let n = full.weights.layers.len();
    let every = |p: &Plan| p.layers.iter().all(|l| *l == Placement::Streamed);
    let budget = super::budget_for(&full, CONTEXT, every);
    let planned =
        Model::load_within_in_pieces(&path, budget, CONTEXT, KvType::default(), LSM_PIECE_BYTES)
            .expect("plan");
    assert!(
        every(planned.plan().expect("a plan")),
        "every one of {n} layers streamed"
    );
    check_gpu(&dev, planned, &want, ".lsm, every layer streamed");
}
