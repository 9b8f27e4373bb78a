//! Test fixtures: tiny seeded models (the engine's `TinyLlama`: 2 layers, 128 FFN neurons,
//! converted with 16-neuron chunks, so 8 chunks per layer) in a temporary model directory, and
//! configurations over that directory. Converting and calibrating one takes milliseconds.

#![allow(clippy::unwrap_used)]

use leanstream_engine::calibrate::{self, CalibrateOptions};
use leanstream_engine::model::gguf::{TinyArch, TinyLlama};
use leanstream_engine::quant::DType;

use crate::config::Params;
use crate::models::{self, ModelFile};

/// Calibration (and held-out) text for the tiny models: their vocabulary is printable ASCII.
pub const TEXT: &str = "the cat sat on the mat and the dog sat on the log. a bird sang in the \
    tree while the sun went down over the hill, and the cat and the dog went home to eat.";

/// A temporary directory with a `models/` directory in it.
pub struct Fixture {
    pub dir: tempfile::TempDir,
}

impl Fixture {
    pub fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("models")).unwrap();
        Fixture { dir }
    }

    fn models(&self) -> std::path::PathBuf {
        self.dir.path().join("models").canonicalize().unwrap()
    }

    /// Writes `models/NAME.gguf` (a tiny model, Q4_1) and returns it.
    pub fn gguf(&self, name: &str) -> ModelFile {
        let path = self.models().join(format!("{name}.gguf"));
        TinyLlama::new(5).write_gguf(&path, DType::Q4_1).unwrap();
        models::resolve(&self.models(), name).unwrap()
    }

    /// Writes `models/NAME.gguf`: a tiny model 12 layers deep in f32, so that a memory plan
    /// can stream some of its layers (a ring of a few layers is then well under the model).
    pub fn deep_gguf(&self, name: &str) -> ModelFile {
        let path = self.models().join(format!("{name}.gguf"));
        TinyLlama::with_layers(5, TinyArch::Llama, 12)
            .write_gguf(&path, DType::F32)
            .unwrap();
        models::resolve(&self.models(), name).unwrap()
    }

    /// Writes `models/NAME.lsm` converted from the tiny model, calibrated for `sparsity` when
    /// given, and returns it.
    pub fn lsm(&self, name: &str, sparsity: Option<f32>) -> ModelFile {
        let src = self.dir.path().join(format!("{name}.gguf"));
        let converted = self.dir.path().join(format!("{name}.lsm"));
        leanstream_engine::testing::tiny_lsm(5, &src, &converted).unwrap();
        let dst = self.models().join(format!("{name}.lsm"));
        match sparsity {
            None => {
                std::fs::rename(&converted, &dst).unwrap();
            }
            Some(sparsity) => {
                let opts = CalibrateOptions {
                    sparsity,
                    window: 32,
                    ..Default::default()
                };
                calibrate::calibrate(&converted, &dst, TEXT, TEXT, &opts, &mut |_, _, _| {})
                    .unwrap();
            }
        }
        models::resolve(&self.models(), name).unwrap()
    }

    /// Writes `models/NAME.lsm`: a synthetic model of four tiny layers with one-neuron bundles
    /// and planted sparsity `sparsity`, calibrated by construction (per-neuron selection
    /// probabilities included), and returns it.
    pub fn synth_lsm(&self, name: &str, sparsity: f32) -> ModelFile {
        use leanstream_engine::model::lsm::synth::{
            SynthOptions, SynthShape, SynthTokenizer, synthesize,
        };
        let mut opts = SynthOptions::new(SynthShape {
            n_layers: 4,
            ..SynthShape::TINY
        });
        opts.sparsity = sparsity;
        opts.chunk_neurons = 1;
        let path = self.models().join(format!("{name}.lsm"));
        synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |_, _| {}).unwrap();
        models::resolve(&self.models(), name).unwrap()
    }

    /// Validated parameters: `[models] dir` is the fixture's, then `toml` (e.g. `[models.NAME]`
    /// tables); precision is exact by default.
    pub fn params(&self, toml: &str) -> Params {
        let file = self.dir.path().join("leanstreamd.toml");
        std::fs::write(
            &file,
            format!("[models]\ndir = \"{}\"\n{toml}\n", self.models().display()),
        )
        .unwrap();
        Params::load(&file, true).unwrap()
    }
}
