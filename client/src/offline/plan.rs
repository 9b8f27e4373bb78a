//! `leanstream plan`: what a memory budget keeps resident and what it streams, the bytes read
//! per token, and (with `--disk-probe`) the disk's read curve and the tokens per second the disk
//! alone allows.

use std::path::PathBuf;

use clap::Args;
use leanstream_engine::bench::disk_curve::{self, CurveOptions};
use leanstream_engine::forward::Model;
use leanstream_engine::kv::KvType;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A GGUF or `.lsm` file.
    #[arg(long)]
    pub model: PathBuf,
    /// Bytes the whole process may hold (e.g. `60MB`, `64MiB`).
    #[arg(long, value_parser = super::parse_size)]
    pub budget: u64,
    /// Tokens of context to plan one session for.
    #[arg(long, default_value_t = super::PLANNED_CONTEXT)]
    pub context: usize,
    #[arg(long, default_value_t = KvType::default())]
    pub kv_type: KvType,
    /// Measure the disk under the model file as a curve (O_DIRECT, shuffled reads of 4 KiB to
    /// 1 MiB, 1 to 64 in flight; about 10 s), print it, and predict the storage-bound tokens/s.
    #[arg(long)]
    pub disk_probe: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let model = Model::load_within(&args.model, args.budget, args.context, args.kv_type)?;
    let plan = model.plan().expect("load_within attaches its plan");
    print!("{}", plan.table());
    if args.disk_probe {
        let len = std::fs::metadata(&args.model)?.len();
        let curve = disk_curve::measure(&args.model, 0..len, &CurveOptions::default())?;
        print!("{}", curve.table());
        // The planner's stream reads 1 MiB pieces, one at a time.
        let bw = curve.bytes_per_s(1 << 20, 1).unwrap_or(0.0);
        let bound = plan
            .io_bound_tok_s(bw)
            .map_or("unbounded (nothing streams)".to_string(), |t| {
                format!("{t:.1} tok/s")
            });
        println!(
            "storage bound     {bound} (1 MiB reads, one at a time: {:.0} MB/s)",
            bw / 1e6
        );
    }
    Ok(())
}
