//! Several conversations advanced by one pass through a streaming pipeline
//! ([`forward_each_with`]): each gets the same bits as in a pass of its own, and a chunk that
//! several rows need is read once and computed for each of them. A pass given up between layers
//! ([`forward_each_unless`]) advances nobody and leaves nothing behind that changes a bit.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::calibrate::{self, CalibrateOptions};
use leanstream_engine::forward::{Session, forward_each, forward_each_unless, forward_each_with};
use leanstream_engine::kv::KvType;
use leanstream_engine::model::lsm::PredictorKind;
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, PipelineStats, SparseModel};
use leanstream_engine::sample::argmax;
use leanstream_engine::testing;

const TEXT: &str = "the cat sat on the mat and the dog sat on the log. a bird sang in the tree \
    while the sun went down over the hill, and the cat and the dog went home to eat.";

/// Greedy steps after each prompt.
const STEPS: usize = 6;

/// A tiny model calibrated for high sparsity, so that rows select different chunks (about 60 %
/// of the neurons are computed).
fn calibrated_tiny(dir: &Path) -> PathBuf {
    let src = dir.join("tiny.lsm");
    testing::tiny_lsm(9, &dir.join("tiny.gguf"), &src).expect("tiny .lsm");
    let dst = dir.join("calibrated.lsm");
    let opts = CalibrateOptions {
        sparsity: 0.98,
        window: 32,
        reorder: true,
        ..Default::default()
    };
    calibrate::calibrate(&src, &dst, TEXT, TEXT, &opts, &mut |_, _, _| {}).expect("calibrate");
    dst
}

/// A pipeline with the low-rank predictor and a cache that holds the whole FFN (nothing is
/// evicted, so every read is a first read).
fn executor(sm: &Arc<SparseModel>, mode: Mode, precision: Precision) -> Executor {
    let opts = ExecutorOptions {
        precision,
        predictor: Some(PredictorKind::LowRank),
        ..testing::exact_options(mode, sm.layout.streamed_bytes())
    };
    Executor::new(sm, opts).expect("executor")
}

/// A session's greedy tokens, and its logits after its prompt and after each token but the last.
type Run = (Vec<u32>, Vec<Vec<f32>>);

/// Each session's [`Run`] of [`STEPS`] + 1 tokens: prompts in one pass, then every session's
/// decode step in one pass per step.
fn run_together(
    sm: &SparseModel,
    exec: &mut Executor,
    prompts: &[&[u32]],
    precision: Precision,
) -> Vec<Run> {
    run_interrupted(sm, Some(exec), prompts, precision, None)
}

/// [`run_together`], dense when `exec` is `None`; with `stop_at` = `Some(l)`, each pass is
/// first started and given up before layer `l` (checking that it reports so and advances no
/// session), then run whole.
fn run_interrupted(
    sm: &SparseModel,
    mut exec: Option<&mut Executor>,
    prompts: &[&[u32]],
    precision: Precision,
    stop_at: Option<usize>,
) -> Vec<Run> {
    let mut sessions: Vec<Session> = prompts
        .iter()
        .map(|_| Session::new(Arc::clone(&sm.model), 64, precision, KvType::F32).expect("session"))
        .collect();
    let mut runs = vec![(Vec::new(), Vec::new()); prompts.len()];
    let mut pieces: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    for _ in 0..=STEPS {
        let mut all: Vec<&mut Session> = sessions.iter_mut().collect();
        let refs: Vec<&[u32]> = pieces.iter().map(Vec::as_slice).collect();
        let positions: Vec<usize> = all.iter().map(|s| s.position()).collect();
        if let Some(l) = stop_at {
            let asked = AtomicUsize::new(0);
            let stop = || asked.fetch_add(1, Ordering::Relaxed) == l;
            let exec = exec.as_deref_mut().map(|e| e as _);
            let ran = forward_each_unless(&mut all, &refs, exec, &stop).expect("stopped pass");
            assert!(!ran, "the pass ran to the end");
            assert_eq!(asked.load(Ordering::Relaxed), l + 1, "asked once per layer");
            let now: Vec<usize> = all.iter().map(|s| s.position()).collect();
            assert_eq!(now, positions, "a stopped pass advanced a session");
        }
        match exec.as_deref_mut() {
            Some(exec) => forward_each_with(&mut all, &refs, exec),
            None => forward_each(&mut all, &refs),
        }
        .expect("pass");
        for ((s, run), piece) in sessions.iter_mut().zip(&mut runs).zip(&mut pieces) {
            let logits = s.logits().to_vec();
            let next = argmax(&logits);
            run.0.push(next);
            run.1.push(logits);
            *piece = vec![next];
        }
    }
    runs
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn sessions_in_one_streaming_pass_get_what_each_gets_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = calibrated_tiny(dir.path());
    let sm = SparseModel::open(&path, true).expect("open");
    let ids = sm.model.tokenizer.encode(TEXT).expect("encode");
    let prompts: [&[u32]; 3] = [&ids[..9], &ids[20..23], &ids[40..53]];
    let layout = &sm.layout;
    let all_neurons = (layout.n_layers * layout.n_ff) as u64;
    for mode in [Mode::OnDemand, Mode::LeanStream] {
        for precision in [Precision::Exact, Precision::Fast] {
            let mut exec = executor(&sm, mode, precision);
            let together = run_together(&sm, &mut exec, &prompts, precision);
            let stats = exec.stats();
            // The predictor selects: rows computed fewer chunks than the whole FFN.
            assert!(
                stats.computed_neurons < stats.tokens * all_neurons,
                "{mode} {precision:?}: nothing was left out: {stats:?}"
            );
            for (i, prompt) in prompts.iter().enumerate() {
                let mut exec = executor(&sm, mode, precision);
                let alone = run_together(&sm, &mut exec, &[prompt], precision);
                // The same bits: chunks are summed in fixed blocks, whatever the reads' timing.
                assert!(
                    together[i] == alone[0],
                    "{mode} {precision:?}: prompt {i}: tokens {:?} alone {:?}, logits differ by \
                     {}",
                    together[i].0,
                    alone[0].0,
                    together[i]
                        .1
                        .iter()
                        .zip(&alone[0].1)
                        .map(|(a, b)| max_diff(a, b))
                        .fold(0.0, f32::max)
                );
            }
        }
    }
}

#[test]
fn a_chunk_that_several_rows_need_is_read_once_and_computed_for_each() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = calibrated_tiny(dir.path());
    let sm = SparseModel::open(&path, true).expect("open");
    let ids = sm.model.tokenizer.encode(TEXT).expect("encode");
    let prompt = &ids[..12];
    // On-demand reads only what the exact selection asks for, so reads depend on inputs alone.
    // Bridged holes do not: which queued reads merge depends on when the I/O engine takes them,
    // so reads bridge nothing here and the bytes read are the chunks read.
    let stats_of = |prompts: &[&[u32]]| -> (PipelineStats, Vec<Run>) {
        let opts = ExecutorOptions {
            io_gap_bytes: 0,
            precision: Precision::Exact,
            predictor: Some(PredictorKind::LowRank),
            ..testing::exact_options(Mode::OnDemand, sm.layout.streamed_bytes())
        };
        let mut exec = Executor::new(&sm, opts).expect("executor");
        let runs = run_together(&sm, &mut exec, prompts, Precision::Exact);
        (exec.stats(), runs)
    };
    let (one, alone) = stats_of(&[prompt]);
    let (two, twins) = stats_of(&[prompt, prompt]);
    assert!(one.misses > 0 && one.bytes_read > 0, "{one:?}");
    assert_eq!(two.misses, one.misses, "{two:?} vs {one:?}");
    assert_eq!(two.bytes_read, one.bytes_read);
    assert_eq!(two.chunks_needed, one.chunks_needed);
    assert_eq!(two.tokens, 2 * one.tokens);
    assert_eq!(two.computed_neurons, 2 * one.computed_neurons);
    // Twins in one pass see the same numbers as each other.
    assert_eq!(twins[0], twins[1]);
    assert_eq!(twins[0].0, alone[0].0);
}

#[test]
fn a_pass_given_up_between_layers_changes_nothing_that_the_pass_run_again_computes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = calibrated_tiny(dir.path());
    let sm = SparseModel::open(&path, true).expect("open");
    let ids = sm.model.tokenizer.encode(TEXT).expect("encode");
    let prompts: [&[u32]; 2] = [&ids[..9], &ids[20..27]];
    let n_layers = sm.layout.n_layers;
    for precision in [Precision::Exact, Precision::Fast] {
        let dense = run_interrupted(&sm, None, &prompts, precision, None);
        for l in [1, n_layers - 1] {
            let stopped = run_interrupted(&sm, None, &prompts, precision, Some(l));
            assert!(
                stopped == dense,
                "dense, {precision:?}, stopped before layer {l}"
            );
        }
        for mode in [Mode::OnDemand, Mode::LeanStream] {
            let mut exec = executor(&sm, mode, precision);
            let whole = run_together(&sm, &mut exec, &prompts, precision);
            let mut exec = executor(&sm, mode, precision);
            let stopped = run_interrupted(&sm, Some(&mut exec), &prompts, precision, Some(1));
            assert!(
                stopped == whole,
                "{mode}, {precision:?}: tokens {:?} vs {:?}",
                stopped[0].0,
                whole[0].0
            );
        }
    }
}
