//! Configuration: a raw serde form with optional fields (what the file and the environment say),
//! validated once into [`Params`], the runtime form. Every error names the key at fault.
//!
//! Sources, later ones winning: the TOML file (default `/etc/leanstream/leanstreamd.toml`, which may
//! be missing; an explicit `--config` file must exist), then environment variables
//! `LEANSTREAM__SECTION__KEY` (e.g. `LEANSTREAM__MEMORY__BUDGET=1GiB`).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::backend::select::{BackendChoice, cuda_available};
use leanstream_engine::generate::SpeculateMode;
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::Mode;
use leanstream_engine::plan::PlacementPolicy;

use crate::arbiter::CacheClass;

mod checks;
mod raw;

use checks::{
    check_cache_share, check_sparsity, model_params, parse_cache_class, parse_kv_type, parse_mode,
    parse_speculate,
};
pub use raw::*;

/// The default configuration file.
pub const DEFAULT_CONFIG: &str = "/etc/leanstream/leanstreamd.toml";

/// A configuration error; the message names the key.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(String);

fn bad(key: &str, reason: impl fmt::Display) -> ConfigError {
    ConfigError(format!("`{key}` {reason}"))
}

/// Compute backend actually used (`backend` in `[engine]`, resolved once at start).
pub use leanstream_engine::backend::select::Backend;

/// The group whose members see every client in `Memory()` when `[access] admin_group` is unset.
pub const DEFAULT_ADMIN_GROUP: &str = "leanstream-admin";

/// The neuron cache's share of a model's streamed FFN bytes when no key sets it.
pub const DEFAULT_CACHE_SHARE: f64 = 0.25;

/// How one model runs: `[engine]` defaults with its `[models.NAME]` overrides applied.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelParams {
    /// Default `dense`.
    pub mode: Mode,
    /// FFN sparsity in [0, 1): `None` (the default) runs at the target the file was calibrated
    /// for; `Some(0.0)` turns sparsity off (every neuron is computed, the weights still stream);
    /// any other value must equal the file's calibrated target. Sparse modes only.
    pub sparsity: Option<f64>,
    /// The neuron cache's size as a share of the model's streamed FFN bytes, in (0, 1].
    /// Cache-backed modes (`on-demand`, `prefetch`, `leanstream`) only. Default 0.25.
    pub cache_share: f64,
    /// Which neuron caches yield memory first: a model's cache is served after those of
    /// higher-priority models (`background` < `normal` < `interactive`). Default `normal`.
    pub cache_class: CacheClass,
    /// Element type of its sessions' KV caches: `f16` (default), `f32` or `q8_0`.
    pub kv_type: KvType,
    /// `dense` mode only, `[models.NAME]` only: the most the model itself may hold (weights,
    /// tokenizer, tables, weight-stream ring). The memory planner keeps what fits and streams
    /// the other weights from storage every token. `None` (default): every weight is read.
    pub max_bytes: Option<u64>,
    /// With `max_bytes`: `auto` (default) lets the plan stream FFN layers of a calibrated `.lsm`
    /// by neuron where that reads faster than dense, its neuron cache inside `max_bytes`;
    /// `dense` never does.
    pub placement: PlacementPolicy,
    /// How long the model stays loaded once its last session has closed (`keep_alive`).
    /// A model pinned with `LoadModel` or `preload` stays loaded whatever this says.
    pub keep_alive: KeepAlive,
    /// `[models.NAME]` only: load the model when the daemon starts and keep it loaded (as if
    /// pinned with `LoadModel`). Default false.
    pub preload: bool,
    /// Whether its generations decode speculatively (`speculate`): `auto` (default) drafts
    /// tokens where the engine finds them worth a row of a pass and verifies them in one pass,
    /// `off` never. The output is the same either way.
    pub speculate: SpeculateMode,
    /// The config keys the values came from, for error messages (`models.NAME.sparsity` or
    /// `engine.sparsity`, …).
    pub mode_key: String,
    pub sparsity_key: String,
    pub cache_share_key: String,
}

/// How long an unpinned model stays loaded after its last session closes: the `keep_alive` key,
/// in seconds (default [`KeepAlive::DEFAULT_SECONDS`]), `0` for "unload at once" and `-1` for
/// "never". The variants are in order of length, so `max` is the longer of two. (`Default` is
/// the shortest, what a model nobody holds gets from its holders.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum KeepAlive {
    #[default]
    UntilLastClose,
    Idle(std::time::Duration),
    Forever,
}

impl KeepAlive {
    /// The longest `Idle` a configuration or a client may ask for: one week.
    pub const MAX_IDLE_SECONDS: i64 = 604_800;
    /// `[engine] keep_alive` when unset: five minutes, so that a command-line tool or an app
    /// that opens a session per request does not load the model every time (Ollama's default
    /// is the same).
    pub const DEFAULT_SECONDS: i64 = 300;

    /// `-1` never, `0` at the last close, `1..=MAX_IDLE_SECONDS` seconds; else the reason.
    pub fn from_seconds(n: i64) -> Result<KeepAlive, String> {
        match n {
            0 => Ok(KeepAlive::UntilLastClose),
            -1 => Ok(KeepAlive::Forever),
            1..=KeepAlive::MAX_IDLE_SECONDS => {
                Ok(KeepAlive::Idle(std::time::Duration::from_secs(n as u64)))
            }
            _ => Err(format!(
                "{n} is not -1 (never unload), 0 (at the last close) or 1..={} seconds",
                KeepAlive::MAX_IDLE_SECONDS
            )),
        }
    }
}

fn parse_keep_alive(key: &str, v: Option<i64>) -> Result<Option<KeepAlive>, ConfigError> {
    v.map(KeepAlive::from_seconds)
        .transpose()
        .map_err(|reason| bad(key, reason))
}

/// Validated runtime parameters.
#[derive(Clone, Debug)]
pub struct Params {
    /// Models are files `NAME.lsm` / `NAME.gguf` directly in this directory (canonical path).
    /// Default `/usr/share/leanstream/models`.
    pub model_dir: PathBuf,
    /// Memory budget in bytes for weights, caches, KV caches and buffers. Default 512 MiB.
    pub budget_bytes: u64,
    /// How models run unless `[models.NAME]` says otherwise (`[engine]` mode, sparsity,
    /// cache_share).
    pub engine: ModelParams,
    /// Per-model overrides, by model name, already merged with `engine`.
    pub models: BTreeMap<String, ModelParams>,
    /// I/O worker threads of the streaming engine, per model. Default 2.
    pub io_threads: usize,
    /// Compute threads (the members of the engine's compute team); 0 means one per core. Default 0.
    pub compute_threads: usize,
    pub backend: Backend,
    /// Activation precision of the quantised dot products. Default exact.
    pub precision: Precision,
    /// Most open sessions over all clients. Default 16.
    pub max_sessions: usize,
    /// Most sessions one client user (uid, over all its bus connections) may have open or
    /// opening. Default 4.
    pub max_sessions_per_client: usize,
    /// Most models one client user may keep loaded with `LoadModel` or `LoadModelFor`; a hold
    /// counts until its model unloads. Default 2.
    pub max_pins_per_client: usize,
    /// Largest context a session may ask for, in tokens; also the default. Default 2048.
    pub max_context: usize,
    /// Most tokens one request may generate; also the default. Default 512.
    pub max_tokens: usize,
    /// Longest prompt (or rendered chat) in bytes. Default 64 KiB.
    pub max_prompt_bytes: usize,
    /// Members of this group (besides root and the daemon's own user) see every client's
    /// sessions in `Memory()`; everyone else sees their own and a total for the rest. Default
    /// `leanstream-admin`; an empty string names no group.
    pub admin_group: Option<String>,
}

impl Params {
    /// Reads the file (`explicit` = given on the command line, so it must exist) and the
    /// environment, then validates.
    pub fn load(path: &Path, explicit: bool) -> Result<Params, ConfigError> {
        if explicit && !path.is_file() {
            return Err(ConfigError(format!(
                "the configuration file {} does not exist",
                path.display()
            )));
        }
        let built = config::Config::builder()
            .add_source(
                config::File::from(path)
                    .format(config::FileFormat::Toml)
                    .required(explicit),
            )
            .add_source(
                config::Environment::with_prefix("LEANSTREAM")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true),
            )
            .build()
            .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        let raw: RawConfig = built
            .try_deserialize()
            .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        Params::validate(raw)
    }

    /// Turns the raw form into parameters, naming the first bad key.
    pub fn validate(raw: RawConfig) -> Result<Params, ConfigError> {
        let budget_bytes = raw.memory.budget.unwrap_or(ByteSize(512 << 20)).0;
        if budget_bytes == 0 {
            return Err(bad("memory.budget", "must be more than 0 bytes"));
        }
        let e = raw.engine;
        let engine = ModelParams {
            mode: parse_mode("engine.mode", e.mode.as_deref())?.unwrap_or(Mode::Dense),
            sparsity: check_sparsity("engine.sparsity", e.sparsity)?,
            cache_share: check_cache_share("engine.cache_share", e.cache_share)?
                .unwrap_or(DEFAULT_CACHE_SHARE),
            cache_class: parse_cache_class("engine.priority", e.priority.as_deref())?
                .unwrap_or_default(),
            kv_type: parse_kv_type("engine.kv_type", e.kv_type.as_deref())?.unwrap_or_default(),
            max_bytes: None,
            placement: PlacementPolicy::Auto,
            keep_alive: parse_keep_alive(
                "engine.keep_alive",
                Some(e.keep_alive.unwrap_or(KeepAlive::DEFAULT_SECONDS)),
            )?
            .unwrap_or_default(),
            preload: false,
            speculate: parse_speculate("engine.speculate", e.speculate.as_deref())?
                .unwrap_or_default(),
            mode_key: "engine.mode".into(),
            sparsity_key: "engine.sparsity".into(),
            cache_share_key: "engine.cache_share".into(),
        };
        let mut models = BTreeMap::new();
        for (name, m) in raw.models.each {
            let p = model_params(&engine, &name, m)?;
            models.insert(name, p);
        }
        // After the model tables: a misspelt `dir` is reported as such, not as a missing default.
        let dir = raw
            .models
            .dir
            .unwrap_or_else(|| PathBuf::from("/usr/share/leanstream/models"));
        let model_dir = dir
            .canonicalize()
            .map_err(|e| bad("models.dir", format!("({}): {e}", dir.display())))?;
        if !model_dir.is_dir() {
            return Err(bad(
                "models.dir",
                format!("({}) is not a directory", dir.display()),
            ));
        }
        let io_threads = e.io_threads.unwrap_or(2);
        if !(1..=64).contains(&io_threads) {
            return Err(bad(
                "engine.io_threads",
                format!("{io_threads} is outside 1..=64"),
            ));
        }
        let compute_threads = e.compute_threads.unwrap_or(0);
        if compute_threads > 1024 {
            return Err(bad(
                "engine.compute_threads",
                format!("{compute_threads} is outside 0..=1024 (0 = one per core)"),
            ));
        }
        let choice: BackendChoice = e
            .backend
            .as_deref()
            .unwrap_or("auto")
            .parse()
            .map_err(|err: leanstream_engine::Error| bad("engine.backend", err.to_string()))?;
        let (backend, why) = choice
            .resolve_with(cuda_available)
            .map_err(|err| bad("engine.backend", err.to_string()))?;
        tracing::info!("compute backend {}: {why}", backend.name());
        let precision = match e.precision.as_deref().unwrap_or("exact") {
            "exact" => Precision::Exact,
            "fast" => Precision::Fast,
            p => {
                return Err(bad(
                    "engine.precision",
                    format!("`{p}` is not exact or fast"),
                ));
            }
        };
        let l = raw.limits;
        let positive = |key: &str, v: Option<usize>, default: usize, max: usize| {
            let v = v.unwrap_or(default);
            if (1..=max).contains(&v) {
                Ok(v)
            } else {
                Err(bad(key, format!("{v} is outside 1..={max}")))
            }
        };
        Ok(Params {
            model_dir,
            budget_bytes,
            engine,
            models,
            io_threads,
            compute_threads,
            backend,
            precision,
            max_sessions: positive("limits.max_sessions", l.max_sessions, 16, 4096)?,
            max_sessions_per_client: positive(
                "limits.max_sessions_per_client",
                l.max_sessions_per_client,
                4,
                4096,
            )?,
            max_pins_per_client: positive(
                "limits.max_pins_per_client",
                l.max_pins_per_client,
                2,
                4096,
            )?,
            max_context: positive("limits.max_context", l.max_context, 2048, 1 << 20)?,
            max_tokens: positive("limits.max_tokens", l.max_tokens, 512, 1 << 20)?,
            max_prompt_bytes: positive(
                "limits.max_prompt_bytes",
                l.max_prompt_bytes,
                64 << 10,
                16 << 20,
            )?,
            admin_group: match raw.access.admin_group {
                None => Some(DEFAULT_ADMIN_GROUP.to_string()),
                Some(g) if g.is_empty() => None,
                Some(g) => Some(g),
            },
        })
    }

    /// How model `name` runs.
    pub fn model(&self, name: &str) -> &ModelParams {
        self.models.get(name).unwrap_or(&self.engine)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod file_keys;

#[cfg(test)]
mod tests;
