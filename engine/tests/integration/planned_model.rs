//! A model loaded under a memory budget computes exactly what the fully loaded model computes,
//! whatever the plan streams (layers, the output head, the embedding rows), reads per token
//! what its plan predicts, and reports a file that went bad instead of computing garbage.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{MAX_BATCH, Model, Session};
use leanstream_engine::kv::KvType;
use leanstream_engine::model::gguf::{TinyArch, TinyLlama};
use leanstream_engine::model::lsm;
use leanstream_engine::plan::{Floor, PIECE_BYTES, Part, Placement, Plan, pieces};
use leanstream_engine::quant::DType;
use leanstream_engine::testing::budget_for;

/// Room for a prompt longer than one batch.
const CONTEXT: usize = 2 * MAX_BATCH;
const TOKENS: [u32; 5] = [1, 40, 41, 100, 7];

/// A tiny model deep enough that three layers (the ring) are much less than the model: 12
/// layers, f32 weights, as a GGUF and as a `.lsm` converted from it.
fn tiny(seed: u64, dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (gguf, out) = (dir.join("tiny.gguf"), dir.join("tiny.lsm"));
    TinyLlama::with_layers(seed, TinyArch::Llama, 12)
        .write_gguf(&gguf, DType::F32)
        .unwrap();
    let m = leanstream_engine::model::load_imported(&gguf).unwrap();
    let opts = lsm::ConvertOptions {
        chunk_neurons: Some(16),
        ..Default::default()
    };
    lsm::convert(&m, &out, &opts, &mut |_, _| {}).unwrap();
    (gguf, out)
}

fn session(model: &Arc<Model>) -> Session {
    Session::new(Arc::clone(model), CONTEXT, Precision::Exact, KvType::F32).unwrap()
}

/// Logits of every token fed one at a time, then of a prompt longer than one batch.
fn logits(model: &Arc<Model>) -> (Vec<Vec<f32>>, Vec<f32>) {
    let mut s = session(model);
    let one: Vec<Vec<f32>> = TOKENS
        .iter()
        .map(|&t| s.forward(t).unwrap().to_vec())
        .collect();
    let long: Vec<u32> = (0..MAX_BATCH as u32 + 3)
        .map(|i| (i * 7 + 3) % 128)
        .collect();
    let mut s = session(model);
    (one, s.forward_batch(&long).unwrap().to_vec())
}

/// A predicate on the placement a plan chose.
type Shape<'a> = Box<dyn Fn(&Plan) -> bool + 'a>;

/// Pieces small enough that the tiny models' larger matrices are cut in several.
const SMALL_PIECES: usize = 24 << 10;

fn check_file(path: &Path, piece_bytes: usize) {
    let full = Model::load_in_pieces(path, piece_bytes).unwrap();
    if piece_bytes == SMALL_PIECES {
        let layer = &full.weights.layers[0];
        assert!(
            pieces(layer, piece_bytes).len() > Part::of(layer).len() + 2,
            "small pieces cut the tiny model's matrices"
        );
    }
    let expected = logits(&full);
    let streamed = |p: &Plan| {
        p.layers
            .iter()
            .filter(|l| **l == Placement::Streamed)
            .count()
    };
    let n_layers = full.weights.layers.len();
    let head_rows = full.weights.output.rows;
    let shapes: [(&str, Shape<'_>); 4] = [
        (
            "everything streams",
            Box::new(|p| {
                p.head == Placement::Streamed
                    && p.head_resident_rows == 0
                    && streamed(p) == n_layers
            }),
        ),
        (
            "the head's first rows resident, the rest and every layer streamed",
            Box::new(|p| {
                p.head == Placement::Streamed
                    && (1..head_rows).contains(&p.head_resident_rows)
                    && streamed(p) == n_layers
            }),
        ),
        (
            "head and some layers resident",
            Box::new(|p| p.head == Placement::Resident && (1..n_layers).contains(&streamed(p))),
        ),
        ("everything resident", Box::new(|p| !p.streams())),
    ];
    for (what, shape) in shapes {
        let budget = budget_for(&full, CONTEXT, &shape);
        let planned =
            Model::load_within_in_pieces(path, budget, CONTEXT, KvType::default(), piece_bytes)
                .unwrap();
        let plan = planned.plan().unwrap().clone();
        assert!(
            shape(&plan),
            "{what}: the loaded plan has the scanned shape"
        );
        assert!(
            plan.planned_bytes() <= budget,
            "{what}: planned {} > budget {budget}",
            plan.planned_bytes()
        );
        assert_eq!(logits(&planned), expected, "{}: {what}", path.display());

        // One token reads exactly the plan's units, and its embedding row when that streams.
        let before = planned.stream_counters().unwrap();
        session(&planned).forward(5).unwrap();
        let after = planned.stream_counters().unwrap();
        assert_eq!(
            after.bytes_read - before.bytes_read,
            plan.unit_bytes_per_token(),
            "{what}"
        );
        let row = after.row_bytes_read - before.row_bytes_read;
        match plan.embeddings {
            Placement::Streamed => assert!(
                row > 0 && row <= plan.streamed_bytes_per_token() - plan.unit_bytes_per_token(),
                "{what}: {row} row bytes"
            ),
            Placement::Resident => assert_eq!(row, 0, "{what}"),
        }
    }
}

#[test]
fn a_planned_gguf_computes_the_loaded_models_logits_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    check_file(&tiny(3, dir.path()).0, PIECE_BYTES);
}

#[test]
fn a_planned_lsm_computes_the_loaded_models_logits_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    check_file(&tiny(4, dir.path()).1, PIECE_BYTES);
}

#[test]
fn a_gguf_in_small_pieces_computes_the_same_logits_resident_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = tiny(6, dir.path()).0;
    check_file(&gguf, SMALL_PIECES);
    // Rows computed in pieces are the rows computed whole.
    let (whole, cut) = (
        Model::load(&gguf).unwrap(),
        Model::load_in_pieces(&gguf, SMALL_PIECES).unwrap(),
    );
    assert_eq!(logits(&cut), logits(&whole));
}

#[test]
fn an_lsm_in_small_pieces_computes_the_same_logits_resident_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let lsm = tiny(7, dir.path()).1;
    check_file(&lsm, SMALL_PIECES);
    // The down sums of a `.lsm` layer add up piece by piece: close to the whole layer's, not equal.
    let (whole, cut) = (
        Model::load(&lsm).unwrap(),
        Model::load_in_pieces(&lsm, SMALL_PIECES).unwrap(),
    );
    let (a, b) = (logits(&whole).1, logits(&cut).1);
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-3, "{worst}");
}

#[test]
fn a_prompt_of_two_batches_with_a_streamed_head_realigns_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, _) = tiny(5, dir.path());
    let full = Model::load(&gguf).unwrap();
    let budget = budget_for(&full, CONTEXT, |p| p.head == Placement::Streamed);
    let planned = Model::load_within(&gguf, budget, CONTEXT, KvType::default()).unwrap();
    let long: Vec<u32> = (0..MAX_BATCH as u32 + 1).collect();
    let want = session(&full).forward_batch(&long).unwrap().to_vec();
    assert_eq!(session(&planned).forward_batch(&long).unwrap(), &want[..]);
    // The reader ran ahead into the head after the first batch; the second batch needed layer
    // 0 again, so at least one unit came back unused.
    assert!(planned.stream_counters().unwrap().wasted_units >= 1);
}

#[test]
fn a_budget_under_the_floor_is_refused_with_the_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, _) = tiny(6, dir.path());
    let err = Model::load_within(&gguf, 1 << 20, CONTEXT, KvType::default()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("runtime") && msg.contains("ring"), "{msg}");
}

#[test]
fn a_streamed_file_cut_short_fails_the_forward_pass_instead_of_computing() {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, _) = tiny(7, dir.path());
    let full = Model::load(&gguf).unwrap();
    let budget = budget_for(&full, CONTEXT, |p| p.head == Placement::Streamed);
    let planned = Model::load_within(&gguf, budget, CONTEXT, KvType::default()).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&gguf).unwrap();
    f.set_len(4096).unwrap();
    drop(f);
    let mut s = session(&planned);
    let mut failed = false;
    // The reader may have filled the ring before the cut; within a few tokens it reads again.
    for t in 0..8 {
        if s.forward(t).is_err() {
            failed = true;
            break;
        }
    }
    assert!(failed, "reads past the new end of the file must fail");
}

#[test]
fn every_budget_from_the_floor_up_plans_within_itself_and_reads_less_as_it_grows() {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, _) = tiny(8, dir.path());
    let full = Model::load(&gguf).unwrap();
    let floor = Floor::of(&full, CONTEXT, KvType::default());
    let dense = full.weights.dense_bytes_per_token() as u64;
    let mut last_read = u64::MAX;
    let mut shapes = std::collections::BTreeSet::new();
    let mut b = floor.total();
    while b < floor.total() + dense + (1 << 20) {
        if let Ok(p) = Plan::new(&full.weights, b, floor) {
            assert!(p.planned_bytes() <= b, "{b}: planned {}", p.planned_bytes());
            assert!(
                p.units.iter().all(|u| u.bytes() <= p.slot_bytes),
                "{b}: a unit is wider than the ring's slots"
            );
            let read = p.streamed_bytes_per_token();
            assert!(
                read <= last_read,
                "{b}: reads {read} > {last_read} at a smaller budget"
            );
            last_read = read;
            shapes.insert((p.head == Placement::Resident, p.head_resident_rows > 0));
        }
        b += 4096;
    }
    assert_eq!(last_read, 0, "the largest budget keeps everything");
    assert_eq!(
        shapes.len(),
        3,
        "head streamed, partly resident and resident: {shapes:?}"
    );
}
