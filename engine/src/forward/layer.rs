//! The one forward pass: the steps of a layer, in order, for every backend. The CPU pass
//! ([`super::pass::Pass`]) and the GPU pass ([`super::gpu`]) implement [`LayerSteps`] over their
//! own buffers; [`layers`] strings the steps together and reads the architecture's choices from
//! the configuration (which layers attend through a sliding window, the FFN's activation, which
//! layers a sparse executor computes), so a backend implements each step once and cannot run a
//! model in another order. What a layer's own weights carry — biases, QK-norms, post-norms —
//! each step applies where the layer has it.

use super::FfnExecutor;
use crate::Result;
use crate::model::{FfnActivation, ModelConfig};

/// Asked before each layer of a pass: true to give the pass up there.
pub(super) type Stop<'s> = &'s (dyn Fn() -> bool + Sync);

/// A [`Stop`] for passes that always run to the end.
pub(super) fn never() -> bool {
    false
}

/// A layer's two sub-blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Block {
    Attention,
    Ffn,
}

/// The steps of one layer over a batch of rows. Each reads and writes the backend's buffers:
/// the residual stream `x`, its normed copy `xn`, the attention's `q`, `k`, `v` and output, and
/// a sub-block's output `proj`.
pub(super) trait LayerSteps {
    /// Before anything else of layer `l`: a sparse executor sees each row's residual stream.
    fn begin_layer(&mut self, l: usize, exec: Option<&mut dyn FfnExecutor>) -> Result<()>;
    /// `xn ← RMSNorm(x) · w`, `w` the layer's input norm of `block`.
    fn norm_input(&mut self, l: usize, block: Block) -> Result<()>;
    /// `q, k, v ← W xn` for the layer's three projections.
    fn qkv(&mut self, l: usize) -> Result<()>;
    /// Each row's `q`, `k`, `v` finished and stored: biases added and QK-norms applied where the
    /// layer has them, RoPE at the row's position with the layer's frequencies, then `k` and `v`
    /// written to the row's cache at its position.
    fn position(&mut self, l: usize) -> Result<()>;
    /// Causal attention of each row over its cache, positions `pos + 1 - window ..= pos` (all
    /// up to `pos` without a window), into the attention output.
    fn attend(&mut self, l: usize, window: Option<usize>) -> Result<()>;
    /// `proj ← W_o · attention output`.
    fn project_out(&mut self, l: usize) -> Result<()>;
    /// `proj ← FFN(xn)`: from the model's weights with `activation`, or by `exec`.
    fn ffn(
        &mut self,
        l: usize,
        activation: FfnActivation,
        exec: Option<&mut dyn FfnExecutor>,
    ) -> Result<()>;
    /// `x += norm(proj)`, `norm` the layer's post-norm of `block` where it has one.
    fn add_residual(&mut self, l: usize, block: Block) -> Result<()>;
}

/// Every layer of `c`, unless `stop` says so before one: then false, with the layers before it
/// run. `exec` computes the FFN of the layers it covers; the model's weights the others.
pub(super) fn layers(
    s: &mut impl LayerSteps,
    c: &ModelConfig,
    mut exec: Option<&mut dyn FfnExecutor>,
    stop: Stop<'_>,
) -> Result<bool> {
    for l in 0..c.n_layers {
        if stop() {
            return Ok(false);
        }
        s.begin_layer(l, reborrow(&mut exec))?;
        s.norm_input(l, Block::Attention)?;
        s.qkv(l)?;
        s.position(l)?;
        s.attend(l, c.layer_attention(l).window)?;
        s.project_out(l)?;
        s.add_residual(l, Block::Attention)?;
        s.norm_input(l, Block::Ffn)?;
        let by = reborrow(&mut exec).filter(|e| e.covers(l));
        s.ffn(l, c.activation, by)?;
        s.add_residual(l, Block::Ffn)?;
    }
    Ok(true)
}

/// The executor for one call (an `Option` of a trait object does not shorten its lifetime by
/// itself).
fn reborrow<'s>(exec: &'s mut Option<&mut dyn FfnExecutor>) -> Option<&'s mut dyn FfnExecutor> {
    exec.as_mut().map(|e| &mut **e as &mut dyn FfnExecutor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LayerWeights, SlidingWindow};

    /// Records the steps it is asked for.
    #[derive(Default)]
    struct Recorder(Vec<String>);

    impl LayerSteps for Recorder {
        fn begin_layer(&mut self, l: usize, exec: Option<&mut dyn FfnExecutor>) -> Result<()> {
            self.0.push(format!("begin {l} {}", exec.is_some()));
            Ok(())
        }
        fn norm_input(&mut self, l: usize, block: Block) -> Result<()> {
            self.0.push(format!("norm {l} {block:?}"));
            Ok(())
        }
        fn qkv(&mut self, l: usize) -> Result<()> {
            self.0.push(format!("qkv {l}"));
            Ok(())
        }
        fn position(&mut self, l: usize) -> Result<()> {
            self.0.push(format!("position {l}"));
            Ok(())
        }
        fn attend(&mut self, l: usize, window: Option<usize>) -> Result<()> {
            self.0.push(format!("attend {l} {window:?}"));
            Ok(())
        }
        fn project_out(&mut self, l: usize) -> Result<()> {
            self.0.push(format!("out {l}"));
            Ok(())
        }
        fn ffn(
            &mut self,
            l: usize,
            activation: FfnActivation,
            exec: Option<&mut dyn FfnExecutor>,
        ) -> Result<()> {
            self.0
                .push(format!("ffn {l} {activation:?} {}", exec.is_some()));
            Ok(())
        }
        fn add_residual(&mut self, l: usize, block: Block) -> Result<()> {
            self.0.push(format!("residual {l} {block:?}"));
            Ok(())
        }
    }

    /// Covers odd layers only.
    struct OddLayers;

    impl FfnExecutor for OddLayers {
        fn covers(&self, l: usize) -> bool {
            l % 2 == 1
        }
        fn ffn(&mut self, _: usize, _: &LayerWeights, _: &[f32], _: &mut [f32]) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn layers_run_the_steps_in_order_with_the_architectures_choices() {
        let mut c = ModelConfig::without_features();
        c.n_layers = 3;
        c.activation = FfnActivation::GeluTanh;
        c.sliding_window = Some(SlidingWindow {
            window: 4,
            global_every: 3,
            rope_base: 10_000.0,
        });
        let mut r = Recorder::default();
        assert!(layers(&mut r, &c, Some(&mut OddLayers), &|| false).expect("layers"));
        let layer = |l: usize, window: &str, by: bool| {
            vec![
                format!("begin {l} true"),
                format!("norm {l} Attention"),
                format!("qkv {l}"),
                format!("position {l}"),
                format!("attend {l} {window}"),
                format!("out {l}"),
                format!("residual {l} Attention"),
                format!("norm {l} Ffn"),
                format!("ffn {l} GeluTanh {by}"),
                format!("residual {l} Ffn"),
            ]
        };
        let want = [
            layer(0, "Some(4)", false),
            layer(1, "Some(4)", true),
            layer(2, "None", false),
        ]
        .concat();
        assert_eq!(r.0, want);

        let mut r = Recorder::default();
        let asked = std::sync::atomic::AtomicUsize::new(0);
        let stop = || asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= 2;
        assert!(!layers(&mut r, &c, None, &stop).expect("layers"));
        assert_eq!(r.0.len(), 20, "two layers before the stop: {:?}", r.0);
    }
}
