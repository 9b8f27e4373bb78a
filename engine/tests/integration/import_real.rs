//! The real SmolLM2-135M-Instruct GGUF (`docs/models.md`) imports with the expected numbers.
//!
//! The file comes from `scripts/fetch-model` (CI always runs it); `LEANSTREAM_TEST_MODEL`
//! overrides the default `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::PathBuf;

use leanstream_engine::model::gguf::TinyLlama;
use leanstream_engine::model::gguf::{GgufFile, GgufModel};
use leanstream_engine::model::{RopeStyle, Weights};
use leanstream_engine::quant::DType;
use leanstream_engine::tokenizer::Tokenizer;

fn model_path() -> PathBuf {
    leanstream_engine::testing::real_model()
}

#[test]
fn smollm2_config_tensors_and_vocab() {
    let path = model_path();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), 272);
    let m = GgufModel::from_file(&f).unwrap();
    let c = &m.config;
    assert_eq!(
        (
            c.n_layers,
            c.d_model,
            c.n_ff,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.vocab_size
        ),
        (30, 576, 1536, 9, 3, 64, 49152)
    );
    assert_eq!(c.rope_base, 100000.0);
    assert_eq!(c.rope_style, RopeStyle::AdjacentPairs);
    assert!(c.tied_embeddings);
    assert_eq!(c.context_length, 8192);
    assert!((c.rms_eps - 1e-5).abs() < 1e-9, "{}", c.rms_eps);

    let t = |n: &str| (m.tensors[n].dtype, m.tensors[n].shape.clone());
    assert_eq!(t("token_embd.weight"), (DType::Q8_0, vec![49152, 576]));
    assert_eq!(t("output_norm.weight"), (DType::F32, vec![576]));
    assert!(!m.tensors.contains_key("output.weight"));
    for l in [0, 29] {
        let n = |s: &str| format!("blk.{l}.{s}");
        assert_eq!(t(&n("attn_q.weight")), (DType::Q4_1, vec![576, 576]));
        assert_eq!(t(&n("attn_k.weight")), (DType::Q4_1, vec![192, 576]));
        assert_eq!(t(&n("attn_v.weight")), (DType::Q4_1, vec![192, 576]));
        assert_eq!(t(&n("attn_output.weight")), (DType::Q4_1, vec![576, 576]));
        assert_eq!(t(&n("ffn_gate.weight")), (DType::Q4_1, vec![1536, 576]));
        assert_eq!(t(&n("ffn_up.weight")), (DType::Q4_1, vec![1536, 576]));
        assert_eq!(t(&n("ffn_down.weight")), (DType::Q4_1, vec![576, 1536]));
        assert_eq!(t(&n("attn_norm.weight")), (DType::F32, vec![576]));
        assert_eq!(t(&n("ffn_norm.weight")), (DType::F32, vec![576]));
    }
    // Q4_1 rows of 576 values are 18 blocks of 20 bytes.
    assert_eq!(m.tensors["blk.0.ffn_gate.weight"].data.len(), 1536 * 360);

    let v = &m.vocab;
    assert_eq!(
        (v.model.as_str(), v.pre.as_deref()),
        ("gpt2", Some("smollm"))
    );
    assert_eq!((v.tokens.len(), v.token_types.len()), (49152, 49152));
    assert!(v.merges.len() > 40000, "{} merges", v.merges.len());
    assert_eq!(v.tokens[1], "<|im_start|>");
    assert_eq!(
        v.bos.map(|b| v.tokens[b as usize].as_str()),
        Some("<|im_start|>")
    );
    assert_eq!(
        v.eos.map(|e| v.tokens[e as usize].as_str()),
        Some("<|im_end|>")
    );
    assert!(
        m.chat_template
            .as_deref()
            .is_some_and(|t| t.contains("<|im_start|>"))
    );

    // Every shape checks out for compute. (The tokenizer is a stand-in: this test is about the
    // tensors; Tokenizer::from_gguf is tested by its owner.)
    let tok =
        Tokenizer::from_json(&TinyLlama::new(0).tokenizer_json(), Default::default()).unwrap();
    let w = Weights::from_imported(&m.with_tokenizer(tok)).unwrap();
    assert_eq!(w.layers.len(), 30);
}
