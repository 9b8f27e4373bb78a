//! The FFN of the cache-backed modes — `on-demand`, `prefetch` and `leanstream` — as one
//! executor whose [`Policy`] says when to read, what to keep and in what order to compute. The
//! three modes are presets of the policy, and the ablation of LeanStream's refinements switches
//! its parts on one at a time.
//!
//! Per token and layer `l` (docs/architecture.md §2):
//! 1. **Speculate** (at the start of layer `l`, before its attention): the predictor scores layers
//!    `l..l + lookahead` from the residual stream as it is now, and reads of the missing chunks
//!    it selects are queued, nearer layers first, better margins first.
//! 2. **Refine** (the FFN of `l`, with its exact input): the exact selection promotes its missing
//!    chunks to the front of the queue and cancels queued reads of chunks it no longer selects;
//!    later layers' reads are re-scored as their speculation is repeated layer by layer.
//! 3. **Stream**: chunks are computed as they become ready — resident ones first, then the
//!    arrivals — because an FFN output is a sum over neurons; the layer is done when every
//!    selected chunk is in. The sum runs in fixed blocks of chunks, each computed once all of
//!    its chunks are in, so that it does not depend on the arrival order ([`blocks`]).
//! 4. **Retain**: the cache keeps the chunks most often active in calibration. With neurons
//!    sorted by frequency (`leanstream calibrate` does it by default) those are the front of
//!    each layer, so the cached set is stable and contiguous and the misses merge into large
//!    reads. Retaining by observed activity as well (`Retention::Refined`) reads fewer bytes but
//!    scatters the cache, and measured slower (the bench's ablation shows both).

mod blocks;
mod resize;

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Mode;
use super::select::Selector;
use super::sparse_model::SparseModel;
use super::stats::PipelineStats;
use crate::backend::chunks::{ChunkCompute, ChunkMath, CpuChunks};
use crate::backend::cpu::{self, Kernels, Precision, QuantizedActs};
use crate::cache::{Evict, Lookup, NeuronCache};
use crate::forward::{FfnExecutor, MAX_BATCH};
use crate::io::{ChunkCheck, Completion, IoEngine, ReadRequest};
use crate::model::LayerWeights;
use crate::model::lsm::ChunkId;
use crate::{Error, Result};
use blocks::Blocks;

/// What the cache keeps when it must evict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retention {
    /// Least recently used goes first.
    Lru,
    /// Least often active in calibration goes first (hot neurons stay).
    Frequency,
    /// Lowest blend of recent observed activity and calibrated frequency goes first, updated from
    /// the exact activations of every token. Measured slower than `Frequency` (the ablation's
    /// last row): the cached set churns and scatters, so misses no longer merge into large reads.
    Refined,
}

/// When a cache-backed pipeline reads, what it keeps and in what order it computes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    /// Layers (counting the current one) whose chunks are read speculatively at each layer start
    /// from the residual stream; 0 reads nothing before the exact selection.
    pub lookahead: usize,
    /// Repeat speculation at every layer start and with the exact input, promoting needed reads
    /// and cancelling queued reads no longer selected. Off: each layer is speculated once.
    pub refine_load: bool,
    /// Compute chunks as they become ready instead of after the layer's last read.
    pub stream_compute: bool,
    pub retention: Retention,
}

impl Policy {
    /// The policy of a cache-backed mode; `None` for `dense` and `mmap`.
    pub fn for_mode(mode: Mode) -> Option<Policy> {
        match mode {
            Mode::OnDemand => Some(Policy {
                lookahead: 0,
                refine_load: false,
                stream_compute: false,
                retention: Retention::Lru,
            }),
            Mode::Prefetch => Some(Policy {
                lookahead: 2,
                refine_load: false,
                stream_compute: false,
                retention: Retention::Frequency,
            }),
            Mode::LeanStream => Some(Policy {
                lookahead: 2,
                refine_load: true,
                stream_compute: true,
                retention: Retention::Frequency,
            }),
            Mode::Dense | Mode::Mmap => None,
        }
    }

    /// The ablation ladder of LeanStream's refinements, each step adding one part to the one
    /// before: on-demand with LRU (`serial`) → + compute chunks as their reads land
    /// (`overlapped`) → + speculate and refine reads (`refined-load`) → + keep the calibrated
    /// hot neurons (`leanstream`); then the retention that adds observed activity
    /// (`refined-retention`), which pays where active neurons carry over from token to token.
    pub fn ablation() -> [(&'static str, Policy); 5] {
        let serial = Policy {
            lookahead: 0,
            refine_load: false,
            stream_compute: false,
            retention: Retention::Lru,
        };
        let overlapped = Policy {
            stream_compute: true,
            ..serial
        };
        let load = Policy {
            lookahead: 2,
            refine_load: true,
            ..overlapped
        };
        let frequency = Policy {
            retention: Retention::Frequency,
            ..load
        };
        let activity = Policy {
            retention: Retention::Refined,
            ..load
        };
        [
            ("serial", serial),
            ("overlapped", overlapped),
            ("refined-load", load),
            ("leanstream", frequency),
            ("refined-retention", activity),
        ]
    }

    /// A policy by name: a cache-backed mode (`on-demand`, `prefetch`, `leanstream`) or a step
    /// of [`Policy::ablation`].
    pub fn named(name: &str) -> std::result::Result<Policy, String> {
        Policy::all()
            .find(|(n, _)| *n == name)
            .map(|(_, p)| p)
            .ok_or_else(|| {
                format!(
                    "unknown sparse policy `{name}` (one of {})",
                    Policy::names().join(", ")
                )
            })
    }

    /// Every name [`Policy::named`] knows, once each.
    pub fn names() -> Vec<&'static str> {
        let mut names: Vec<&str> = Vec::new();
        for (n, _) in Policy::all() {
            if !names.contains(&n) {
                names.push(n);
            }
        }
        names
    }

    /// The cache-backed modes' policies, then the ablation's steps (`leanstream` is both).
    fn all() -> impl Iterator<Item = (&'static str, Policy)> {
        [Mode::OnDemand, Mode::Prefetch, Mode::LeanStream]
            .into_iter()
            .filter_map(|m| Some((m.name(), Policy::for_mode(m)?)))
            .chain(Policy::ablation())
    }
}

/// Read priorities: every read of layer `l` outranks every read of a later layer; inside a
/// layer, reads the exact selection needs now outrank speculative ones, and better margins go
/// first.
fn read_priority(n_layers: usize, l: usize, margin: f32, needed_now: bool) -> f32 {
    let squashed = margin / (1.0 + margin.abs()); // (-1, 1)
    let band = (n_layers - l) as f32 * 1000.0;
    band + if needed_now { 600.0 } else { 0.0 } + 400.0 * squashed
}

/// The rows of a forward pass (at most [`MAX_BATCH`]) that need a chunk: bit `t` for row `t`.
type Rows = u64;
const _: () = assert!(MAX_BATCH <= Rows::BITS as usize);

/// A generation's FFN through the neuron cache, for one model. Owned by the one thread that runs
/// the model's sessions.
pub struct StreamingFfn {
    sm: Arc<SparseModel>,
    policy: Policy,
    selector: Selector,
    /// Declared before the cache: a GPU compute holds the cache's arena registered with the
    /// driver and must unregister it before the arena is freed.
    compute: Box<dyn ChunkCompute>,
    /// Declared before the cache too (fields drop in order): dropping the I/O engine joins its
    /// workers, which may still be reading into (and checking) slots of the cache's arena.
    io: Box<dyn IoEngine>,
    cache: NeuronCache,
    /// The GPU `compute` runs on, if `use_cuda` set it: a resize re-registers the arena with it.
    #[cfg(feature = "cuda")]
    gpu: Option<Arc<crate::backend::cuda::CudaBackend>>,
    precision: Precision,
    /// Count predictor recall against dense activations (measurement passes only).
    pub measure_recall: bool,
    stats: PipelineStats,
    tick: f32,                // accesses so far, the LRU clock
    activity: Vec<f32>,       // (total chunks) average of "any neuron active" when computed
    speculated: Vec<u32>,     // (n_layers) token count at which a layer was last speculated
    xn: Vec<f32>,             // (d_model) speculative input of a later layer
    margins: Vec<f32>,        // (chunks_per_layer) the best margin any row of the pass gives
    row_margins: Vec<f32>,    // (MAX_BATCH, chunks_per_layer) each row's own margins
    rows_of: Vec<Rows>,       // (chunks_per_layer) the rows of the pass that need each chunk
    h: Vec<f32>,              // (n_ff) recall measurement scratch
    acts: Vec<QuantizedActs>, // (rows of the pass, d_model) for Fast
    needed: Vec<usize>,       // chunks of this layer not yet Ready (for any row)
    ready: Vec<usize>,        // chunks of this layer Ready and pinned, not yet computed
    blocks: Blocks,           // the fixed-order sums of this layer
    done: Vec<Completion>,    // completions being processed
    failed: Option<(ChunkId, Error)>,
    /// (n_layers) the layers whose FFN this pipeline computes; the others are dense.
    layers: Vec<bool>,
}

impl std::fmt::Debug for StreamingFfn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingFfn")
            .field("model", &self.sm.path)
            .field("policy", &self.policy)
            .field("cache", &self.cache.stats())
            .field("io", &self.io.stats())
            .finish_non_exhaustive()
    }
}

impl StreamingFfn {
    /// A pipeline over `sm` with `policy`, a cache of `cache_bytes` and reads served by `io`.
    /// Refuses a cache too small to hold one layer's chunks (the minimum working set,
    /// [`ChunkLayout::floor_bytes`](crate::model::lsm::ChunkLayout::floor_bytes)), naming the
    /// bytes needed.
    pub fn new(
        sm: Arc<SparseModel>,
        selector: Selector,
        policy: Policy,
        cache_bytes: usize,
        io: Box<dyn IoEngine>,
        precision: Precision,
    ) -> Result<StreamingFfn> {
        let l = &sm.layout;
        let cache = NeuronCache::new(
            l.total_chunks(),
            l.chunk_bytes,
            cache_bytes as u64,
            l.floor_slots(),
        )?;
        Ok(StreamingFfn {
            policy,
            selector,
            cache,
            io,
            #[cfg(feature = "cuda")]
            gpu: None,
            precision,
            measure_recall: false,
            stats: PipelineStats::default(),
            tick: 0.0,
            activity: vec![0.0; l.total_chunks()],
            speculated: vec![u32::MAX; l.n_layers],
            xn: vec![0.0; l.d_model],
            margins: vec![0.0; l.chunks_per_layer],
            row_margins: vec![0.0; MAX_BATCH * l.chunks_per_layer],
            rows_of: vec![0; l.chunks_per_layer],
            h: vec![0.0; l.n_ff],
            compute: Box::new(CpuChunks),
            acts: Vec::new(),
            needed: Vec::with_capacity(l.chunks_per_layer),
            ready: Vec::with_capacity(l.chunks_per_layer),
            blocks: Blocks::new(l),
            done: Vec::with_capacity(l.total_chunks()),
            failed: None,
            layers: vec![true; l.n_layers],
            sm,
        })
    }

    /// Computes (and speculates about) only the layers `mask` marks: the FFN layers a plan
    /// streams by neuron, the others being computed dense by the forward pass.
    pub fn only_layers(&mut self, mask: &[bool]) {
        assert_eq!(mask.len(), self.layers.len(), "one flag per layer");
        self.layers = mask.to_vec();
    }

    /// Counters since the last reset (cache and I/O counters folded in).
    pub fn stats(&self) -> PipelineStats {
        let mut s = self.stats.clone();
        let c = self.cache.stats();
        s.hits = c.hits;
        s.misses = c.misses;
        // Holes a merged read bridged were read from storage and never used.
        let io = self.io.stats();
        s.bytes_unused = c.bytes_unused + io.gap_bytes;
        s.bytes_read = io.bytes + io.gap_bytes;
        s
    }

    /// Zeroes the counters (the cache keeps its contents).
    pub fn reset_stats(&mut self) {
        self.stats = PipelineStats::default();
        self.cache.reset_stats();
        self.io.reset_stats();
    }

    /// Runs the chunk computations on `gpu` from now on, reading the neuron cache in place
    /// (Jetson) or through a device twin (discrete GPUs); see `backend::cuda::CudaChunks`.
    #[cfg(feature = "cuda")]
    pub fn use_cuda(&mut self, gpu: Arc<crate::backend::cuda::CudaBackend>) -> Result<()> {
        let (base, len) = self.cache.arena();
        // SAFETY: the arena is this pipeline's cache's, which is dropped after `compute` (field
        // order), and holds only cache slots.
        let compute = unsafe {
            crate::backend::cuda::CudaChunks::new(Arc::clone(&gpu), base, len, &self.sm.layout)?
        };
        self.compute = Box::new(compute);
        self.gpu = Some(gpu);
        Ok(())
    }

    /// Bytes of the neuron cache's arena: what it costs the budget, an upper bound of its
    /// resident memory.
    pub fn cache_bytes(&self) -> usize {
        self.cache.resident_bytes() as usize
    }

    /// The smallest cache this pipeline runs with: one layer's chunks, in bytes (equal to
    /// [`ChunkLayout::floor_bytes`](crate::model::lsm::ChunkLayout::floor_bytes) of its file).
    pub fn cache_floor_bytes(&self) -> usize {
        self.cache.floor_bytes() as usize
    }

    /// The neuron cache, for inspection (which chunks it holds, its resident pages).
    pub fn cache(&self) -> &NeuronCache {
        &self.cache
    }

    /// The value of keeping chunk `c` under this policy's retention (higher stays longer).
    fn retention(&self, c: ChunkId) -> f32 {
        match self.policy.retention {
            Retention::Lru => self.tick,
            Retention::Frequency => self.sm.chunk_frequency[c as usize],
            Retention::Refined => {
                0.5 * self.activity[c as usize] + 0.5 * self.sm.chunk_frequency[c as usize]
            }
        }
    }

    /// Makes sure chunk `c` is cached or on its way. A needed chunk may evict anything
    /// evictable; a speculative one only what is worth less. Returns false if no slot could be
    /// had.
    fn request(&mut self, c: ChunkId, priority: f32, needed_now: bool) -> bool {
        match self.cache.lookup(c) {
            Lookup::Ready(_) => true,
            Lookup::Loading(_) => {
                if self.policy.refine_load {
                    self.io.reprioritize(c as u64, priority);
                }
                true
            }
            Lookup::Absent => {
                let value = self.retention(c);
                let evict = if needed_now {
                    Evict::Any
                } else {
                    Evict::NotHigher
                };
                let slot = self.cache.reserve(c, value, evict);
                let Some((_, target)) = slot else {
                    return false;
                };
                let layout = &self.sm.layout;
                let req = ReadRequest {
                    id: c as u64,
                    offset: layout.file_offset(c),
                    target,
                    priority,
                    check: Some(ChunkCheck {
                        crc32: self.sm.chunk_crc32[c as usize],
                        layer: layout.layer_of(c),
                        chunk: layout.chunk_of(c),
                    }),
                };
                // SAFETY: the target is a Loading slot of our cache; the cache hands it to no one
                // else and never reads or evicts it until `complete` or `abandon`, which we call
                // only for this id's completion or after a successful cancel. The I/O engine is
                // dropped (joining its workers) before the cache (field order).
                unsafe { self.io.submit(req) };
                true
            }
        }
    }

    /// Applies finished reads to the cache; waits up to `timeout` for at least one if `block`.
    fn collect(&mut self, block: bool) {
        self.done.clear();
        if block {
            let t = Instant::now();
            self.io
                .wait(&mut self.done, Some(Duration::from_millis(100)));
            self.stats.io_wait_ns += t.elapsed().as_nanos() as u64;
        } else {
            self.io.try_drain(&mut self.done);
        }
        self.apply_done();
    }

    /// Applies the completions in `self.done` to the cache. A failed read frees its slot: its
    /// bytes (unread, short or corrupted) never become a Ready chunk.
    fn apply_done(&mut self) {
        let mut done = std::mem::take(&mut self.done);
        for d in done.drain(..) {
            let c = d.id as ChunkId;
            if let Lookup::Loading(slot) = self.cache.lookup(c) {
                self.cache.complete(slot, d.result.is_ok());
            }
            if let Err(e) = d.result {
                self.failed = Some((c, e));
            }
        }
        // The buffer keeps its capacity: the per-token path allocates nothing.
        self.done = done;
    }

    /// Speculation at the start of layer `l`: queue reads for the chunks the predictor selects in
    /// layers `l..l + lookahead` from the current residual stream `x`.
    fn speculate(&mut self, l: usize, x: &[f32]) {
        let n_layers = self.sm.layout.n_layers;
        let token = self.stats.tokens as u32;
        for target in l..(l + self.policy.lookahead).min(n_layers) {
            if !self.layers[target] {
                continue;
            }
            if !self.policy.refine_load && self.speculated[target] == token {
                continue; // one-shot: each layer is predicted once per token
            }
            self.speculated[target] = token;
            let norm = &self.sm.model.weights.layers[target].ffn_norm;
            let eps = self.sm.model.weights.config.rms_eps;
            cpu::rmsnorm(&mut self.xn, x, norm, eps);
            let t = Instant::now();
            let xn = std::mem::take(&mut self.xn);
            self.selector
                .margins(&self.sm.layout, target, &xn, &mut self.margins);
            self.xn = xn;
            self.stats.predict_ns += t.elapsed().as_nanos() as u64;
            for c in 0..self.sm.layout.chunks_per_layer {
                let id = self.sm.layout.id(target, c);
                let m = self.margins[c];
                if m >= 0.0 {
                    self.request(id, read_priority(n_layers, target, m, false), false);
                } else if self.policy.refine_load {
                    self.cancel(id);
                }
            }
        }
    }

    /// Cancels a queued read of chunk `c`, freeing its slot; in-flight reads finish normally.
    fn cancel(&mut self, c: ChunkId) {
        if let Lookup::Loading(slot) = self.cache.lookup(c)
            && self.io.cancel(c as u64)
        {
            self.cache.abandon(slot);
            self.stats.reads_cancelled += 1;
        }
    }

    /// Computes the blocks whose chunks are all in (see [`blocks`]) for the rows of the pass
    /// (`xn` holds one `d_model`-value row per token), then unpins their chunks and updates
    /// their retention from what the activations showed. On an error (a GPU failure) every
    /// pinned chunk is unpinned and the error returned.
    fn compute_ready(&mut self, l: usize, xn: &[f32]) -> Result<()> {
        let sm = &*self.sm;
        let layout = &sm.layout;
        let math = ChunkMath {
            layout,
            kernels: Kernels::best(),
            activation: sm.model.weights.config.activation,
            threshold: sm.thresholds[l],
            fast: None,
        };
        let acts = (self.precision == Precision::Fast).then_some(&self.acts[..]);
        let cache = &self.cache;
        let bytes_of = |c: usize| match cache.lookup(layout.id(l, c)) {
            Lookup::Ready(slot) => cache.data(slot),
            _ => unreachable!("chunk {c} of layer {l} is computed only when Ready and pinned"),
        };
        let computed = self.blocks.compute_complete(
            l,
            &self.rows_of,
            &math,
            acts,
            xn,
            self.compute.as_mut(),
            &bytes_of,
        );
        match computed {
            Ok(active) => self.stats.active_neurons += active as u64,
            Err(e) => {
                for &c in &self.ready {
                    self.cache.unpin(layout.id(l, c));
                }
                self.ready.clear();
                return Err(e);
            }
        }
        if self.blocks.computed().is_empty() {
            return Ok(());
        }
        let refined = self.policy.retention == Retention::Refined;
        for i in 0..self.blocks.computed().len() {
            for c in self.blocks.chunks(self.blocks.computed()[i]) {
                let rows = self.rows_of[c];
                if rows == 0 {
                    continue;
                }
                let id = layout.id(l, c);
                self.cache.unpin(id);
                let neurons = layout.neurons(c).len() as u64;
                self.stats.computed_neurons += neurons * u64::from(rows.count_ones());
                if refined {
                    let any = (0..MAX_BATCH)
                        .filter(|&t| rows & (1 << t) != 0)
                        .any(|t| self.blocks.any_active(layout, t, c));
                    let a = &mut self.activity[id as usize];
                    *a = 0.5 * *a + if any { 0.5 } else { 0.0 };
                }
                // Calibrated frequency never changes: the value set at `reserve` stands.
                if self.policy.retention != Retention::Frequency {
                    let value = self.retention(id);
                    self.cache.set_retention(id, value);
                }
            }
        }
        let blocks = &self.blocks;
        self.ready
            .retain(|&c| !blocks.computed().contains(&blocks.block_of(c)));
        self.tick += 1.0;
        Ok(())
    }

    /// Moves the needed chunks that are Ready into `self.ready`, pinning them.
    fn take_ready(&mut self, l: usize) {
        let layout = &self.sm.layout;
        let cache = &mut self.cache;
        let ready = &mut self.ready;
        let blocks = &mut self.blocks;
        self.needed
            .retain(|&c| match cache.lookup(layout.id(l, c)) {
                Lookup::Ready(_) => {
                    cache.pin(layout.id(l, c));
                    ready.push(c);
                    blocks.arrived(c);
                    false
                }
                _ => true,
            });
    }
}

impl FfnExecutor for StreamingFfn {
    fn covers(&self, l: usize) -> bool {
        self.layers[l]
    }

    fn begin_layer(&mut self, l: usize, x: &[f32]) {
        if l == 0 {
            self.stats.tokens += 1;
            self.cache.begin_token();
            self.failed = None;
        }
        self.collect(false);
        if self.policy.lookahead > 0 {
            self.speculate(l, x);
        }
    }

    fn ffn(&mut self, l: usize, layer: &LayerWeights, xn: &[f32], out: &mut [f32]) -> Result<()> {
        self.ffn_rows(l, layer, xn, out)
    }

    /// The rows of a pass at once: each row's exact selection, and the union of them read and
    /// computed as one layer's needs, each chunk applied to every row that selected it. Hits,
    /// misses and `chunks_needed` count each chunk of the union once (it is read once);
    /// `computed_neurons` and `active_neurons` count every row's work.
    fn ffn_rows(
        &mut self,
        l: usize,
        layer: &LayerWeights,
        xn: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let n_layers = self.sm.layout.n_layers;
        let (d, cpl) = (self.sm.layout.d_model, self.sm.layout.chunks_per_layer);
        let n = xn.len() / d;
        assert!(
            (1..=MAX_BATCH).contains(&n) && xn.len() == n * d && out.len() == n * d,
            "{} inputs and {} outputs are not 1..={MAX_BATCH} rows of {d}",
            xn.len(),
            out.len()
        );
        let t = Instant::now();
        for (xn, m) in xn
            .chunks_exact(d)
            .zip(self.row_margins.chunks_exact_mut(cpl))
        {
            self.selector.margins(&self.sm.layout, l, xn, m);
        }
        self.stats.predict_ns += t.elapsed().as_nanos() as u64;
        if self.measure_recall {
            let sm = Arc::clone(&self.sm);
            let rows = xn.chunks_exact(d).zip(self.row_margins.chunks_exact(cpl));
            for (xn, margins) in rows {
                super::recall::count(
                    &sm.layout,
                    layer,
                    sm.model.weights.config.activation,
                    sm.thresholds[l],
                    xn,
                    margins,
                    &mut self.h,
                    &mut self.stats,
                );
            }
        }
        if self.precision == Precision::Fast {
            while self.acts.len() < n {
                self.acts.push(QuantizedActs::new(d));
            }
            for (acts, xn) in self.acts.iter_mut().zip(xn.chunks_exact(d)) {
                acts.quantize(xn);
            }
        }
        out.fill(0.0);
        // Per chunk: the rows that select it, and the best margin among them (what its read
        // priority and a cancellation go by).
        for c in 0..cpl {
            let (mut rows, mut best) = (0, f32::NEG_INFINITY);
            for t in 0..n {
                let m = self.row_margins[t * cpl + c];
                best = best.max(m);
                if m >= 0.0 {
                    rows |= 1 << t;
                }
            }
            self.rows_of[c] = rows;
            self.margins[c] = best;
        }
        self.blocks.begin(n, &self.rows_of[..cpl]);

        // The exact selection: count hits and misses, cancel what it dropped, and make sure
        // everything it needs is cached or on its way (urgently).
        self.needed.clear();
        for c in 0..self.sm.layout.chunks_per_layer {
            let id = self.sm.layout.id(l, c);
            let m = self.margins[c];
            if m < 0.0 {
                if self.policy.refine_load {
                    self.cancel(id);
                }
                continue;
            }
            self.stats.chunks_needed += 1;
            self.needed.push(c);
        }
        // Pin what is already here before any read of this layer can evict it, request the
        // rest, then count each needed chunk once: a hit if it was cached before this token.
        for i in 0..self.needed.len() {
            self.cache.access(self.sm.layout.id(l, self.needed[i]));
        }
        self.take_ready(l);
        for i in 0..self.needed.len() {
            let c = self.needed[i];
            let p = read_priority(n_layers, l, self.margins[c], true);
            let id = self.sm.layout.id(l, c);
            if self.request(id, p, true) {
                // Marks the slot used now that it exists (the count was taken above).
                self.cache.mark_used(id);
            }
        }

        // Stages: compute the blocks that are in, then wait for arrivals. A serialised policy
        // computes only once everything is in, unless it must free slots for chunks still
        // unread.
        self.failed = None;
        loop {
            if let Some((c, e)) = self.failed.take()
                && self.sm.layout.layer_of(c) == l
                && self.needed.contains(&self.sm.layout.chunk_of(c))
            {
                for &r in &self.ready {
                    self.cache.unpin(self.sm.layout.id(l, r));
                }
                self.ready.clear();
                return Err(match e {
                    e @ Error::ChunkChecksum { .. } => e,
                    e => Error::ChunkRead {
                        path: self.sm.path.clone(),
                        layer: l,
                        chunk: self.sm.layout.chunk_of(c),
                        source: Box::new(e),
                    },
                });
            }
            let mut starved = false;
            for i in 0..self.needed.len() {
                let (c, id) = (self.needed[i], self.sm.layout.id(l, self.needed[i]));
                if matches!(self.cache.lookup(id), Lookup::Absent) {
                    let p = read_priority(n_layers, l, self.margins[c], true);
                    starved |= !self.request(id, p, true);
                }
            }
            if self.policy.stream_compute || self.needed.is_empty() || starved {
                self.compute_ready(l, xn)?;
            }
            if self.needed.is_empty() && self.ready.is_empty() {
                break;
            }
            self.collect(true);
            self.take_ready(l);
        }
        self.blocks.finish(out);

        // Refined retention: cached chunks of this layer the exact selection passed over count
        // as inactive this token.
        if self.policy.retention == Retention::Refined {
            for c in 0..self.sm.layout.chunks_per_layer {
                if self.margins[c] < 0.0 {
                    let id = self.sm.layout.id(l, c);
                    if matches!(self.cache.lookup(id), Lookup::Ready(_)) {
                        self.activity[id as usize] *= 0.5;
                        let value = self.retention(id);
                        self.cache.set_retention(id, value);
                    }
                }
            }
        }
        Ok(())
    }
}
