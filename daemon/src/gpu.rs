//! The daemon's one CUDA context (feature `cuda`), shared by every model loaded on the GPU:
//! device memory belongs to a context, so the models, their pipelines and all sessions must
//! use the same one.

use std::sync::{Arc, Mutex};

use leanstream_engine::backend::cuda::CudaBackend;

static SHARED: Mutex<Option<Arc<CudaBackend>>> = Mutex::new(None);

/// The shared backend, created on first use.
pub fn shared() -> leanstream_engine::Result<Arc<CudaBackend>> {
    let mut slot = SHARED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(b) = slot.as_ref() {
        return Ok(Arc::clone(b));
    }
    let b = Arc::new(CudaBackend::new()?);
    tracing::info!("CUDA context on {}", b.device());
    *slot = Some(Arc::clone(&b));
    Ok(b)
}
