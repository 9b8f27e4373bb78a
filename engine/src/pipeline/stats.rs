//! Counters a pipeline keeps while it runs; reports turn them into per-token figures.

/// What a sparse pipeline did, summed over the tokens it ran since the last reset.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PipelineStats {
    /// Tokens run (each through every layer).
    pub tokens: u64,
    /// Chunks the exact selection asked for, summed over layers and passes: a chunk that several
    /// rows of one pass need counts once (it is read and looked up once).
    pub chunks_needed: u64,
    /// Needed chunks that were in the cache before the token started.
    pub hits: u64,
    /// Needed chunks that had to come from storage during the token (read on demand, or by a
    /// speculative read issued during the same token).
    pub misses: u64,
    /// Bytes the I/O workers read from storage.
    pub bytes_read: u64,
    /// Bytes read into the cache and dropped without ever being computed.
    pub bytes_unused: u64,
    /// Read requests cancelled before they started.
    pub reads_cancelled: u64,
    /// Time the compute thread spent blocked waiting for reads, in nanoseconds.
    pub io_wait_ns: u64,
    /// Time spent in the predictor, in nanoseconds.
    pub predict_ns: u64,
    /// Neurons computed (gate and up dots taken) and neurons found active among them.
    pub computed_neurons: u64,
    pub active_neurons: u64,
    /// Recall measurement (only when enabled): neurons truly active under the threshold, and how
    /// many of them were in selected chunks.
    pub truth_active: u64,
    pub truth_selected: u64,
}

/// Applies `$op` to every counter of two stats.
macro_rules! each_counter {
    ($a:expr, $b:expr, $op:ident) => {{
        let (a, b) = ($a, $b);
        a.tokens = a.tokens.$op(b.tokens);
        a.chunks_needed = a.chunks_needed.$op(b.chunks_needed);
        a.hits = a.hits.$op(b.hits);
        a.misses = a.misses.$op(b.misses);
        a.bytes_read = a.bytes_read.$op(b.bytes_read);
        a.bytes_unused = a.bytes_unused.$op(b.bytes_unused);
        a.reads_cancelled = a.reads_cancelled.$op(b.reads_cancelled);
        a.io_wait_ns = a.io_wait_ns.$op(b.io_wait_ns);
        a.predict_ns = a.predict_ns.$op(b.predict_ns);
        a.computed_neurons = a.computed_neurons.$op(b.computed_neurons);
        a.active_neurons = a.active_neurons.$op(b.active_neurons);
        a.truth_active = a.truth_active.$op(b.truth_active);
        a.truth_selected = a.truth_selected.$op(b.truth_selected);
    }};
}

impl PipelineStats {
    /// Adds `other`'s counters to these.
    pub fn add(&mut self, other: &PipelineStats) {
        each_counter!(self, other, wrapping_add);
    }

    /// The counters accumulated since `before` was taken from the same pipeline.
    pub fn since(&self, before: &PipelineStats) -> PipelineStats {
        let mut d = self.clone();
        each_counter!(&mut d, before, saturating_sub);
        d
    }

    /// Needed chunks that missed the cache, as a share of all needed chunks.
    pub fn miss_ratio(&self) -> f64 {
        ratio(self.misses, self.hits + self.misses)
    }

    /// Share of the bytes read that were never used.
    pub fn redundant_fraction(&self) -> f64 {
        ratio(self.bytes_unused, self.bytes_read)
    }

    /// Share of truly active neurons that the selection covered (NaN when not measured).
    pub fn recall(&self) -> f64 {
        if self.truth_active == 0 {
            f64::NAN
        } else {
            ratio(self.truth_selected, self.truth_active)
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}
