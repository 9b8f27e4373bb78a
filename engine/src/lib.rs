//! LeanStream inference engine.
//!
//! Layout (one concern per module):
//! - [`model`]: the internal model description, GGUF / safetensors import, the `.lsm` file format;
//! - [`quant`]: tensor element types and their block layouts;
//! - [`backend`]: compute kernels (CPU always; CUDA behind the `cuda` feature later);
//! - [`tokenizer`], [`chat`]: text ↔ ids and chat templates;
//! - [`reference`]: the plain dense f32 forward pass, the oracle for every faster path;
//! - [`forward`]: the engine's dense forward pass over quantised weights;
//! - [`sample`]: token sampling.

pub mod backend;
pub mod chat;
pub mod error;
pub mod forward;
pub mod model;
pub mod quant;
pub mod reference;
pub mod sample;
pub mod tokenizer;

pub use error::{Error, Result};
