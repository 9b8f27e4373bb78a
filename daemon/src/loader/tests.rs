//! Loading models from generated files: the footprint reserved against what the loaded model
//! holds, `max_bytes` plans, and the settings a file cannot satisfy.
#![allow(clippy::unwrap_used)]

use leanstream_engine::forward::load_bytes_estimate;
use leanstream_engine::model::lsm::{ChunkLayout, LsmFile};

use super::*;
use crate::config::{Backend, Params};
use crate::models::ModelFile;
use crate::testing::Fixture;

/// Loads `file` the way the state owner does: footprint first, then the model.
fn load(file: &ModelFile, params: &Params) -> Result<(Footprint, LoadedModel), LoadError> {
    let fp = Footprint::of(file, params.model(&file.name))?.on_backend(params.backend);
    Ok((fp, LoadedModel::load(file, params, fp.cache_bytes)?))
}

fn failure(r: Result<(Footprint, LoadedModel), LoadError>) -> String {
    match r {
        Err(LoadError::Invalid(m)) => m,
        other => panic!("expected a load failure, got {other:?}"),
    }
}

#[test]
fn max_bytes_plans_a_dense_model_within_it_and_computes_the_same_tokens() {
    let fx = Fixture::new();
    let file = fx.deep_gguf("deep");
    let (full_fp, full) = load(&file, &fx.params("")).unwrap();
    let max = full_fp.resident_bytes / 2;
    let params = fx.params(&format!("[models.deep]\nmax_bytes = {max}\n"));
    let (fp, half) = load(&file, &params).unwrap();
    assert_eq!(fp.resident_bytes, max, "the reservation is max_bytes");
    assert!(half.model.bytes() <= max, "{} > {max}", half.model.bytes());
    let plan = half.model.plan().unwrap();
    assert!(plan.streams(), "half the model cannot be resident");
    let tokens = |m: &LoadedModel| {
        let mut s = m.open_session(8, Precision::Exact, KvType::F32).unwrap();
        (1..6u32)
            .map(|t| leanstream_engine::sample::argmax(s.forward(t).unwrap()))
            .collect::<Vec<_>>()
    };
    assert_eq!(tokens(&half), tokens(&full));
    let small = fx.params("[models.deep]\nmax_bytes = 4096\n");
    assert!(failure(load(&file, &small)).contains("max_bytes"));
}

#[test]
fn max_bytes_with_placement_auto_streams_sparse_layers_by_neuron_inside_it() {
    let fx = Fixture::new();
    let file = fx.synth_lsm("synth", 0.9);
    let (full_fp, _) = load(&file, &fx.params("")).unwrap();
    let max = full_fp.resident_bytes * 9 / 10;
    let run = |placement: &str| {
        let params = fx.params(&format!(
            "[models.synth]\nmax_bytes = {max}\nplacement = \"{placement}\"\n"
        ));
        let (fp, model) = load(&file, &params).unwrap();
        assert_eq!(fp.resident_bytes, max, "the reservation is max_bytes");
        let plan = model.model.plan().unwrap().clone();
        assert!(plan.planned_bytes() <= max, "{placement}: {plan:?}");
        let mut s = model
            .open_session(16, Precision::Exact, KvType::F32)
            .unwrap();
        let ids: Vec<u32> = (1..6u32)
            .map(|t| {
                let logits = match &model.ffn {
                    Some(exec) => s.forward_with(t, &mut *exec.lock().unwrap()),
                    None => s.forward(t),
                };
                leanstream_engine::sample::argmax(logits.unwrap())
            })
            .collect();
        (plan, model, ids)
    };
    let (dense_plan, dense, _) = run("dense");
    assert!(!dense_plan.is_sparse() && dense.ffn.is_none());
    let (plan, sparse, ids) = run("auto");
    assert!(
        plan.is_sparse(),
        "sparsity 0.9 pays by neuron: {:?}",
        plan.sparse_ffn
    );
    assert!(plan.read_bytes_per_token() < dense_plan.read_bytes_per_token());
    assert_eq!(ids.len(), 5);
    // The cache is the plan's, inside max_bytes: the arbiter neither sees nor resizes it.
    assert!(sparse.ffn.is_some());
    assert_eq!(sparse.cache_held(), None);
    assert!(sparse.resize_cache(0).is_none());
}

#[test]
fn a_streaming_mode_accounts_the_resident_part_and_its_cache() {
    let fx = Fixture::new();
    let file = fx.lsm("tiny", None);
    let header = LsmFile::open(&file.path).unwrap().header;
    let layout = ChunkLayout::from_header(&file.path, &header).unwrap();
    assert_eq!(layout.total_chunks(), 16);
    let params =
        fx.params("[models.tiny]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = 0.75\n");
    let (fp, model) = load(&file, &params).unwrap();
    // The streamed FFN section is not resident: it is read into the cache. The reservation
    // is the engine's bound of what the loaded model holds, and holds it.
    assert!(header.streamed.len > 0);
    let dense_bound = load_bytes_estimate(&file.path, false).unwrap();
    assert!(
        fp.resident_bytes <= dense_bound - header.streamed.len,
        "{fp:?}"
    );
    assert!(fp.resident_bytes >= model.model.bytes(), "{fp:?}");
    assert_eq!(fp.cache_floor_bytes, layout.floor_bytes() as u64);
    // 0.75 of 16 chunks, in whole chunks; the engine allocates exactly that.
    assert_eq!(fp.cache_bytes, 12 * layout.chunk_bytes as u64);
    let exec = model.ffn.as_ref().unwrap().lock().unwrap();
    assert_eq!(exec.cache_bytes() as u64, fp.cache_bytes);
    drop(exec);

    // Dense mode keeps the whole file (and its tokenizer) and has no pipeline.
    let (fp, model) = load(&file, &fx.params("")).unwrap();
    assert!(fp.resident_bytes >= file.bytes, "{fp:?}");
    assert!(fp.resident_bytes >= model.model.bytes(), "{fp:?}");
    assert_eq!(fp.cache_bytes, 0);
    assert!(model.ffn.is_none());

    // On the GPU the device copy of the resident weights counts too; the cache does not
    // change (on Jetson the GPU reads it in place).
    assert_eq!(fp.on_backend(Backend::Cpu), fp);
    let gpu = fp.on_backend(Backend::Cuda);
    assert_eq!(
        (gpu.resident_bytes, gpu.cache_bytes),
        (2 * fp.resident_bytes, fp.cache_bytes)
    );
}

#[test]
fn a_cache_smaller_than_one_layer_is_refused_with_the_bytes_needed() {
    let fx = Fixture::new();
    let file = fx.lsm("tiny", None);
    let header = LsmFile::open(&file.path).unwrap().header;
    let layout = ChunkLayout::from_header(&file.path, &header).unwrap();
    let one_layer = layout.chunks_per_layer * layout.chunk_bytes;
    // 0.25 of the model is half a layer.
    let params =
        fx.params("[models.tiny]\nmode = \"on-demand\"\nsparsity = 0\ncache_share = 0.25\n");
    let msg = failure(load(&file, &params));
    assert!(msg.contains(&one_layer.to_string()), "{msg}");
    assert!(msg.contains("models.tiny.cache_share"), "{msg}");
}

#[test]
fn a_streaming_mode_needs_a_calibrated_file_unless_sparsity_is_off() {
    let fx = Fixture::new();
    let file = fx.lsm("tiny", None);
    let msg = failure(load(&file, &fx.params("[engine]\nmode = \"leanstream\"\n")));
    assert!(msg.contains("leanstream calibrate"), "{msg}");
    assert!(msg.contains("engine.sparsity"), "{msg}");
    let off = fx.params("[models.tiny]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = 1.0\n");
    assert!(load(&file, &off).is_ok());
}

#[test]
fn a_sparsity_other_than_the_calibrated_target_is_refused() {
    let fx = Fixture::new();
    let file = fx.lsm("tiny", Some(0.4));
    let at = |s: &str| {
        fx.params(&format!(
            "[models.tiny]\nmode = \"leanstream\"\ncache_share = 1.0\n{s}"
        ))
    };
    let msg = failure(load(&file, &at("sparsity = 0.5\n")));
    assert!(msg.contains("leanstream calibrate --sparsity 0.5"), "{msg}");
    assert!(msg.contains("models.tiny.sparsity"), "{msg}");
    assert!(msg.contains("0.40"), "names the file's target: {msg}");
    // The file's own target, asked for or not, loads.
    assert!(load(&file, &at("sparsity = 0.4\n")).is_ok());
    assert!(load(&file, &at("")).is_ok());
}

#[test]
fn a_gguf_file_in_a_streaming_mode_asks_for_leanstream_convert() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let msg = failure(load(
        &file,
        &fx.params("[models.tiny]\nmode = \"prefetch\"\n"),
    ));
    assert!(msg.contains("leanstream convert"), "{msg}");
    assert!(msg.contains("models.tiny.mode"), "{msg}");
}
