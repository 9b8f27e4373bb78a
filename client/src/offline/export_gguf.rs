//! `leanstream export-gguf`: `.lsm` → GGUF, so that llama.cpp can run exactly the same weights
//! (see `leanstream_engine::model::lsm::export`).

use std::path::PathBuf;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use leanstream_engine::model::lsm::export;

#[derive(Args, Debug)]
pub struct ExportGgufArgs {
    /// The `.lsm` file to export.
    pub src: PathBuf,
    /// Output GGUF path (written as `OUT.partial`, renamed when complete).
    #[arg(short = 'o', long = "output")]
    pub dst: PathBuf,
}

pub fn run(args: ExportGgufArgs) -> anyhow::Result<()> {
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {elapsed})",
        )
        .map_err(anyhow::Error::msg)?
        .progress_chars("=> "),
    );
    bar.set_message("exporting tensors");
    let report = export::export_gguf(&args.src, &args.dst, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let report = report?;
    println!(
        "wrote {}: {:.1} MiB, {} tensors, architecture {}, vocabulary {} tokens",
        args.dst.display(),
        report.file_bytes as f64 / (1 << 20) as f64,
        report.tensors,
        report.architecture,
        report.vocab,
    );
    if report.tokens_dropped + report.tokens_padded > 0 {
        println!(
            "tokenizer fitted to the embedding: {} tokens left out ({} merges with them), {} \
             placeholders added",
            report.tokens_dropped, report.merges_dropped, report.tokens_padded
        );
    }
    if report.permuted_qk {
        println!("Q/K rows permuted from Hugging Face order to llama.cpp's");
    }
    if report.down_max_abs_change == 0.0 {
        println!(
            "ffn_down re-encoded as {} rows: lossless",
            report.down_dtype
        );
    } else {
        println!(
            "ffn_down re-encoded as {} rows: max abs change {:.3e}, relative RMS change {:.3e}",
            report.down_dtype, report.down_max_abs_change, report.down_rms_rel_change
        );
    }
    Ok(())
}
