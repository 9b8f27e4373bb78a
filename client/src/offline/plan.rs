//! `leanstream plan`: what a memory budget keeps resident and what it streams, the bytes read
//! per token, and (with `--disk-probe`) the tokens per second the disk alone allows.

use std::path::PathBuf;

use clap::Args;
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
    /// Measure the model file's O_DIRECT read bandwidth (up to 4 s) and predict the
    /// storage-bound tokens/s.
    #[arg(long)]
    pub disk_probe: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let model = Model::load_within(&args.model, args.budget, args.context, args.kv_type)?;
    let plan = model.plan().expect("load_within attaches its plan");
    print!("{}", plan.table());
    if args.disk_probe {
        let len = std::fs::metadata(&args.model)?.len();
        let bw = leanstream_engine::bench::disk::probe(
            &args.model,
            0..len,
            &leanstream_engine::bench::disk::ProbeOptions {
                queue_depth: 1,
                ..Default::default()
            },
        )?;
        let bound = plan
            .io_bound_tok_s(bw.bytes_per_s)
            .map_or("unbounded (nothing streams)".to_string(), |t| {
                format!("{t:.1} tok/s")
            });
        println!(
            "disk              {:.0} MB/s (O_DIRECT, 1 MiB reads, one at a time)\nstorage bound     {bound}",
            bw.bytes_per_s / 1e6
        );
    }
    Ok(())
}
