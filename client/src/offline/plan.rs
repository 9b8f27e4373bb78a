//! `leanstream plan`: what a memory budget keeps resident and what it streams, the bytes read
//! per token, and (with `--disk-probe`) the disk's read curve and the tokens per second the disk
//! alone allows.

use std::path::PathBuf;

use clap::Args;
use leanstream_engine::bench::disk_curve::{self, CurveOptions};
use leanstream_engine::forward::Model;
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::executor::IO_DEPTH;
use leanstream_engine::plan::{DiskSpeeds, PlacementPolicy};
use leanstream_engine::stream::READERS;

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
    /// `auto` lets the plan stream FFN layers of a calibrated `.lsm` by neuron where that reads
    /// faster than dense; `dense` never does.
    #[arg(long, default_value_t = PlacementPolicy::Auto)]
    pub placement: PlacementPolicy,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let model = Model::load_within_placed(
        &args.model,
        args.budget,
        args.context,
        args.kv_type,
        args.placement,
    )?;
    let plan = model.plan().expect("load_within attaches its plan");
    print!("{}", plan.table());
    if args.disk_probe {
        let len = std::fs::metadata(&args.model)?.len();
        let curve = disk_curve::measure(&args.model, 0..len, &CurveOptions::default())?;
        print!("{}", curve.table());
        // The dense stream reads 512 KiB requests, 4 in flight; chunks go out 32 at a time.
        let disk = DiskSpeeds {
            dense: curve.bytes_per_s(512 << 10, READERS).unwrap_or(0.0),
            sparse: curve.bytes_per_s(8 << 10, IO_DEPTH).unwrap_or(0.0),
        };
        let bound = plan
            .io_bound_tok_s(disk)
            .map_or("unbounded (nothing streams)".to_string(), |t| {
                format!("{t:.2} tok/s")
            });
        println!(
            "storage bound     {bound} (dense: 512 KiB reads, {READERS} in flight, {:.0} MB/s; \
             by neuron: 8 KiB reads, {IO_DEPTH} in flight, {:.0} MB/s)",
            disk.dense / 1e6,
            disk.sparse / 1e6
        );
    }
    Ok(())
}
