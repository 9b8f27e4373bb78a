//! Compute backends. The CPU backend always compiles.

pub mod cpu;
