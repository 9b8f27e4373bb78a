//! End to end with the sparse streaming engine: the real model converted to `.lsm`, served in
//! `leanstream` mode as `[models.smollm2]` configures it, through the real daemon and bus.

use leanstream::contract::{MemoryReport, ModelMemory};
use leanstream_e2e::*;
use leanstream_engine::model::lsm::{ChunkLayout, LsmFile};

/// A bus and a daemon started as `cfg` says, a client that has loaded the model, and the memory
/// report right after the load with its one model's line. Keep it bound (not destructured with
/// `..`): dropping it stops the daemon.
struct Loaded {
    client: Client,
    report: MemoryReport,
    model: ModelMemory,
    // Dropped after the client: the daemon stops before its bus.
    _daemon: Daemon,
    _bus: Bus,
}

async fn load(cfg: &DaemonConfig) -> anyhow::Result<Loaded> {
    let bus = Bus::start()?;
    let daemon = crate::start_daemon(&bus, cfg).await?;
    let client = Client::new(&bus).await?;
    client.manager.load_model(MODEL).await?;
    let report = client.manager.memory().await?;
    let [model] = report.models.as_slice() else {
        anyhow::bail!("one model expected: {report:?}");
    };
    let model = model.clone();
    Ok(Loaded {
        client,
        report,
        model,
        _daemon: daemon,
        _bus: bus,
    })
}

/// `leanstream` mode with sparsity off and a quarter of the FFN as neuron cache, in a budget
/// smaller than the model file.
fn streaming(budget: &str, cache_share: f64) -> DaemonConfig {
    DaemonConfig {
        budget: budget.into(),
        lsm: Some(real_lsm()),
        extra: format!(
            "[models.smollm2]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = {cache_share}\n"
        ),
        ..DaemonConfig::default()
    }
}

#[test]
fn a_leanstream_model_streams_its_ffn_and_generates_the_dense_tokens() -> anyhow::Result<()> {
    let lsm = real_lsm();
    let header = LsmFile::open(&lsm)?.header;
    let layout = ChunkLayout::from_header(&lsm, &header)?;
    let file_bytes = std::fs::metadata(&lsm)?.len();
    runtime().block_on(async {
        // 96 MiB: less than the 131 MiB file that `dense` would keep whole.
        let loaded = load(&streaming("96MiB", 0.25)).await?;
        let (client, report, m) = (&loaded.client, &loaded.report, &loaded.model);
        // The model holds its resident part (not the streamed FFN) plus the cache.
        assert_eq!(m.mode, "leanstream");
        // Resident: the file less its streamed section, plus the tokenizer and tables.
        assert!(
            m.resident_bytes >= file_bytes - header.streamed.len,
            "{m:?}"
        );
        assert!(
            m.resident_bytes < file_bytes - header.streamed.len + (16 << 20),
            "{m:?}"
        );
        let chunks = layout.total_chunks() / 4;
        assert_eq!(m.cache_wanted_bytes, (chunks * layout.chunk_bytes) as u64);
        assert_eq!(m.cache_floor_bytes, layout.floor_bytes() as u64);
        // With room to spare, the cache is the size it wants.
        assert_eq!(m.cache_bytes, m.cache_wanted_bytes);
        assert_eq!(report.used_bytes, m.resident_bytes + m.cache_bytes);
        assert!(report.used_bytes < file_bytes);
        // With sparsity off the streamed FFN is the dense FFN: the fixture's greedy ids.
        let out = generate_once(client, STORY_PROMPT, 16).await?;
        assert_eq!(out.ids, STORY_GREEDY);
        Ok(())
    })
}

#[test]
fn a_neuron_cache_gets_what_the_budget_leaves_and_a_model_that_does_not_fit_is_over_budget()
-> anyhow::Result<()> {
    runtime().block_on(async {
        // The whole FFN as cache (84 MiB) beside about 50 MiB of resident weights: over 96 MiB,
        // so the cache gets what is left.
        let loaded = load(&streaming("96MiB", 1.0)).await?;
        let (client, report, m) = (&loaded.client, &loaded.report, &loaded.model);
        assert!(m.cache_bytes < m.cache_wanted_bytes, "{m:?}");
        assert!(m.cache_bytes >= m.cache_floor_bytes, "{m:?}");
        assert!(report.used_bytes <= report.budget_bytes, "{report:?}");
        let out = generate_once(client, STORY_PROMPT, 4).await?;
        assert_eq!(out.ids, STORY_GREEDY[..4]);
        drop(loaded);

        // 40 MiB cannot hold the resident part: the load is refused and changes nothing.
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &streaming("40MiB", 0.25)).await?;
        let client = Client::new(&bus).await?;
        let err = client.manager.load_model(MODEL).await.map(|_| ());
        assert_eq!(error_name(err), "OverBudget");
        let err = client.manager.load_model(MODEL).await.unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("resident") && msg.contains("budget"), "{msg}");
        let report = client.manager.memory().await?;
        assert_eq!((report.used_bytes, report.models.len()), (0, 0));
        // The daemon goes on serving: the model is not loaded, the session is refused the same way.
        let open = client.manager.open_session(MODEL, 64).await;
        assert_eq!(error_name(open), "OverBudget");
        Ok(())
    })
}

#[test]
fn a_dense_model_under_max_bytes_streams_what_does_not_fit_and_generates_the_dense_tokens()
-> anyhow::Result<()> {
    let file_bytes = std::fs::metadata(real_model())?.len();
    // 60 MB of the 98 MB GGUF: the memory planner streams the layers that do not fit.
    let max_bytes = 60_000_000u64;
    let cfg = DaemonConfig {
        extra: format!("[models.smollm2]\nmax_bytes = {max_bytes}\n"),
        ..DaemonConfig::default()
    };
    runtime().block_on(async {
        let loaded = load(&cfg).await?;
        let (client, m) = (&loaded.client, &loaded.model);
        assert_eq!(m.mode, "dense");
        assert_eq!(m.resident_bytes, max_bytes, "the reservation is max_bytes");
        // What does not fit is read every token: at least the file less what is kept.
        assert!(
            m.streamed_bytes_per_token >= file_bytes - max_bytes,
            "{m:?}"
        );
        assert!(m.streamed_bytes_per_token < file_bytes, "{m:?}");
        // The planned path computes the fully loaded model's logits: the fixture's greedy ids.
        let out = generate_once(client, STORY_PROMPT, 16).await?;
        assert_eq!(out.ids, STORY_GREEDY);
        Ok(())
    })
}
