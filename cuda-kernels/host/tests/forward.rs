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
