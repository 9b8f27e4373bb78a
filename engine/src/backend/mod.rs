//! Compute backends. The CPU backend always compiles; the CUDA backend with feature `cuda`.
//! [`device::Device`] is what a GPU provides (memory, copies, the kernels of `cuda-kernels/`),
//! implemented by the CUDA backend and by the same kernels built for the host.
//! [`ops::KernelOps`] is the per-kernel seam the CPU and every device implement, and
//! [`conformance`] holds the test bodies every backend runs against the same plain f32
//! computations. [`chunks`] is the sparse FFN over neuron chunks that the streaming pipelines
//! hand to either backend. [`launch`] is the launch geometry of the CUDA kernels, shared with
//! their host build (`cuda-kernels/host/`).

pub mod chunks;
pub mod conformance;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod launch;
pub mod ops;
pub mod select;
