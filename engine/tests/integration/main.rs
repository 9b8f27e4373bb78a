//! The engine's integration tests, one module per concern, linked into one test binary: each
//! binary links the whole engine, so one binary instead of eighteen saves CI minutes and disk.
//! `model_bytes` and `session_bytes` stay binaries of their own (each installs a counting global
//! allocator), as does `cuda_conformance` (feature `cuda`).
//!
//! Run one module: `cargo test -p leanstream-engine --test integration gemma_real`.

#[path = "../common/mod.rs"]
mod common;
/// The grammar fuzz target's input format and seeds (shared with `fuzz/`).
#[path = "../../../fuzz/src/grammar_input.rs"]
mod grammar_input;

mod calibrate_real;
mod calibrate_tiny;
mod chat_prompt_real;
mod constrained_real;
mod elastic_cache;
mod export_gguf;
mod gemma_real;
mod grammar_seeds;
mod import_bad_input;
mod import_real;
mod import_tiny;
mod kv_cache;
mod lsm_bad_input;
mod owned_load;
mod pipeline;
mod planned_model;
mod quant_blocks;
mod real_model;
mod speculative;
mod speculative_real;
mod streamed_integrity;
mod streaming_batch;
mod tiled_load;
mod tiny_models;
mod tokenizer_real;
mod unified;
