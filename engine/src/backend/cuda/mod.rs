//! The CUDA backend through `cust` (feature `cuda`): one context on the first device, the
//! checked-in PTX of `cuda-kernels/` loaded with the JIT target taken from the context, one
//! stream, and typed launches of the kernels.
//!
//! - `kernels.rs`: [`crate::backend::device::Device`]: memory, copies and typed launches on
//!   device addresses (what the forward pass and the conformance tests use);
//! - `memory.rs`: host memory registered with the driver, and asynchronous copies from it;
//! - `chunks.rs`: the streaming pipeline's chunk computations on the GPU, over the neuron
//!   cache registered with the driver.
//!
//! The forward pass that runs a whole model on a GPU (`GpuModel`, `GpuSession`) is the forward
//! layer's (`forward/gpu/`), written against `Device`: this module knows kernels and memory,
//! not models.

mod chunks;
mod kernels;
mod memory;

use cust::device::DeviceAttribute;
use cust::module::ModuleJitOption;
use cust::prelude::*;

pub use chunks::CudaChunks;
pub use memory::HostRegistration;

use crate::{Error, Result};

/// The PTX of `cuda-kernels/ptx/`, by module name.
const PTX: [(&str, &str); 5] = [
    (
        "elementwise",
        include_str!("../../../../cuda-kernels/ptx/elementwise.ptx"),
    ),
    (
        "matvec",
        include_str!("../../../../cuda-kernels/ptx/matvec.ptx"),
    ),
    ("ffn", include_str!("../../../../cuda-kernels/ptx/ffn.ptx")),
    (
        "attention",
        include_str!("../../../../cuda-kernels/ptx/attention.ptx"),
    ),
    (
        "sample",
        include_str!("../../../../cuda-kernels/ptx/sample.ptx"),
    ),
];

/// Maps a `cust` error to [`Error::Cuda`] naming what was being done.
pub(crate) fn cuda(what: &str) -> impl Fn(cust::error::CudaError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// A CUDA context with the LeanStream kernels loaded.
pub struct CudaBackend {
    stream: Stream,
    modules: Vec<(&'static str, Module)>,
    device: String,
    integrated: bool,
    ctx: Context, // dropped last: modules and the stream belong to it
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// A context on the first device with every module loaded; an error says why not (no
    /// driver, no device, or PTX the driver cannot JIT).
    pub fn new() -> Result<CudaBackend> {
        let ctx = cust::quick_init().map_err(cuda("initialising CUDA on device 0"))?;
        let dev = Device::get_device(0).map_err(cuda("opening device 0"))?;
        let device = dev.name().map_err(cuda("reading the device name"))?;
        // Jetson/Orin: the GPU shares the host's memory, so host buffers it can map are read
        // in place instead of copied.
        let integrated = dev
            .get_attribute(DeviceAttribute::Integrated)
            .map_err(cuda("reading the device's integrated attribute"))?
            != 0;
        let mut modules = Vec::with_capacity(PTX.len());
        for (name, ptx) in PTX {
            let m = Module::from_ptx(ptx, &[ModuleJitOption::DetermineTargetFromContext])
                .map_err(|e| Error::Cuda(format!("loading module {name}: {e}")))?;
            modules.push((name, m));
        }
        let stream =
            Stream::new(StreamFlags::NON_BLOCKING, None).map_err(cuda("creating a stream"))?;
        Ok(CudaBackend {
            stream,
            modules,
            device,
            integrated,
            ctx,
        })
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Makes this backend's context current on the calling thread. CUDA contexts are current
    /// per thread, and a session may be created on one thread and run on another (the daemon's
    /// engine thread), so every entry point that launches work calls this first (a cheap
    /// driver call).
    pub fn bind(&self) -> Result<()> {
        cust::context::CurrentContext::set_current(&self.ctx).map_err(cuda("binding the context"))
    }

    fn function(&self, module: &str, name: &str) -> Result<Function<'_>> {
        let (_, m) = self
            .modules
            .iter()
            .find(|(n, _)| *n == module)
            .ok_or_else(|| Error::Cuda(format!("no module {module}")))?;
        m.get_function(name)
            .map_err(|e| Error::Cuda(format!("kernel {module}.{name}: {e}")))
    }
}

/// Sessions move to the daemon's engine thread and share one backend.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    const fn send<T: Send>() {}
    send_sync::<CudaBackend>();
    send::<CudaChunks>();
};
