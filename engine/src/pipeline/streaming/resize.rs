//! Resizing a streaming pipeline's neuron cache between forward passes.

use std::time::Duration;

#[cfg(feature = "cuda")]
use super::CpuChunks;
use super::StreamingFfn;
use crate::Result;
use crate::model::lsm::ChunkId;

impl StreamingFfn {
    /// Resizes the neuron cache to `bytes`, rounded down to whole chunks (capped at every chunk
    /// of the model), and returns the bytes it now holds. Call between forward passes.
    ///
    /// Below the floor it is refused with [`crate::Error::OverBudget`] naming the floor and `bytes`,
    /// before anything changes. Otherwise the pipeline first quiesces its reads: queued reads
    /// (speculative reads of later layers; the exact ones of a pass are all complete when it
    /// ends) are cancelled — speculation issues them again at the next layer start — and reads
    /// already started are waited for (at most one batch per I/O thread, each at most the
    /// largest merged read). With no read in flight no slot is being written, so the cache can
    /// evict, move chunks and release memory (see
    /// [`NeuronCache::resize`](crate::cache::NeuronCache::resize)). A GPU compute is dropped
    /// first (unregistering the arena, whose pages are locked while registered) and rebuilt over
    /// the resized arena after; if rebuilding fails, that error is returned and the chunks are
    /// computed on the CPU from then on.
    pub fn resize_cache(&mut self, bytes: usize) -> Result<usize> {
        // Refuse a size below the floor before quiescing: a refusal changes nothing.
        self.cache.slots_for(bytes as u64)?;
        self.quiesce_reads();
        #[cfg(feature = "cuda")]
        let gpu = self.gpu.take();
        #[cfg(feature = "cuda")]
        if gpu.is_some() {
            self.compute = Box::new(CpuChunks);
        }
        let resized = self.cache.resize(bytes as u64);
        #[cfg(feature = "cuda")]
        if let Some(gpu) = gpu {
            self.use_cuda(gpu)?;
        }
        Ok(resized? as usize)
    }

    /// Cancels every queued read and waits for the ones in flight, applying their completions:
    /// afterwards no slot is Loading.
    fn quiesce_reads(&mut self) {
        for c in 0..self.sm.layout.total_chunks() as ChunkId {
            self.cancel(c);
        }
        while self.io.pending() > 0 {
            self.done.clear();
            self.io
                .wait(&mut self.done, Some(Duration::from_millis(100)));
            self.apply_done();
        }
    }
}
