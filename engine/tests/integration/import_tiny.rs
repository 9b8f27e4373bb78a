//! The tiny seeded models import the same way from GGUF and from a safetensors directory.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use leanstream_engine::model::gguf::{GgufModel, permute_qk};
use leanstream_engine::model::gguf::{TinyArch, TinyLlama};
use leanstream_engine::model::{RopeStyle, TensorRef, Weights, safetensors};
use leanstream_engine::quant::{DType, dequantize_row};

fn values(t: &TensorRef) -> Vec<f32> {
    let cols = *t.shape.last().unwrap();
    let mut out = vec![0f32; t.shape.iter().product()];
    let rb = t.dtype.row_bytes(cols).unwrap();
    for (o, row) in out.chunks_mut(cols).zip(t.data.chunks(rb)) {
        dequantize_row(t.dtype, row, o);
    }
    out
}

#[test]
fn gguf_and_safetensors_hold_the_same_llama() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = TinyLlama::new(42);
    let gguf_path = dir.path().join("tiny.gguf");
    tiny.write_gguf(&gguf_path, DType::F32).unwrap();
    let hf_dir = dir.path().join("hf");
    safetensors::write_tiny_dir(&hf_dir, &tiny, DType::F32).unwrap();

    let g = GgufModel::read(&gguf_path).unwrap();
    let s = safetensors::import(&hf_dir).unwrap();
    assert_eq!(g.config.rope_style, RopeStyle::AdjacentPairs);
    assert_eq!(s.config.rope_style, RopeStyle::HalfSplit);
    assert_eq!(g.config, tiny.config);
    let mut sc = s.config.clone();
    sc.rope_style = RopeStyle::AdjacentPairs;
    assert_eq!(sc, g.config);
    assert_eq!(
        s.tensors.keys().collect::<Vec<_>>(),
        g.tensors.keys().collect::<Vec<_>>()
    );

    for (name, gt) in &g.tensors {
        let st = &s.tensors[name];
        assert_eq!((gt.dtype, &gt.shape), (st.dtype, &st.shape), "{name}");
        let sv = values(st);
        let want = if name.ends_with("attn_q.weight") {
            permute_qk(&sv, 4, 64)
        } else if name.ends_with("attn_k.weight") {
            permute_qk(&sv, 2, 64)
        } else {
            sv
        };
        assert_eq!(values(gt), want, "{name}");
        assert_eq!(
            values(st),
            tiny.tensors[name].1,
            "{name} round-trips exactly in f32"
        );
    }
    assert_eq!(
        s.chat_template.as_deref(),
        Some(tiny.chat_template.as_str())
    );
    let sp = s.tokenizer.specials();
    assert_eq!(
        (sp.bos, sp.eos.as_slice(), sp.add_bos),
        (Some(1), &[2][..], false)
    );
    assert_eq!(
        s.tokenizer.encode("<|im_start|> the").unwrap(),
        vec![1, 105]
    );
    Weights::from_imported(&s).unwrap();
}

#[test]
fn safetensors_reads_half_precision_and_qwen2_biases() {
    for dtype in [DType::F16, DType::Bf16] {
        let dir = tempfile::tempdir().unwrap();
        let tiny = TinyLlama::with_arch(5, TinyArch::Qwen2).with_tied_embeddings();
        safetensors::write_tiny_dir(dir.path(), &tiny, dtype).unwrap();
        let m = safetensors::import(dir.path()).unwrap();
        assert_eq!(m.config, tiny.config, "{dtype}");
        assert!(!m.tensors.contains_key("output.weight"));
        assert_eq!(m.tensors["blk.1.attn_v.bias"].dtype, dtype);
        let w = Weights::from_imported(&m).unwrap();
        assert_eq!(w.layers[1].bv.as_ref().map(Vec::len), Some(32));
    }
}
