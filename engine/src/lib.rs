//! LeanStream inference engine.
//!
//! Layout (one concern per module):
//! - [`model`]: the internal model description, GGUF / safetensors import, the `.lsm` file format;
//! - [`quant`]: tensor element types and their block layouts;
//! - [`backend`]: compute kernels (CPU always; CUDA behind the `cuda` feature later);
//! - [`tokenizer`], [`chat`]: text ↔ ids and chat templates;
//! - [`reference`]: the plain dense f32 forward pass, the oracle for every faster path;
//! - [`forward`]: the engine's dense forward pass over quantised weights;
//! - [`kv`]: a session's KV cache (f16 / q8_0 / f32, grown in blocks);
//! - [`sample`]: token sampling; [`constrain`]: grammar / JSON Schema constrained decoding;
//! - [`io`], [`cache`], [`predict`], [`pipeline`]: the sparse streaming engine (direct reads, the
//!   neuron cache, activation predictors, and the five pipeline modes);
//! - [`bench`]: the mode comparison behind `leanstream bench`;
//! - [`process`]: what the OS knows about this process (resident memory, bytes read, a cold start).

pub mod alloc;
pub mod backend;
pub mod bench;
pub mod cache;
pub mod calibrate;
pub mod chat;
pub mod constrain;
pub mod error;
pub mod forward;
pub mod generate;
pub mod io;
pub mod kv;
pub mod model;
pub mod pipeline;

pub mod plan;
pub mod predict;
pub mod process;
pub mod quant;
pub mod reference;
pub mod sample;
pub mod sparsity;
pub mod stream;
pub mod testing;
pub mod tokenizer;

pub use error::{Error, Result};

/// Sets the number of compute threads (the global rayon pool). Call once, before any compute;
/// returns an error if the pool was already built.
pub fn set_compute_threads(threads: usize) -> std::result::Result<(), String> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .map_err(|e| e.to_string())
}
