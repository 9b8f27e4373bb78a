//! Parses arbitrary bytes as a `.lsm` file, then builds everything a loader builds from it:
//! chunk checksums, the tokenizer and the strided FFN views. Errors are fine; panics are bugs.
#![no_main]

use std::path::Path;

use leanstream_engine::model::TensorBytes;
use leanstream_engine::model::lsm::{LsmFile, PREAMBLE_LEN};
use libfuzzer_sys::fuzz_target;

/// Rewrites the header checksum to match the (mutated) header, so that most inputs get past the
/// checksum into JSON and layout validation instead of stopping at the first check.
fn fix_header_crc(bytes: &mut [u8]) {
    if bytes.len() < PREAMBLE_LEN {
        return;
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[16..24]);
    let end = usize::try_from(u64::from_le_bytes(len))
        .ok()
        .and_then(|n| n.checked_add(PREAMBLE_LEN));
    if let Some(end) = end.filter(|&e| e <= bytes.len()) {
        let crc = crc32fast::hash(&bytes[PREAMBLE_LEN..end]);
        bytes[24..28].copy_from_slice(&crc.to_le_bytes());
    }
}

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.lsm");
    let mut bytes = data.to_vec();
    if data.first().is_some_and(|b| b & 1 == 0) {
        fix_header_crc(&mut bytes);
    }
    let Ok(file) = LsmFile::parse(path, TensorBytes::from_vec(bytes)) else {
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
