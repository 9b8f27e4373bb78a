//! One type for the FFN of any sparse mode, built from a mode name and a budget: what the bench
//! and the daemon hold.

use std::sync::Arc;

use super::Mode;
use super::mmap::MmapFfn;
use super::select::Selector;
use super::sparse_model::SparseModel;
use super::stats::PipelineStats;
use super::streaming::{Policy, StreamingFfn};
use crate::backend::cpu::Precision;
use crate::forward::{Decode, FfnExecutor, Model};
use crate::io::{DirectFile, IoOptions, open_engine};
use crate::model::lsm::PredictorKind;
use crate::model::{LayerWeights, Residency};
use crate::{Error, Result};

/// Reads a streaming pipeline keeps in flight where io_uring serves them (elsewhere the pool's
/// `io_threads` threads read one each): small chunk reads (4–64 KiB) reach most of the disk's
/// bandwidth only at depths of 16 and more (`leanstream plan --disk-probe` prints the curve).
pub const IO_DEPTH: usize = 32;

/// How to build a sparse pipeline.
#[derive(Clone, Copy, Debug)]
pub struct ExecutorOptions {
    pub mode: Mode,
    /// Overrides the mode's policy (cache-backed modes only): the ablation runs use this.
    pub policy: Option<Policy>,
    /// Bytes of the neuron cache (cache-backed modes).
    pub cache_bytes: usize,
    /// Threads of the I/O pool where io_uring is refused ([`crate::io::open_engine`]).
    pub io_threads: usize,
    /// Largest hole a merged read may bridge ([`IoOptions::max_gap_bytes`]).
    pub io_gap_bytes: usize,
    pub precision: Precision,
    /// The predictor choosing chunks; `None` computes every chunk (sparsity off).
    pub predictor: Option<PredictorKind>,
    /// Verify every streamed chunk against its CRC-32 as it is read ([`IoOptions::verify_chunks`];
    /// true unless measuring the check's cost).
    pub verify_chunks: bool,
}

/// The FFN of a sparse mode.
#[derive(Debug)]
pub enum Executor {
    Mmap(Box<MmapFfn>),
    Streaming(Box<StreamingFfn>),
}

impl Executor {
    /// Builds the pipeline `opts` describes over `sm`. `dense` is not a sparse mode and is
    /// refused (run it with [`crate::forward::Session::forward`]).
    pub fn new(sm: &Arc<SparseModel>, opts: ExecutorOptions) -> Result<Executor> {
        let selector = Selector::new(sm.scorer(opts.predictor)?, sm.layout.n_ff);
        match opts.mode {
            Mode::Dense => Err(Error::InvalidArgument {
                arg: "mode",
                reason: "dense mode runs the dense forward pass, not a sparse pipeline".into(),
            }),
            Mode::Mmap if sm.residency != Residency::Mapped => Err(Error::InvalidArgument {
                arg: "mode",
                reason: "mmap mode reads the FFN through a map of the whole file: open the model \
                         with SparseModel::open_for_mode(.., Mode::Mmap, ..)"
                    .into(),
            }),
            Mode::Mmap => Ok(Executor::Mmap(Box::new(MmapFfn::new(
                Arc::clone(sm),
                selector,
                opts.precision,
            )))),
            mode => {
                let policy = opts
                    .policy
                    .or_else(|| Policy::for_mode(mode))
                    .expect("every cache-backed mode has a policy");
                let file = DirectFile::open(&sm.path)?;
                let io_opts = IoOptions {
                    max_gap_bytes: opts.io_gap_bytes,
                    verify_chunks: opts.verify_chunks,
                    ..IoOptions::default()
                };
                let io = open_engine(Arc::new(file), IO_DEPTH, opts.io_threads.max(1), io_opts)?;
                Ok(Executor::Streaming(Box::new(StreamingFfn::new(
                    Arc::clone(sm),
                    selector,
                    policy,
                    opts.cache_bytes,
                    io,
                    opts.precision,
                )?)))
            }
        }
    }

    /// Computes the FFN chunks on `gpu` (cache-backed modes; `mmap` runs on the CPU only).
    #[cfg(feature = "cuda")]
    pub fn use_cuda(&mut self, gpu: Arc<crate::backend::cuda::CudaBackend>) -> Result<()> {
        match self {
            Executor::Mmap(_) => Err(Error::InvalidArgument {
                arg: "mode",
                reason: "mmap mode has no CUDA path; use on-demand, prefetch or leanstream".into(),
            }),
            Executor::Streaming(e) => e.use_cuda(gpu),
        }
    }

    /// Counters since the last reset.
    pub fn stats(&self) -> PipelineStats {
        match self {
            Executor::Mmap(e) => e.stats().clone(),
            Executor::Streaming(e) => e.stats(),
        }
    }

    /// Zeroes the counters.
    pub fn reset_stats(&mut self) {
        match self {
            Executor::Mmap(e) => e.reset_stats(),
            Executor::Streaming(e) => e.reset_stats(),
        }
    }

    /// The executor of the FFN layers a memory plan streams by neuron (`None` when it streams
    /// none): `policy` over those layers only, with the plan's neuron cache, the default
    /// predictor and checked chunks. What `leanstream run` and the daemon serve a plan with.
    pub fn for_plan(
        model: &Arc<Model>,
        policy: Policy,
        io_threads: usize,
        precision: Precision,
    ) -> Result<Option<Executor>> {
        let Some(plan) = model.plan().filter(|p| p.is_sparse()) else {
            return Ok(None);
        };
        let sm = SparseModel::over(Arc::clone(model))?;
        let mut exec = Executor::new(
            &sm,
            ExecutorOptions {
                mode: Mode::LeanStream,
                policy: Some(policy),
                cache_bytes: plan.floor.cache as usize,
                io_threads,
                io_gap_bytes: crate::io::DEFAULT_MAX_GAP_BYTES,
                precision,
                predictor: Some(PredictorKind::DEFAULT),
                verify_chunks: true,
            },
        )?;
        exec.only_layers(&plan.sparse_ffn)?;
        Ok(Some(exec))
    }

    /// Computes only the FFN layers `mask` marks (those a plan streams by neuron); the forward
    /// pass computes the others dense. `mmap` mode covers every layer and refuses a mask.
    pub fn only_layers(&mut self, mask: &[bool]) -> Result<()> {
        match self {
            Executor::Mmap(_) => Err(Error::InvalidArgument {
                arg: "mode",
                reason: "mmap mode reads every FFN layer through the map".into(),
            }),
            Executor::Streaming(e) => {
                e.only_layers(mask);
                Ok(())
            }
        }
    }

    /// Turns recall measurement (dense activations of every neuron) on or off.
    pub fn measure_recall(&mut self, on: bool) {
        match self {
            Executor::Mmap(e) => e.measure_recall = on,
            Executor::Streaming(e) => e.measure_recall = on,
        }
    }

    /// Bytes of the neuron cache now (0 for `mmap`): what it costs the budget, an upper bound
    /// of its resident memory.
    pub fn cache_bytes(&self) -> usize {
        match self {
            Executor::Mmap(_) => 0,
            Executor::Streaming(e) => e.cache_bytes(),
        }
    }

    /// The smallest neuron cache the pipeline runs with, in bytes: one layer's chunks for the
    /// cache-backed modes (the same number [`ChunkLayout::floor_bytes`] gives from the file's
    /// header before loading), 0 for `mmap`.
    ///
    /// [`ChunkLayout::floor_bytes`]: crate::model::lsm::ChunkLayout::floor_bytes
    pub fn cache_floor_bytes(&self) -> usize {
        match self {
            Executor::Mmap(_) => 0,
            Executor::Streaming(e) => e.cache_floor_bytes(),
        }
    }

    /// Resizes the neuron cache to `bytes` (rounded down to whole chunks, capped at the whole
    /// streamed FFN) and returns the bytes it now holds, which [`Executor::cache_bytes`] reports
    /// from then on. Call between forward passes — `&mut self` rules out calling it during one,
    /// so the caller holding the executor (or its `Mutex`) is all the synchronisation needed.
    ///
    /// Shrinking evicts the chunks the mode's retention values least and gives their memory back
    /// to the OS at once; growing makes room that reads fill (memory is faulted in as chunks
    /// arrive). Pending speculative reads are cancelled and reads in flight waited for first;
    /// see [`StreamingFfn::resize_cache`]. Generation results do not depend on the size, only
    /// the bytes read per token do.
    ///
    /// A size below [`Executor::cache_floor_bytes`] is refused with [`Error::OverBudget`] (naming
    /// the floor and `bytes`) and changes nothing. `mmap` has no neuron cache (the kernel's page
    /// cache holds its weights): resizing it is a no-op that returns `Ok(0)`.
    pub fn resize_cache(&mut self, bytes: usize) -> Result<usize> {
        match self {
            Executor::Mmap(_) => Ok(0),
            Executor::Streaming(e) => e.resize_cache(bytes),
        }
    }
}

impl FfnExecutor for Executor {
    fn covers(&self, l: usize) -> bool {
        match self {
            Executor::Mmap(_) => true,
            Executor::Streaming(e) => e.covers(l),
        }
    }

    fn begin_layer(&mut self, l: usize, x: &[f32]) {
        match self {
            Executor::Mmap(e) => e.begin_layer(l, x),
            Executor::Streaming(e) => e.begin_layer(l, x),
        }
    }

    fn ffn(&mut self, l: usize, layer: &LayerWeights, xn: &[f32], out: &mut [f32]) -> Result<()> {
        match self {
            Executor::Mmap(e) => e.ffn(l, layer, xn, out),
            Executor::Streaming(e) => e.ffn(l, layer, xn, out),
        }
    }

    fn ffn_rows(
        &mut self,
        l: usize,
        layer: &LayerWeights,
        xn: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        match self {
            Executor::Mmap(e) => e.ffn_rows(l, layer, xn, out),
            Executor::Streaming(e) => e.ffn_rows(l, layer, xn, out),
        }
    }
}

/// A decoder whose every pass computes the FFN through its own sparse executor: a session of a
/// model whose plan streams FFN layers by neuron, driven like any dense session
/// (`generate::generate` and the rest take it as a [`Decode`]).
#[derive(Debug)]
pub struct WithFfn {
    pub decoder: Box<dyn Decode>,
    pub exec: Executor,
}

impl Decode for WithFfn {
    fn forward(&mut self, token: u32) -> Result<&mut [f32]> {
        self.decoder.forward_with(token, &mut self.exec)
    }
    /// Several rows a pass where the decoder can (the dense pieces read once for them all).
    fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.decoder.forward_batch_through(tokens, &mut self.exec)
    }
    fn position(&self) -> usize {
        self.decoder.position()
    }
    fn max_context(&self) -> usize {
        self.decoder.max_context()
    }
    fn vocab_size(&self) -> usize {
        self.decoder.vocab_size()
    }
    fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]> {
        self.decoder.forward_with(token, exec)
    }
    fn forward_rows(
        &mut self,
        tokens: &[u32],
        _exec: Option<&mut dyn FfnExecutor>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.decoder.forward_rows(tokens, Some(&mut self.exec), out)
    }
    fn rewind(&mut self, position: usize) -> Result<()> {
        self.decoder.rewind(position)
    }
    fn reset(&mut self) {
        self.decoder.reset()
    }
    fn bytes(&self) -> u64 {
        self.decoder.bytes()
    }
    fn kv_growth_bytes(&self, tokens: usize) -> u64 {
        self.decoder.kv_growth_bytes(tokens)
    }
    fn grow_kv(&mut self, tokens: usize) -> Result<()> {
        self.decoder.grow_kv(tokens)
    }
    fn release_kv(&mut self) {
        self.decoder.release_kv()
    }
    fn device_bytes(&self) -> Option<u64> {
        self.decoder.device_bytes()
    }
}
