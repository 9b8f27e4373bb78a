//! `leanstream convert`: GGUF / safetensors → `.lsm`.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use leanstream_engine::model::lsm;
use leanstream_engine::quant::DType;

#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum DownType {
    /// q8_0, unless q5_0 makes a chunk cost fewer bytes per neuron (its bundles fit fewer
    /// pages: 7B shapes, not SmolLM2's or Gemma 3's).
    #[default]
    Auto,
    /// ~1.06 bytes per value, relative RMS error ~4e-3 (see `docs/lsm.md` and
    /// `docs/bench/sparse.md` for the measured effect on perplexity).
    #[value(name = "q8_0")]
    Q8_0,
    /// ~0.69 bytes per value: smaller neuron bundles, so more neurons per read.
    #[value(name = "q5_0")]
    Q5_0,
    /// ~0.56 bytes per value.
    #[value(name = "q4_0")]
    Q4_0,
    /// 2 bytes per value, relative error ~1e-4 on Q4 sources.
    F16,
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// A GGUF file or a Hugging Face safetensors directory.
    pub src: PathBuf,
    /// Output `.lsm` path.
    #[arg(short = 'o', long = "output")]
    pub dst: PathBuf,
    /// Neurons per 4 KiB-aligned chunk (the unit of reading and caching); default: as many as
    /// fit one 4 KiB page.
    #[arg(long)]
    pub chunk_neurons: Option<usize>,
    /// Storage type of the transposed down columns.
    #[arg(long, value_enum, default_value_t)]
    pub down_type: DownType,
}

pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let model = leanstream_engine::model::load_imported(&args.src)?;
    let opts = lsm::ConvertOptions {
        chunk_neurons: args.chunk_neurons,
        down_dtype: match args.down_type {
            DownType::Auto => lsm::default_down_dtype(&model, args.chunk_neurons)?,
            DownType::F16 => DType::F16,
            DownType::Q8_0 => DType::Q8_0,
            DownType::Q5_0 => DType::Q5_0,
            DownType::Q4_0 => DType::Q4_0,
        },
    };
    let bar = ProgressBar::new(model.config.n_layers as u64).with_style(
        ProgressStyle::with_template("{msg} [{bar:30}] layer {pos}/{len} ({elapsed})")
            .map_err(anyhow::Error::msg)?
            .progress_chars("=> "),
    );
    bar.set_message("converting FFN bundles");
    let report = lsm::convert(&model, &args.dst, &opts, &mut |done, _| {
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    println!(
        "wrote {}: {:.1} MiB (resident {:.1} MiB, streamed {:.1} MiB in {} B chunks of {} \
         neurons, padding {:.1} %)",
        args.dst.display(),
        report.file_bytes as f64 / (1 << 20) as f64,
        report.resident_bytes as f64 / (1 << 20) as f64,
        report.streamed_bytes as f64 / (1 << 20) as f64,
        report.chunk_bytes,
        report.chunk_neurons,
        100.0 * report.padding_bytes as f64 / report.streamed_bytes.max(1) as f64,
    );
    println!(
        "down columns stored as {}: max abs error {:.3e}, relative RMS error {:.3e}",
        opts.down_dtype, report.down_error.max_abs, report.down_error.rms_rel
    );
    Ok(())
}
