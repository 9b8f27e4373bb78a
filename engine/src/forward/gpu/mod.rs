//! The forward pass on a GPU ([`Device`](crate::backend::device::Device)): [`GpuModel`] holds
//! the weights in device memory (`model.rs`), [`GpuSession`] one conversation's KV cache and
//! scratch there (`session.rs`). The layers are the engine's one forward pass
//! ([`super::layer::layers`]); `session.rs` implements its steps with the kernels of
//! `cuda-kernels/`. One token at a time; the host sees the logits at the end of a token, and,
//! with a sparse executor ([`GpuSession::forward_with`]), each layer's residual and FFN input
//! and output (so the streaming pipeline's selection, I/O and cache run as on the CPU while the
//! kernels run here).
//!
//! The dense FFN uses the same gathered kernels as the sparse one, over every chunk of a layer:
//! the model's gate, up and down rows are packed into neuron bundles (the `.lsm` chunk layout)
//! when uploaded, so one kernel pair serves dense and sparse and is tested once.
//!
//! A model loaded under a memory plan ([`Model::load_within`](super::Model::load_within)) keeps
//! what the plan keeps in device memory and reads the rest as the CPU does, through the weight
//! stream, each streamed piece (a range of a layer's rows, of the head's rows) computed with the
//! matrix-vector kernel (the FFN as gate and up rows, the activation, then the down rows). Where
//! the device maps host memory (Jetson: the stream's slots registered with the driver once) the
//! kernels read the pieces in place, and the pass waits for them before a slot goes back to the
//! stream; on a discrete GPU each piece is copied into the session's staging buffer first.
//!
//! Any device runs it: the CUDA backend on a GPU, and the kernels built for the host in the test
//! command (`engine/src/testing/gpu.rs` holds the comparisons with the CPU's pass, which
//! `cuda-kernels/host/tests/forward.rs` and `engine/tests/cuda_conformance.rs` run).

mod model;
mod session;

pub use model::GpuModel;
pub use session::GpuSession;
