//! Parses arbitrary bytes as a `.lsm` file, then builds everything a loader builds from it:
//! chunk checksums, the tokenizer and the strided FFN views. Errors are fine; panics are bugs.
#![no_main]

use std::path::Path;

use leanstream_engine::model::TensorBytes;
use leanstream_engine::model::lsm::LsmFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.lsm");
    let Ok(file) = LsmFile::parse(path, TensorBytes::from_vec(data.to_vec())) else {
        return;
    };
    let _ = file.verify_streamed(path);
    if let Ok(tokenizer) = file.tokenizer() {
        if let Ok(w) = file.weights(path, tokenizer) {
            // Touch the last row of every FFN view: strided rows must lie inside the input.
            for l in &w.layers {
                std::hint::black_box(l.ffn.gate.row(l.ffn.gate.rows - 1));
                std::hint::black_box(l.ffn.up.row(l.ffn.up.rows - 1));
            }
        }
    }
});
