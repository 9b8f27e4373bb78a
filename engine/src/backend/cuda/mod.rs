//! The CUDA backend through `cust` (feature `cuda`): one context on the first device, the
//! checked-in PTX of `cuda-kernels/` loaded with the JIT target taken from the context, one
//! stream, and typed launches of the kernels.
//!
//! State: the kernels and their loader are here and tested for conformance against the CPU
//! kernels where a GPU is present (`engine/tests/cuda_conformance.rs`). Not built yet: the
//! streaming pipeline on the GPU (host-registered O_DIRECT buffers, per-chunk events) and
//! backend selection in the daemon and CLI.

use cust::module::ModuleJitOption;
use cust::prelude::*;

use crate::quant::DType;
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

fn cuda(what: &str) -> impl Fn(cust::error::CudaError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// The kernel type code of `dtype` (`cuda-kernels/src/common.cuh`: the order of [`DType::ALL`]).
pub fn dtype_code(dtype: DType) -> i32 {
    DType::ALL
        .iter()
        .position(|&d| d == dtype)
        .expect("every DType is in DType::ALL") as i32
}

/// A CUDA context with the LeanStream kernels loaded.
pub struct CudaBackend {
    stream: Stream,
    modules: Vec<(&'static str, Module)>,
    device: String,
    _ctx: Context, // dropped last: modules and the stream belong to it
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
        let device = Device::get_device(0)
            .and_then(|d| d.name())
            .map_err(cuda("reading the device name"))?;
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
            _ctx: ctx,
        })
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        &self.device
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

    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda("synchronising"))
    }

    /// RMSNorm of `x` (rows of `weight.len()` values) with `weight`.
    pub fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32) -> Result<Vec<f32>> {
        let n = weight.len();
        let rows = x.len() / n.max(1);
        let f = self.function("elementwise", "rmsnorm")?;
        let dx = DeviceBuffer::from_slice(x).map_err(cuda("copying x"))?;
        let dw = DeviceBuffer::from_slice(weight).map_err(cuda("copying weight"))?;
        let out = DeviceBuffer::<f32>::zeroed(x.len()).map_err(cuda("allocating out"))?;
        let stream = &self.stream;
        // SAFETY: the buffers hold rows × n f32 values as the kernel's signature requires and
        // live until after the synchronisation below.
        unsafe {
            launch!(f<<<rows as u32, 256, 0, stream>>>(
                out.as_device_ptr(),
                dx.as_device_ptr(),
                dw.as_device_ptr(),
                n as i32,
                eps
            ))
            .map_err(cuda("launching rmsnorm"))?;
        }
        self.sync()?;
        let mut host = vec![0.0; x.len()];
        out.copy_to(&mut host[..]).map_err(cuda("copying out"))?;
        Ok(host)
    }

    /// `silu(gate) * up`, element by element.
    pub fn silu_mul(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
        self.binary("silu_mul", gate, up)
    }

    /// `a + b`, element by element.
    pub fn add(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
        self.binary("add_inplace", a, b)
    }

    /// Runs an in-place element-wise kernel `name(float* a, const float* b, int n)`.
    fn binary(&self, name: &str, a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
        if a.len() != b.len() {
            return Err(Error::InvalidArgument {
                arg: "b",
                reason: format!("{} values, expected {}", b.len(), a.len()),
            });
        }
        let f = self.function("elementwise", name)?;
        let da = DeviceBuffer::from_slice(a).map_err(cuda("copying a"))?;
        let db = DeviceBuffer::from_slice(b).map_err(cuda("copying b"))?;
        let n = a.len() as u32;
        let stream = &self.stream;
        // SAFETY: both buffers hold n f32 values and live until after the synchronisation.
        unsafe {
            launch!(f<<<n.div_ceil(256), 256, 0, stream>>>(
                da.as_device_ptr(),
                db.as_device_ptr(),
                n as i32
            ))
            .map_err(|e| Error::Cuda(format!("launching {name}: {e}")))?;
        }
        self.sync()?;
        let mut host = vec![0.0; a.len()];
        da.copy_to(&mut host[..]).map_err(cuda("copying out"))?;
        Ok(host)
    }

    /// `W x` for `rows` rows of `cols` values of `dtype` stored back to back in `w`.
    pub fn matvec(
        &self,
        w: &[u8],
        dtype: DType,
        rows: usize,
        cols: usize,
        x: &[f32],
    ) -> Result<Vec<f32>> {
        let row_bytes = dtype
            .row_bytes(cols)
            .ok_or_else(|| Error::InvalidArgument {
                arg: "cols",
                reason: format!("{cols} is not a whole number of {dtype:?} blocks"),
            })?;
        if w.len() != rows * row_bytes || x.len() != cols {
            return Err(Error::InvalidArgument {
                arg: "w",
                reason: format!("{} bytes for {rows}×{cols} {dtype:?}", w.len()),
            });
        }
        let f = self.function("matvec", "matvec")?;
        let dw = DeviceBuffer::from_slice(w).map_err(cuda("copying w"))?;
        let dx = DeviceBuffer::from_slice(x).map_err(cuda("copying x"))?;
        let y = DeviceBuffer::<f32>::zeroed(rows).map_err(cuda("allocating y"))?;
        let none = DevicePointer::<f32>::null();
        let stream = &self.stream;
        // SAFETY: w holds rows × row_bytes bytes, x cols f32 and y rows f32, matching the
        // kernel's arguments; the bias is null (allowed); all live past the synchronisation.
        unsafe {
            launch!(f<<<(rows as u32).div_ceil(8), 256, 0, stream>>>(
                dw.as_device_ptr(),
                dtype_code(dtype),
                rows as i32,
                cols as i32,
                dx.as_device_ptr(),
                none,
                y.as_device_ptr()
            ))
            .map_err(cuda("launching matvec"))?;
        }
        self.sync()?;
        let mut host = vec![0.0; rows];
        y.copy_to(&mut host[..]).map_err(cuda("copying y"))?;
        Ok(host)
    }

    /// The index of the largest logit (the lowest among equals).
    pub fn argmax(&self, logits: &[f32]) -> Result<u32> {
        let f = self.function("sample", "argmax")?;
        let dl = DeviceBuffer::from_slice(logits).map_err(cuda("copying logits"))?;
        let out = DeviceBuffer::<u32>::zeroed(1).map_err(cuda("allocating out"))?;
        let stream = &self.stream;
        // SAFETY: logits holds n f32 and out one u32; both live past the synchronisation.
        unsafe {
            launch!(f<<<1, 1024, 0, stream>>>(
                dl.as_device_ptr(),
                logits.len() as i32,
                out.as_device_ptr()
            ))
            .map_err(cuda("launching argmax"))?;
        }
        self.sync()?;
        let mut host = [0u32];
        out.copy_to(&mut host[..]).map_err(cuda("copying out"))?;
        Ok(host[0])
    }
}
