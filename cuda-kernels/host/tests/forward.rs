//! The GPU's forward pass run on the kernels built for the host, against the CPU's
//! (`leanstream_engine::testing::gpu`): every architecture flavour, and memory plans that
//! stream. `cuda-kernels/host-check` runs these with the conformance bodies; `--break` expects
//! them to fail.

use std::sync::Arc;

use leanstream_cuda_host::HostKernels;
use leanstream_engine::testing::gpu;

#[test]
fn the_gpu_pass_on_the_host_kernels_equals_the_cpu_pass_on_every_architecture() {
    gpu::gpu_pass_equals_cpu_on_every_architecture(Arc::new(HostKernels::default()));
}

/// As an integrated GPU: uploaded layers beside streamed ones, whose slots the kernels read in
/// place.
#[test]
fn the_gpu_pass_on_the_host_kernels_runs_a_plan_with_resident_layers_reading_slots_in_place() {
    let dev = Arc::new(HostKernels::INTEGRATED);
    gpu::gpu_pass_runs_a_memory_plan(dev, gpu::PlanShape::SomeLayersResident);
}

/// As a discrete GPU: every layer and most of the head streamed, each piece copied to the
/// session's staging buffer.
#[test]
fn the_gpu_pass_on_the_host_kernels_runs_a_plan_that_streams_every_layer_staging_pieces() {
    let dev = Arc::new(HostKernels::DISCRETE);
    gpu::gpu_pass_runs_a_memory_plan(dev, gpu::PlanShape::EveryLayerStreamed);
}

/// A `.lsm` file's neuron bundles streamed, read in place and staged.
#[test]
fn the_gpu_pass_on_the_host_kernels_runs_a_plan_that_streams_lsm_bundles() {
    for dev in [HostKernels::INTEGRATED, HostKernels::DISCRETE] {
        gpu::gpu_pass_runs_a_memory_plan_of_an_lsm(Arc::new(dev));
    }
}

/// Gemma-3-270M's layer shapes on the host kernels: minutes here (tens of thousands of blocks,
/// each a barrier of host threads), so only on request:
/// `cargo test -p leanstream-cuda-host --test forward -- --ignored`. The GPU check runs it on
/// every device run.
#[test]
#[ignore = "minutes on the host kernels; the GPU check runs it"]
fn the_gpu_pass_on_the_host_kernels_equals_the_cpu_pass_on_a_gemma3_shaped_model() {
    gpu::gpu_pass_equals_cpu_on_a_gemma3_shaped_model(Arc::new(HostKernels::default()));
}
