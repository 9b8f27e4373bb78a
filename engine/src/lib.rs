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
//!
//! Imports point one way, from higher layers to lower ones: the model and the leaf utilities
//! (`error`, `io`, `kv`, `cache`, `tokenizer`, `sample`, `constrain`, `reference`, ...) ←
//! [`backend`] ← [`forward`], [`plan`], [`stream`], [`predict`] ← [`pipeline`] ← [`generate`] ←
//! `bench`, [`calibrate`] and `testing`. A module needed below its layer moves down rather than
//! being imported upwards; `scripts/check-imports` checks the order and that no modules import
//! each other in a circle.

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
// Helpers for test suites (the real test models' paths, tiny `.lsm` files): built for this
// crate's unit tests and, with feature `testing`, for the test suites of the crates that depend
// on it; never part of a release build.
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer;

pub use error::{Error, Result};

/// Sets the number of compute threads: the members of the compute team that runs every forward
/// pass (the calling thread and `threads - 1` helpers; see `backend/cpu/team.rs`), and the size of
/// rayon's global pool, which serves the bulk work outside forward passes (model export and
/// synthesis). 0 means one per available core. Call once, before any compute; returns an error if
/// either was fixed already (the team is by its first parallel region).
pub fn set_compute_threads(threads: usize) -> std::result::Result<(), String> {
    backend::cpu::set_compute_threads(threads)?;
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .map_err(|e| e.to_string())
}
