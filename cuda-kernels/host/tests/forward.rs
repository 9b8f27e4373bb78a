//! The GPU's forward pass run on the kernels built for the host, against the CPU's
//! (`leanstream_engine::testing::gpu`): every architecture flavour, and memory plans that
//! stream. `cuda-kernels/host-check` runs these with the conformance bodies; `--break` expects
//! them to fail.

use std::sync::Arc;

use leanstream_cuda_host::HostKernels;
use leanstream_engine::testing::gpu;

#[test]
fn the_gpu_pass_on_the_host_kernels_equals_the_cpu_pass_on_every_architecture() {
    gpu::gpu_pass_equals_cpu_on_every_architecture(Arc::new(HostKernels));
}

#[test]
fn the_gpu_pass_on_the_host_kernels_runs_memory_plans_that_stream() {
    gpu::gpu_pass_runs_memory_plans(Arc::new(HostKernels));
}

/// Gemma-3-270M's layer shapes on the host kernels: minutes here (tens of thousands of blocks,
/// each a barrier of host threads), so only on request:
/// `cargo test -p leanstream-cuda-host --test forward -- --ignored`. The GPU check runs it on
/// every device run.
#[test]
#[ignore = "minutes on the host kernels; the GPU check runs it"]
fn the_gpu_pass_on_the_host_kernels_equals_the_cpu_pass_on_a_gemma3_shaped_model() {
    gpu::gpu_pass_equals_cpu_on_a_gemma3_shaped_model(Arc::new(HostKernels));
}
