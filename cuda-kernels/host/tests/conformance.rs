//! Every conformance body of the engine (`engine/src/backend/conformance.rs`) run through the
//! kernels of `cuda-kernels/src/` built for the host. `cuda-kernels/host-check` runs these and
//! counts them; `host-check --break` builds the kernels with an injected off-by-one and expects
//! failures here.

leanstream_engine::conformance_tests!(|_test: &str| Some(
    leanstream_cuda_host::HostKernels::default()
));
