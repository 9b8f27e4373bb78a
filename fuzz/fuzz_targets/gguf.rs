//! Parses arbitrary bytes as GGUF, then walks everything the parser hands out: metadata values,
//! tensor slices, and the llama-family config mapping. Errors are fine; panics are bugs.
#![no_main]

use std::path::Path;

use leanstream_engine::model::TensorBytes;
use leanstream_engine::model::gguf::{Array, GgufFile, GgufModel, Value};
use libfuzzer_sys::fuzz_target;

fn walk(v: &Value) -> usize {
    match v {
        Value::Array(Array::Array(inner)) => inner.iter().map(|a| a.len()).sum(),
        Value::Array(a) => a.len(),
        Value::String(s) => s.len(),
        other => other.type_name().len(),
    }
}

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    let Ok(file) = GgufFile::parse(path, TensorBytes::from_vec(data.to_vec())) else {
        return;
    };
    let mut sink = 0usize;
    for (k, v) in file.metadata() {
        sink += k.len() + walk(v);
        let _ = (
            file.get_uint(k),
            file.get_float(k),
            file.get_str(k),
            file.get_bool(k),
        );
        let _ = (
            file.get_str_array(k),
            file.get_i32_array(k),
            file.get_f32_array(k),
        );
    }
    for t in file.tensors() {
        if let Ok(r) = file.tensor_ref(t) {
            // Touch the first and last byte: the slice must lie inside the input.
            sink += r.data.first().copied().unwrap_or(0) as usize;
            sink += r.data.last().copied().unwrap_or(0) as usize;
        }
    }
    let _ = GgufModel::from_file(&file);
    std::hint::black_box(sink);
});
