//! Writes a seed corpus for the `gguf` fuzz target into the directory given as the argument.

use std::path::PathBuf;

use leanstream_engine::model::gguf::writer::GgufWriter;
use leanstream_engine::model::gguf::{Array, TinyArch, TinyLlama, Value};
use leanstream_engine::quant::DType;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: gguf_seeds DIR")?);
    std::fs::create_dir_all(&dir)?;

    // Every metadata value type and one small tensor of every supported type.
    let mut all = GgufWriter::new();
    all.add("u8", Value::U8(1))
        .add("i8", Value::I8(-1))
        .add("u16", Value::U16(2))
        .add("i16", Value::I16(-2))
        .add("u32", Value::U32(3))
        .add("i32", Value::I32(-3))
        .add("f32", Value::F32(0.5))
        .add("bool", Value::Bool(true))
        .add("string", Value::String("text".into()))
        .add("u64", Value::U64(4))
        .add("i64", Value::I64(-4))
        .add("f64", Value::F64(0.25))
        .add(
            "strings",
            Value::Array(Array::String(vec!["a".into(), "bc".into()])),
        )
        .add(
            "nested",
            Value::Array(Array::Array(vec![
                Array::I32(vec![1, 2]),
                Array::Bool(vec![true]),
            ])),
        )
        .add("general.alignment", Value::U32(16));
    // One block of each type: 32 values, or 256 for the k-quants.
    let row: Vec<f32> = (0..256).map(|i| (i % 32) as f32 / 8.0 - 2.0).collect();
    for dtype in DType::ALL {
        let n = dtype.block_len().max(32);
        all.add_f32_tensor(&format!("t.{dtype}"), dtype, &[1, n], &row[..n]);
    }
    std::fs::write(dir.join("all_types_v3.gguf"), all.to_bytes())?;
    all.set_version(2);
    std::fs::write(dir.join("all_types_v2.gguf"), all.to_bytes())?;

    // Tiny models: metadata only (small), and whole (exercises the config mapping).
    let tiny = TinyLlama::new(1);
    let mut meta = tiny.gguf_writer(DType::Q4_0);
    for name in tiny.tensors.keys() {
        meta.remove_tensor(name);
    }
    std::fs::write(dir.join("tiny_llama_metadata.gguf"), meta.to_bytes())?;
    std::fs::write(
        dir.join("tiny_llama_q4_1.gguf"),
        tiny.gguf_writer(DType::Q4_1).to_bytes(),
    )?;
    let qwen = TinyLlama::with_arch(2, TinyArch::Qwen2).with_tied_embeddings();
    std::fs::write(
        dir.join("tiny_qwen2_q8_0.gguf"),
        qwen.gguf_writer(DType::Q8_0).to_bytes(),
    )?;
    // Gemma 3 and Qwen 3 metadata (sliding window, QK-norm, post-norms).
    for arch in [TinyArch::Gemma3, TinyArch::Qwen3] {
        std::fs::write(
            dir.join(format!("tiny_{}_q8_0.gguf", arch.name())),
            TinyLlama::with_arch(3, arch).gguf_writer(DType::Q8_0).to_bytes(),
        )?;
    }
    Ok(())
}
