//! Which chunks of a layer to compute: neuron scores from a predictor, turned into one margin per
//! chunk (`max` over its neurons of `score − cutoff`); a chunk is selected when its margin is ≥ 0.

use crate::model::lsm::ChunkLayout;

/// Scores the neurons of a layer from its normalised FFN input.
pub trait NeuronScorer: Send + std::fmt::Debug {
    /// Writes one score per neuron (stored order) of layer `l` for input `xn` into `out`.
    fn score(&mut self, l: usize, xn: &[f32], out: &mut [f32]);
    /// Score at or above which a neuron of layer `l` is predicted active.
    fn cutoff(&self, l: usize) -> f32;
    /// Bytes of the scorer's tables.
    fn bytes(&self) -> usize;
    /// Name for reports.
    fn name(&self) -> &'static str;
}

/// Selects every chunk: sparsity off (the oracle configuration, equal to the dense FFN).
#[derive(Debug, Default)]
pub struct AllNeurons;

impl NeuronScorer for AllNeurons {
    fn score(&mut self, _l: usize, _xn: &[f32], out: &mut [f32]) {
        out.fill(f32::INFINITY);
    }
    fn cutoff(&self, _l: usize) -> f32 {
        0.0
    }
    fn bytes(&self) -> usize {
        0
    }
    fn name(&self) -> &'static str {
        "all"
    }
}

/// A scorer plus its scratch: turns an input into per-chunk margins.
#[derive(Debug)]
pub struct Selector {
    scorer: Box<dyn NeuronScorer>,
    scores: Vec<f32>, // (n_ff)
}

impl Selector {
    /// A selector for a model with `n_ff` neurons per layer.
    pub fn new(scorer: Box<dyn NeuronScorer>, n_ff: usize) -> Selector {
        Selector {
            scorer,
            scores: vec![0.0; n_ff],
        }
    }

    /// The scorer's report name and table bytes.
    pub fn describe(&self) -> (&'static str, usize) {
        (self.scorer.name(), self.scorer.bytes())
    }

    /// Writes the margin of every chunk of layer `l` into `out` (`chunks_per_layer` values);
    /// also leaves the neuron scores in [`Selector::scores`].
    pub fn margins(&mut self, layout: &ChunkLayout, l: usize, xn: &[f32], out: &mut [f32]) {
        self.scorer.score(l, xn, &mut self.scores);
        let cut = self.scorer.cutoff(l);
        for (c, m) in out.iter_mut().enumerate() {
            *m = self.scores[layout.neurons(c)]
                .iter()
                .fold(f32::NEG_INFINITY, |a, &s| a.max(s - cut));
        }
    }

    /// Neuron scores of the last [`Selector::margins`] call.
    pub fn scores(&self) -> &[f32] {
        &self.scores
    }

    /// The score cut-off of layer `l`.
    pub fn cutoff(&self, l: usize) -> f32 {
        self.scorer.cutoff(l)
    }
}
