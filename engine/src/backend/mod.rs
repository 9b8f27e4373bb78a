//! Compute backends. The CPU backend always compiles.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
