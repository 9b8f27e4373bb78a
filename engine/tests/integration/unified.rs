//! One engine: a calibrated `.lsm` planned under a budget streams some FFN layers by neuron and
//! computes the others dense, and gives the same logits, bit for bit, as the sparse pipeline
//! over the fully loaded file with the same layers covered.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::kv::KvType;
use leanstream_engine::model::lsm::PredictorKind;
use leanstream_engine::model::lsm::synth::{SynthOptions, SynthShape, SynthTokenizer, synthesize};
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, SparseModel};
use leanstream_engine::plan::{DiskSpeeds, PlacementPolicy, PlanOptions};

pub(crate) const CONTEXT: usize = 64;
const PROMPT: [u32; 6] = [5, 17, 3, 99, 42, 7];

pub(crate) fn synth(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tiny.lsm");
    // Four layers, so that a plan with one dense layer still streams less than the model.
    let mut opts = SynthOptions::new(SynthShape {
        n_layers: 4,
        ..SynthShape::TINY
    });
    opts.sparsity = 0.8;
    opts.chunk_neurons = 1;
    synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |_, _| {}).unwrap();
    path
}

fn options(cache_bytes: usize) -> ExecutorOptions {
    ExecutorOptions {
        predictor: Some(PredictorKind::DEFAULT),
        ..leanstream_engine::testing::exact_options(Mode::LeanStream, cache_bytes)
    }
}

/// The logits of the prompt fed one token at a time, then of three greedy steps.
fn run(model: &Arc<Model>, exec: &mut Executor) -> Vec<Vec<f32>> {
    let mut s = Session::new(Arc::clone(model), CONTEXT, Precision::Exact, KvType::F32).unwrap();
    let mut out = Vec::new();
    for &t in &PROMPT {
        out.push(s.forward_with(t, exec).unwrap().to_vec());
    }
    for _ in 0..3 {
        let next = leanstream_engine::sample::argmax(out.last().unwrap());
        out.push(s.forward_with(next, exec).unwrap().to_vec());
    }
    out
}

/// Pieces small enough that a dense layer's ring fits beside the neuron cache in a budget
/// smaller than the tiny model.
const PIECES: usize = 64 << 10;

/// Plans `path` in less than its weights with a disk as fast for chunks as for large reads (so
/// every layer pays sparse), then marks the layers `dense` as not paying.
pub(crate) fn planned(path: &Path, dense: &[usize]) -> Arc<Model> {
    let full = Model::load(path).unwrap();
    let mut opts = PlanOptions::for_file(path, PlacementPolicy::Auto).unwrap();
    opts.piece_bytes = PIECES;
    let sparse = opts.sparse.as_mut().expect("a calibrated synthetic model");
    sparse.disk = DiskSpeeds {
        dense: 1e9,
        sparse: 1e9,
    };
    for &l in dense {
        sparse.chunk_probability[l].fill(1.0);
    }
    let floor = leanstream_engine::plan::Floor::of(&full, CONTEXT, KvType::default());
    // The smallest budget (in 256 KiB steps) that holds the plan.
    let mut budget = floor.total() + sparse.predictor_bytes + sparse.cache_floor_bytes;
    loop {
        match Model::load_within_options(path, budget, CONTEXT, KvType::default(), &opts) {
            Ok(m) => return m,
            Err(_) => budget += 256 << 10,
        }
        assert!(
            budget < floor.total() + (64 << 20),
            "no budget holds the plan"
        );
    }
}

#[test]
fn a_plan_with_layers_by_neuron_computes_what_the_sparse_pipeline_computes() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let n_layers = 4;
    for dense in [vec![], vec![1]] {
        let model = planned(&path, &dense);
        let plan = model.plan().unwrap().clone();
        let expected: Vec<bool> = (0..n_layers).map(|l| !dense.contains(&l)).collect();
        assert_eq!(plan.sparse_ffn, expected, "the plan follows the costs");
        assert!(plan.floor.cache > 0 && plan.planned_bytes() <= plan.budget);

        // A plain forward pass cannot run it: its sparse layers' weights were never read.
        let mut s =
            Session::new(Arc::clone(&model), CONTEXT, Precision::Exact, KvType::F32).unwrap();
        assert!(s.forward(1).is_err());

        let sm = SparseModel::over(Arc::clone(&model)).unwrap();
        let mut exec = Executor::new(&sm, options(plan.floor.cache as usize)).unwrap();
        exec.only_layers(&plan.sparse_ffn).unwrap();
        let got = run(&model, &mut exec);
        assert!(exec.stats().bytes_read > 0, "the sparse layers read chunks");

        let whole = SparseModel::over(Model::load_in_pieces(&path, PIECES).unwrap()).unwrap();
        let mut reference = Executor::new(&whole, options(plan.floor.cache as usize)).unwrap();
        reference.only_layers(&plan.sparse_ffn).unwrap();
        assert_eq!(
            got,
            run(&whole.model, &mut reference),
            "dense layers {dense:?}"
        );
    }
}

#[test]
fn a_prompt_through_the_plans_executor_runs_as_one_pass_with_the_logits_of_token_by_token() {
    use leanstream_engine::generate::Decode;
    use leanstream_engine::pipeline::{Policy, WithFfn};
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let model = planned(&path, &[1]);
    let leanstream = Policy::for_mode(Mode::LeanStream).unwrap();
    let session = || {
        let exec = Executor::for_plan(&model, leanstream, 2, Precision::Exact)
            .unwrap()
            .expect("the plan streams layers by neuron");
        let decoder =
            Session::new(Arc::clone(&model), CONTEXT, Precision::Exact, KvType::F32).unwrap();
        WithFfn {
            decoder: Box::new(decoder),
            exec,
        }
    };
    let mut one_by_one = session();
    let mut expected = Vec::new();
    for &t in &PROMPT {
        expected = one_by_one.forward(t).unwrap().to_vec();
    }
    let mut batched = session();
    let got = batched.forward_batch(&PROMPT).unwrap().to_vec();
    assert_eq!(got, expected);
    assert_eq!(batched.position(), PROMPT.len());
    // The next token goes on from the batched prompt as from the one-by-one one.
    let next = leanstream_engine::sample::argmax(&got);
    assert_eq!(
        batched.forward(next).unwrap().to_vec(),
        one_by_one.forward(next).unwrap().to_vec()
    );
}
