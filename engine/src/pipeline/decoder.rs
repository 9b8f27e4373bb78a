//! Opening a decoder on the backend chosen at run time ([`Backend`]): the CPU [`Session`], or
//! the GPU's session with the pipeline's chunk computations moved to the same device. Here, not
//! in [`crate::backend::select`], because it builds sessions and drives an [`Executor`].

use std::sync::Arc;

use super::Executor;
use crate::Result;
use crate::backend::cpu::Precision;
use crate::backend::select::Backend;
use crate::forward::{Decode, Model, Session};
use crate::kv::KvType;

/// A decoding session for `model` on `backend` with room for `context` tokens. On the GPU, a
/// sparse pipeline `exec` (if any) moves its chunk computations there too and the model's FFN
/// stays off the device (the pipeline streams it); without one the whole FFN is uploaded.
/// The CPU stores keys and values as `kv`; the GPU keeps an f32 KV cache whatever `kv` says.
pub fn open_decoder(
    backend: Backend,
    model: &Arc<Model>,
    context: usize,
    precision: Precision,
    kv: KvType,
    exec: Option<&mut Executor>,
) -> Result<Box<dyn Decode>> {
    match backend {
        Backend::Cpu => Ok(Box::new(Session::new(
            Arc::clone(model),
            context,
            precision,
            kv,
        )?)),
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            use crate::backend::cuda::CudaBackend;
            use crate::forward::{GpuModel, GpuSession};
            let _ = kv;
            let gpu = Arc::new(CudaBackend::new()?);
            let dense = exec.is_none();
            if let Some(e) = exec {
                e.use_cuda(Arc::clone(&gpu))?;
            }
            let m = Arc::new(GpuModel::new(gpu, Arc::clone(model), dense)?);
            Ok(Box::new(GpuSession::new(m, context)?))
        }
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => {
            let _ = (exec, kv);
            Err(crate::Error::Cuda(
                "this build has no CUDA backend (built without feature `cuda`)".into(),
            ))
        }
    }
}
