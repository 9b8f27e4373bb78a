//! Truncated, corrupted, foreign and unsupported model files fail with an error that names the
//! file and the specific problem, and never panic.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::{Path, PathBuf};

use leanstream_engine::Error;
use leanstream_engine::model::gguf::writer::GgufWriter;
use leanstream_engine::model::gguf::{GgufFile, GgufModel, TinyLlama, Value};
use leanstream_engine::model::{TensorBytes, Weights, safetensors};
use leanstream_engine::quant::DType;
use leanstream_engine::tokenizer::Tokenizer;
use proptest::prelude::*;

fn tiny_bytes() -> Vec<u8> {
    TinyLlama::new(9).gguf_writer(DType::Q8_0).to_bytes()
}

/// Writes `bytes` to a file and opens it through the full GGUF path (parse + config mapping).
fn open_gguf(dir: &Path, name: &str, bytes: &[u8]) -> (PathBuf, Result<GgufModel, Error>) {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let r = GgufModel::read(&path);
    (path, r)
}

/// Asserts `r` failed with a message naming `path` and containing every one of `what`.
fn assert_err<T: std::fmt::Debug>(r: Result<T, Error>, path: &Path, what: &[&str]) -> String {
    let msg = r.expect_err("must fail").to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "no path in: {msg}"
    );
    for w in what {
        assert!(msg.contains(w), "`{w}` not in: {msg}");
    }
    msg
}

fn patch(bytes: &mut [u8], at: usize, with: &[u8]) {
    bytes[at..at + with.len()].copy_from_slice(with);
}

/// Byte position just after the tensor-info name `name` (where its n_dims field starts).
fn after_name(bytes: &[u8], name: &str) -> usize {
    let pos = bytes
        .windows(name.len())
        .position(|w| w == name.as_bytes())
        .unwrap();
    pos + name.len()
}

#[test]
fn truncated_files_say_truncated_at_every_cut() {
    let dir = tempfile::tempdir().unwrap();
    let full = tiny_bytes();
    let info = after_name(&full, "blk.0.attn_q.weight");
    let f = GgufFile::parse(Path::new("x"), TensorBytes::from_vec(full.clone())).unwrap();
    let data = f.data_start();
    for cut in [
        0,
        3,
        6,
        12,
        20,
        30,
        60,
        2000,
        info - 5,
        info + 6,
        data - 1,
        data + 100,
        full.len() - 1,
    ] {
        let (path, r) = open_gguf(dir.path(), &format!("cut{cut}.gguf"), &full[..cut]);
        assert_err(r, &path, &["invalid model file", "truncated"]);
    }
}

#[test]
fn wrong_magic_and_versions_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = tiny_bytes();
    patch(&mut b, 0, b"GGML");
    let (p, r) = open_gguf(dir.path(), "magic.gguf", &b);
    assert_err(r, &p, &["not a GGUF file"]);

    for (v, what) in [
        (
            1u32,
            "GGUF version 1 (32-bit counts) is not supported; supported: 2, 3",
        ),
        (4, "GGUF version 4 is not supported"),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut b = tiny_bytes();
        patch(&mut b, 4, &v.to_le_bytes());
        let (p, r) = open_gguf(dir.path(), "version.gguf", &b);
        assert_err(r, &p, &["unsupported", what]);
    }
    let mut w = TinyLlama::new(9).gguf_writer(DType::F32);
    w.set_version(2);
    let (p, r) = open_gguf(dir.path(), "v2.gguf", &w.to_bytes());
    assert_eq!(r.unwrap().config.n_layers, 2, "{}", p.display());
}

#[test]
fn corrupted_header_fields_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let key = "general.architecture";
    // Header: magic, version, tensor count at 8, metadata count at 16; the first entry's key
    // length at 24, key, value type, then the string value's length.
    let ty_at = 24 + 8 + key.len();
    let cases: [(&str, usize, Vec<u8>, &[&str]); 5] = [
        (
            "tensors.gguf",
            8,
            u64::MAX.to_le_bytes().to_vec(),
            &["tensor info count"],
        ),
        (
            "kvs.gguf",
            16,
            (1u64 << 40).to_le_bytes().to_vec(),
            &["metadata entry count"],
        ),
        (
            "keylen.gguf",
            24,
            (1u64 << 50).to_le_bytes().to_vec(),
            &["metadata entry 0", "key"],
        ),
        (
            "type.gguf",
            ty_at,
            99u32.to_le_bytes().to_vec(),
            &[key, "unknown metadata value type 99"],
        ),
        (
            "strlen.gguf",
            ty_at + 4,
            u64::MAX.to_le_bytes().to_vec(),
            &[key, "string value"],
        ),
    ];
    for (name, at, with, what) in cases {
        let mut b = tiny_bytes();
        patch(&mut b, at, &with);
        let (p, r) = open_gguf(dir.path(), name, &b);
        assert_err(r, &p, what);
    }

    let t = "blk.0.attn_q.weight";
    let at = after_name(&tiny_bytes(), t);
    let mut b = tiny_bytes();
    patch(&mut b, at, &5u32.to_le_bytes());
    let (p, r) = open_gguf(dir.path(), "ndims.gguf", &b);
    assert_err(r, &p, &[t, "n_dims 5 is outside 1..=4"]);

    // n_dims (4) + two dims (16) + type (4), then the offset.
    let mut b = tiny_bytes();
    patch(&mut b, at + 24, &7u64.to_le_bytes());
    let (p, r) = open_gguf(dir.path(), "misaligned.gguf", &b);
    assert_err(
        r,
        &p,
        &[t, "data offset 7 is not a multiple of the alignment 32"],
    );

    let mut b = tiny_bytes();
    patch(&mut b, at + 24, &(1u64 << 40).to_le_bytes());
    let (p, r) = open_gguf(dir.path(), "offset.gguf", &b);
    assert_err(r, &p, &[t, "runs past the end of the file"]);

    let mut b = tiny_bytes();
    patch(&mut b, at + 4, &(1u64 << 40).to_le_bytes());
    let (p, r) = open_gguf(dir.path(), "dims.gguf", &b);
    assert_err(r, &p, &[t, "more than the file could hold"]);

    // Found by the fuzzer: an empty outer dimension must not let a huge row width through.
    let mut w = TinyLlama::new(9).gguf_writer(DType::F32);
    w.add_raw_tensor("wide", 0, &[0, 1 << 62], Vec::new());
    let (p, r) = open_gguf(dir.path(), "wide.gguf", &w.to_bytes());
    assert_err(r, &p, &["`wide`", "more than the file could hold"]);

    let mut w = TinyLlama::new(9).gguf_writer(DType::F32);
    w.add("general.alignment", Value::U32(48));
    let (p, r) = open_gguf(dir.path(), "align.gguf", &w.to_bytes());
    assert_err(r, &p, &["general.alignment must be a power of two"]);

    let mut w = TinyLlama::new(9).gguf_writer(DType::F32);
    w.add("llama.block_count", Value::String("two".into()));
    let (p, r) = open_gguf(dir.path(), "keytype.gguf", &w.to_bytes());
    assert_err(
        r,
        &p,
        &[
            "metadata `llama.block_count` is string",
            "expected a non-negative integer",
        ],
    );
}

#[test]
fn unsupported_tensor_type_names_tensor_and_type() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = TinyLlama::new(9).gguf_writer(DType::Q8_0);
    // iq4_xs: 136-byte blocks of 256 values.
    w.add_raw_tensor("blk.0.ffn_down.weight", 23, &[256, 128], vec![0; 128 * 136]);
    let (p, r) = open_gguf(dir.path(), "iq4xs.gguf", &w.to_bytes());
    assert_err(
        r,
        &p,
        &[
            "unsupported: tensor blk.0.ffn_down.weight has type iq4_xs (23), which is not \
           supported; supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, \
           q5_k, q6_k",
        ],
    );
}

#[test]
fn unsupported_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = TinyLlama::new(9).gguf_writer(DType::F32);
    w.add("general.architecture", Value::String("gpt2".into()));
    let (p, r) = open_gguf(dir.path(), "arch.gguf", &w.to_bytes());
    assert_err(
        r,
        &p,
        &[
            "unsupported",
            "architecture `gpt2` is not supported; supported: llama",
        ],
    );
    w.remove("general.architecture");
    let (p, r) = open_gguf(dir.path(), "noarch.gguf", &w.to_bytes());
    assert_err(r, &p, &["metadata key `general.architecture` is missing"]);
}

fn weights_from(w: &GgufWriter, dir: &Path, name: &str) -> (PathBuf, Result<Weights, Error>) {
    let tiny = TinyLlama::new(9);
    let (p, r) = open_gguf(dir, name, &w.to_bytes());
    let tok = Tokenizer::from_json(&tiny.tokenizer_json(), Default::default()).unwrap();
    let m = r.unwrap().with_tokenizer(tok);
    (p, Weights::from_imported(&m))
}

#[test]
fn missing_tensor_and_wrong_shape_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = TinyLlama::new(9).gguf_writer(DType::Q4_0);
    w.remove_tensor("blk.1.ffn_up.weight");
    let (p, r) = weights_from(&w, dir.path(), "missing.gguf");
    assert_err(r, &p, &["tensor `blk.1.ffn_up.weight`: missing"]);

    let mut w = TinyLlama::new(9).gguf_writer(DType::Q4_0);
    w.add_f32_tensor(
        "blk.0.attn_k.weight",
        DType::Q4_0,
        &[64, 64],
        &[0.5; 64 * 64],
    );
    let (p, r) = weights_from(&w, dir.path(), "shape.gguf");
    assert_err(
        r,
        &p,
        &["tensor `blk.0.attn_k.weight`: shape [64, 64], expected [32, 64]"],
    );

    let mut w = TinyLlama::new(9).gguf_writer(DType::Q4_0);
    w.add("llama.vocab_size", Value::U32(100));
    let (p, r) = open_gguf(dir.path(), "vocab.gguf", &w.to_bytes());
    assert_err(
        r,
        &p,
        &["tokenizer.ggml.tokens has 128 entries but the vocabulary size is 100"],
    );
}

#[test]
fn safetensors_directory_problems_are_named() {
    let tiny = TinyLlama::new(3);
    let fresh = || {
        let d = tempfile::tempdir().unwrap();
        safetensors::write_tiny_dir(d.path(), &tiny, DType::F32).unwrap();
        d
    };

    let d = fresh();
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert_err(
        safetensors::import(d.path()),
        d.path(),
        &["config.json is missing"],
    );

    let d = fresh();
    let cfg = d.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("LlamaForCausalLM", "GPT2LMHeadModel")).unwrap();
    assert_err(
        safetensors::import(d.path()),
        &cfg,
        &["architecture `GPT2LMHeadModel` is not supported"],
    );
    std::fs::write(&cfg, text.replace("\"hidden_size\"", "\"hidden\"")).unwrap();
    assert_err(
        safetensors::import(d.path()),
        &cfg,
        &["`hidden_size` is missing"],
    );
    std::fs::write(&cfg, &text[..text.len() / 2]).unwrap();
    assert_err(safetensors::import(d.path()), &cfg, &["not valid JSON"]);

    let d = fresh();
    let shard = d.path().join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 10]).unwrap();
    assert_err(
        safetensors::import(d.path()),
        &shard,
        &["safetensors header"],
    );

    let d = fresh();
    let extra = d.path().join("model-00003-extra.safetensors");
    let data = 7i64.to_le_bytes();
    let view =
        ::safetensors::tensor::TensorView::new(::safetensors::Dtype::I64, vec![1], &data).unwrap();
    ::safetensors::serialize_to_file([("model.norm.weight", view)], None, &extra).unwrap();
    assert_err(
        safetensors::import(d.path()),
        &extra,
        &["tensor model.norm.weight has dtype I64"],
    );

    let d = fresh();
    let shard = d.path().join("model-00001-of-00002.safetensors");
    std::fs::copy(
        d.path().join("model-00001-of-00002.safetensors"),
        d.path().join("dup.safetensors"),
    )
    .unwrap();
    assert_err(safetensors::import(d.path()), &shard, &["also appears in"]);

    let d = fresh();
    std::fs::remove_file(d.path().join("model-00002-of-00002.safetensors")).unwrap();
    let m = safetensors::import(d.path()).unwrap();
    assert_err(
        Weights::from_imported(&m),
        d.path(),
        &["tensor `output.weight`: missing"],
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random byte edits, 8-byte overwrites and truncations of a valid file never panic.
    #[test]
    fn mutated_gguf_never_panics(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        words in prop::collection::vec((any::<prop::sample::Index>(), any::<u64>()), 0..3),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut b = TinyLlama::new(1).gguf_writer(DType::Q4_1).to_bytes();
        // Mutations land mostly in the header, metadata and tensor infos, where parsing happens.
        let head = b.len().min(4096);
        for (i, v) in edits {
            b[i.index(head)] = v;
        }
        for (i, v) in words {
            let at = i.index(head - 8);
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        if truncate {
            b.truncate(cut.index(b.len()));
        }
        let path = Path::new("mutated.gguf");
        if let Ok(f) = GgufFile::parse(path, TensorBytes::from_vec(b)) {
            for t in f.tensors() {
                let _ = f.tensor_ref(t);
            }
            let _ = GgufModel::from_file(&f);
        }
    }
}

#[test]
fn untied_safetensors_without_lm_head_is_a_missing_tensor() {
    let d = tempfile::tempdir().unwrap();
    let mut tiny = TinyLlama::new(3);
    tiny.tensors.remove("output.weight");
    safetensors::write_tiny_dir(d.path(), &tiny, DType::F32).unwrap();
    let m = safetensors::import(d.path()).unwrap();
    assert!(!m.config.tied_embeddings);
    assert_err(
        Weights::from_imported(&m),
        d.path(),
        &["`output.weight`: missing"],
    );
}
