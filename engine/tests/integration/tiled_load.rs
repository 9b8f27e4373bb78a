//! A model loaded for the fast path (`Model::load_for`), its matrices stored as tiles where this
//! CPU's kernels read them, computes the bits the same model loaded as rows computes: in both
//! precisions, for a prompt run as one batch and for decode steps, on tiny models of every type
//! that tiles (each architecture flavour) and on the real SmolLM2 file (Q4_1, its head a tied
//! Q8_0 embedding table).

use std::path::Path;
use std::sync::Arc;

use crate::common::real_gguf;
use leanstream_engine::backend::cpu::{Kernels, Precision};
use leanstream_engine::backend::select::Backend;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::kv::KvType;
use leanstream_engine::model::gguf::{TinyArch, TinyLlama};
use leanstream_engine::quant::{DType, tiles};

const PROMPT: [u32; 9] = [1, 40, 41, 42, 100, 7, 7, 99, 3];

/// The prompt's last logits, then those of four decode steps, in `precision`.
fn logits(model: &Arc<Model>, precision: Precision) -> Vec<Vec<u32>> {
    let mut s = Session::new(model.clone(), 32, precision, KvType::F16).expect("session");
    let mut out = vec![s.forward_batch(&PROMPT).expect("prompt").to_vec()];
    for t in [5, 64, 2, 9] {
        out.push(s.forward(t).expect("step").to_vec());
    }
    out.iter()
        .map(|l| l.iter().map(|v| v.to_bits()))
        .map(Iterator::collect)
        .collect()
}

fn same_bits_as_rows(path: &Path, dtype: DType, what: &str) {
    let rows = Model::load(path).expect("load as rows");
    let tiled =
        Model::load_for(path, Precision::Fast, Backend::Cpu).expect("load for the fast path");
    // The GPU reads rows: a load for it makes no tiles.
    let for_gpu = Model::load_for(path, Precision::Fast, Backend::Cuda).expect("load for the GPU");
    assert_eq!(
        for_gpu.weights.layers[0].wq.tiled_rows(),
        0,
        "{what}: tiles for the GPU"
    );
    // The check below must be able to fail: where the kernels read tiles, the load made some.
    let made = tiled.weights.layers[0].wq.tiled_rows() > 0;
    assert_eq!(
        made,
        Kernels::best().reads_tiles(dtype),
        "{what}: tiles made"
    );
    assert!(rows.weights.layers[0].wq.tiled_rows() == 0);
    for precision in [Precision::Fast, Precision::Exact] {
        assert!(
            logits(&rows, precision) == logits(&tiled, precision),
            "{what} {precision:?}: tiled and row logits differ"
        );
    }
}

#[test]
fn tiny_models_of_every_tiling_type_give_the_bits_of_their_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    for dtype in DType::ALL.into_iter().filter(|&d| tiles::tiles(d)) {
        for arch in TinyArch::ALL {
            let path = dir.path().join(format!("{arch:?}-{dtype}.gguf"));
            TinyLlama::with_arch(17, arch)
                .write_gguf(&path, dtype)
                .expect("write");
            same_bits_as_rows(&path, dtype, &format!("{arch:?} {dtype}"));
        }
    }
}

#[test]
fn smollm2_loaded_as_tiles_gives_the_bits_of_its_rows() {
    same_bits_as_rows(&real_gguf(), DType::Q4_1, "SmolLM2 Q4_1");
}
