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
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::Mode;
use leanstream_engine::plan::PlacementPolicy;
use serde::Deserialize;

use crate::arbiter::Priority;

/// The default configuration file.
pub const DEFAULT_CONFIG: &str = "/etc/leanstream/leanstreamd.toml";

/// A configuration error; the message names the key.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(String);

fn bad(key: &str, reason: impl fmt::Display) -> ConfigError {
    ConfigError(format!("`{key}` {reason}"))
}

/// A byte count written as an integer or a string with a unit: `512MiB`, `1.5 GiB`, `64k`, `100MB`.
/// Binary (`KiB`, `MiB`, `GiB`, `TiB`, and the short `K`, `M`, `G`, `T`) and decimal (`kB`, `MB`,
/// `GB`, `TB`) units; no unit means bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses a size; see [`ByteSize`] for the accepted forms.
    pub fn parse(text: &str) -> Result<ByteSize, String> {
        leanstream_engine::plan::parse_bytes(text).map(ByteSize)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize(n)),
            Raw::Text(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

/// The configuration as written, every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub models: RawModels,
    #[serde(default)]
    pub memory: RawMemory,
    #[serde(default)]
    pub engine: RawEngine,
    #[serde(default)]
    pub limits: RawLimits,
    #[serde(default)]
    pub access: RawAccess,
}

/// `[access]`: who may see every client in `Memory()`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAccess {
    pub admin_group: Option<String>,
}

/// `[models]`: the directory, and one `[models.NAME]` table per model that overrides the
/// `[engine]` defaults. Any key other than `dir` is a model name; each is read as a
/// [`RawModel`] during validation, so that an error (a misspelt `dir` is not a table) can name
/// the key.
#[derive(Debug, Default, Deserialize)]
pub struct RawModels {
    pub dir: Option<PathBuf>,
    #[serde(flatten)]
    pub each: BTreeMap<String, config::Value>,
}

/// `[models.NAME]`: how one model runs; an unset key takes the `[engine]` value.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    pub mode: Option<String>,
    pub priority: Option<String>,
    pub kv_type: Option<String>,
    pub sparsity: Option<f64>,
    pub cache_share: Option<f64>,
    pub max_bytes: Option<ByteSize>,
    pub placement: Option<String>,
    pub keep_alive: Option<i64>,
    pub preload: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMemory {
    pub budget: Option<ByteSize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEngine {
    pub sparsity: Option<f64>,
    pub priority: Option<String>,
    pub kv_type: Option<String>,
    pub mode: Option<String>,
    pub cache_share: Option<f64>,
    pub io_threads: Option<usize>,
    pub compute_threads: Option<usize>,
    pub backend: Option<String>,
    pub precision: Option<String>,
    pub keep_alive: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub max_sessions: Option<usize>,
    pub max_sessions_per_client: Option<usize>,
    pub max_pins_per_client: Option<usize>,
    pub max_context: Option<usize>,
    pub max_tokens: Option<usize>,
    pub max_prompt_bytes: Option<usize>,
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
    pub priority: Priority,
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
    /// The config keys the values came from, for error messages (`models.NAME.sparsity` or
    /// `engine.sparsity`, …).
    pub mode_key: String,
    pub sparsity_key: String,
    pub cache_share_key: String,
}

/// How long an unpinned model stays loaded after its last session closes: the `keep_alive` key,
/// in seconds, `0` (the default) for "unload at once" and `-1` for "never". The variants are in
/// order of length, so `max` is the longer of two.
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
    /// Compute threads (rayon pool); 0 means one per core. Default 0.
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
            priority: parse_priority("engine.priority", e.priority.as_deref())?.unwrap_or_default(),
            kv_type: parse_kv_type("engine.kv_type", e.kv_type.as_deref())?.unwrap_or_default(),
            max_bytes: None,
            placement: PlacementPolicy::Auto,
            keep_alive: parse_keep_alive("engine.keep_alive", e.keep_alive)?.unwrap_or_default(),
            preload: false,
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

fn parse_mode(key: &str, value: Option<&str>) -> Result<Option<Mode>, ConfigError> {
    value
        .map(|m| {
            m.parse::<Mode>().map_err(|_| {
                bad(
                    key,
                    format!("`{m}` is not one of dense, mmap, on-demand, prefetch, leanstream"),
                )
            })
        })
        .transpose()
}

fn parse_priority(key: &str, value: Option<&str>) -> Result<Option<Priority>, ConfigError> {
    value
        .map(|p| match p {
            "background" => Ok(Priority::Background),
            "normal" => Ok(Priority::Normal),
            "interactive" => Ok(Priority::Interactive),
            other => Err(bad(
                key,
                format!("`{other}` is not one of background, normal, interactive"),
            )),
        })
        .transpose()
}

fn parse_kv_type(key: &str, value: Option<&str>) -> Result<Option<KvType>, ConfigError> {
    value
        .map(|t| {
            t.parse::<KvType>()
                .map_err(|e: leanstream_engine::Error| bad(key, e.to_string()))
        })
        .transpose()
}

fn check_sparsity(key: &str, value: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match value {
        Some(s) if !(s.is_finite() && (0.0..1.0).contains(&s)) => Err(bad(
            key,
            format!("{s} is outside [0, 1) (0 turns sparsity off)"),
        )),
        v => Ok(v),
    }
}

fn check_cache_share(key: &str, value: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match value {
        Some(s) if !(s.is_finite() && s > 0.0 && s <= 1.0) => Err(bad(
            key,
            format!("{s} is outside (0, 1] (the neuron cache's share of the streamed FFN bytes)"),
        )),
        v => Ok(v),
    }
}

/// Merges `[models.NAME]` over the `[engine]` defaults. A key that the model's mode does not use
/// (sparsity in `dense`, cache_share outside the cache-backed modes) is an error when the same
/// table sets it: it would silently do nothing.
fn model_params(
    engine: &ModelParams,
    name: &str,
    raw: config::Value,
) -> Result<ModelParams, ConfigError> {
    let key = |k: &str| format!("models.{name}.{k}");
    let m: RawModel = raw.try_deserialize().map_err(|e| {
        bad(
            &format!("models.{name}"),
            format!(
                "is not a model table (`[models.{name}]` with mode, sparsity, cache_share; \
                 `dir` is the only other key of [models]): {e}"
            ),
        )
    })?;
    crate::models::check_name(name).map_err(|e| {
        bad(
            &format!("models.{name}"),
            format!("is not a model name: {e}"),
        )
    })?;
    let mode = parse_mode(&key("mode"), m.mode.as_deref())?;
    let sparsity = check_sparsity(&key("sparsity"), m.sparsity)?;
    let cache_share = check_cache_share(&key("cache_share"), m.cache_share)?;
    let priority = parse_priority(&key("priority"), m.priority.as_deref())?;
    let kv_type = parse_kv_type(&key("kv_type"), m.kv_type.as_deref())?;
    let keep_alive = parse_keep_alive(&key("keep_alive"), m.keep_alive)?;
    let placement = m
        .placement
        .as_deref()
        .map(|s| {
            s.parse::<PlacementPolicy>()
                .map_err(|e| bad(&key("placement"), e))
        })
        .transpose()?;
    if placement.is_some() && m.max_bytes.is_none() {
        return Err(bad(
            &key("placement"),
            "places a model within `max_bytes`: set `max_bytes` too",
        ));
    }
    let effective = mode.unwrap_or(engine.mode);
    if sparsity.is_some() && effective == Mode::Dense {
        return Err(bad(
            &key("sparsity"),
            "has no effect: the model runs in `dense` mode (set `mode` to a sparse mode)",
        ));
    }
    if m.max_bytes.is_some() && effective != Mode::Dense {
        return Err(bad(
            &key("max_bytes"),
            format!(
                "plans a dense model's weights; the model runs in `{effective}` mode, whose \
                 size is its resident part and `cache_share`"
            ),
        ));
    }
    if cache_share.is_some() && !effective.uses_cache() {
        return Err(bad(
            &key("cache_share"),
            format!(
                "has no effect: the model runs in `{effective}` mode, which has no neuron cache \
                 (on-demand, prefetch and leanstream have one)"
            ),
        ));
    }
    Ok(ModelParams {
        mode: effective,
        mode_key: if mode.is_some() {
            key("mode")
        } else {
            engine.mode_key.clone()
        },
        sparsity_key: if sparsity.is_some() {
            key("sparsity")
        } else {
            engine.sparsity_key.clone()
        },
        cache_share_key: if cache_share.is_some() {
            key("cache_share")
        } else {
            engine.cache_share_key.clone()
        },
        sparsity: sparsity.or(engine.sparsity),
        cache_share: cache_share.unwrap_or(engine.cache_share),
        priority: priority.unwrap_or(engine.priority),
        kv_type: kv_type.unwrap_or(engine.kv_type),
        max_bytes: m.max_bytes.map(|b| b.0),
        placement: placement.unwrap_or(engine.placement),
        keep_alive: keep_alive.unwrap_or(engine.keep_alive),
        preload: m.preload.unwrap_or(false),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod file_keys;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn byte_sizes_parse() {
        assert_eq!(ByteSize::parse("512MiB"), Ok(ByteSize(512 << 20)));
        assert_eq!(ByteSize::parse("512 MiB"), Ok(ByteSize(512 << 20)));
        assert_eq!(ByteSize::parse("1.5GiB"), Ok(ByteSize(3 << 29)));
        assert_eq!(ByteSize::parse("64k"), Ok(ByteSize(64 << 10)));
        assert_eq!(ByteSize::parse("100MB"), Ok(ByteSize(100_000_000)));
        assert_eq!(ByteSize::parse("4096"), Ok(ByteSize(4096)));
        assert!(ByteSize::parse("MiB").is_err());
        assert!(ByteSize::parse("12 parsecs").is_err());
        assert!(ByteSize::parse("99999999999999TiB").is_err());
        assert!(ByteSize::parse("-1").is_err());
        assert!(ByteSize::parse("1.2.3M").is_err());
    }

    fn params(toml: &str) -> Result<Params, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        let toml = toml.replace("DIR", &dir.path().display().to_string());
        std::fs::write(&file, toml).unwrap();
        Params::load(&file, true)
    }

    #[test]
    fn file_values_are_validated() {
        let p = params(
            "[models]\ndir = \"DIR\"\n[memory]\nbudget = \"1GiB\"\n[limits]\nmax_sessions = 3\n",
        )
        .unwrap();
        assert_eq!(p.budget_bytes, 1 << 30);
        assert_eq!(p.max_sessions, 3);
        assert_eq!(p.max_tokens, 512);
        assert_eq!(p.backend, Backend::Cpu);
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            ("[memory]\nbudget = \"lots\"", "memory.budget"),
            ("[engine]\nbackend = \"cuda\"", "engine.backend"),
            ("[engine]\nsparsity = 1.5", "engine.sparsity"),
            ("[engine]\nprecision = \"sloppy\"", "engine.precision"),
            ("[limits]\nmax_sessions = 0", "limits.max_sessions"),
            (
                "[limits]\nmax_sessions_per_client = 0",
                "limits.max_sessions_per_client",
            ),
            ("[engine]\npriority = \"urgent\"", "engine.priority"),
            ("[engine]\nkv_type = \"f8\"", "engine.kv_type"),
            ("[models.m]\npriority = \"low\"", "models.m.priority"),
            ("[limits]\nmax_sesions = 4", "max_sesions"),
        ];
        for (body, key) in cases {
            let msg = params(&format!("[models]\ndir = \"DIR\"\n{body}\n"))
                .unwrap_err()
                .to_string();
            assert!(msg.contains(key), "{body:?}: {msg}");
        }
        let msg = params("[models]\ndir = \"/nonexistent/leanstream\"\n")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("models.dir"), "{msg}");
    }

    #[test]
    fn max_bytes_plans_dense_models_only() {
        let p = params("[models]\ndir = \"DIR\"\n[models.m]\nmax_bytes = \"60MB\"\n").unwrap();
        assert_eq!(p.model("m").max_bytes, Some(60_000_000));
        assert_eq!(p.model("other").max_bytes, None);
        let e = params(
            "[models]\ndir = \"DIR\"\n[models.m]\nmode = \"leanstream\"\nmax_bytes = \"60MB\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("models.m.max_bytes"), "{e}");
    }

    #[test]
    fn placement_is_auto_by_default_and_goes_with_max_bytes() {
        let dir = "[models]\ndir = \"DIR\"\n[models.m]\nmax_bytes = \"60MB\"\n";
        assert_eq!(
            params(dir).unwrap().model("m").placement,
            PlacementPolicy::Auto
        );
        let dense = params(&format!("{dir}placement = \"dense\"\n")).unwrap();
        assert_eq!(dense.model("m").placement, PlacementPolicy::Dense);
        let e = params(&format!("{dir}placement = \"sparse\"\n")).unwrap_err();
        assert!(e.to_string().contains("models.m.placement"), "{e}");
        assert!(e.to_string().contains("auto or dense"), "{e}");
        let e = params("[models]\ndir = \"DIR\"\n[models.m]\nplacement = \"dense\"\n").unwrap_err();
        assert!(e.to_string().contains("max_bytes"), "{e}");
    }

    #[test]
    fn keep_alive_is_seconds_zero_or_minus_one_and_preload_is_per_model() {
        let p = params(
            "[models]\ndir = \"DIR\"\n[engine]\nkeep_alive = 300\n\
             [models.a]\nkeep_alive = -1\npreload = true\n[models.b]\nkeep_alive = 0\n",
        )
        .unwrap();
        assert_eq!(
            p.model("other").keep_alive,
            KeepAlive::Idle(std::time::Duration::from_secs(300))
        );
        assert_eq!(
            (p.model("a").keep_alive, p.model("a").preload),
            (KeepAlive::Forever, true)
        );
        assert_eq!(
            (p.model("b").keep_alive, p.model("b").preload),
            (KeepAlive::UntilLastClose, false)
        );
        let p = params("[models]\ndir = \"DIR\"\n").unwrap();
        assert_eq!(p.model("x").keep_alive, KeepAlive::UntilLastClose);
        for bad in [
            "[engine]\nkeep_alive = -2",
            "[models.a]\nkeep_alive = 999999999",
            "[engine]\npreload = true",
        ] {
            assert!(
                params(&format!("[models]\ndir = \"DIR\"\n{bad}\n")).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_admin_group_defaults_to_leanstream_admin_and_empty_names_none() {
        let p = params("[models]\ndir = \"DIR\"\n").unwrap();
        assert_eq!(p.admin_group.as_deref(), Some(DEFAULT_ADMIN_GROUP));
        let p = params("[models]\ndir = \"DIR\"\n[access]\nadmin_group = \"ops\"\n").unwrap();
        assert_eq!(p.admin_group.as_deref(), Some("ops"));
        let p = params("[models]\ndir = \"DIR\"\n[access]\nadmin_group = \"\"\n").unwrap();
        assert_eq!(p.admin_group, None);
        assert!(params("[models]\ndir = \"DIR\"\n[access]\nadmins = \"x\"\n").is_err());
    }

    #[test]
    fn models_run_dense_with_a_quarter_cache_share_by_default() {
        let p = params("[models]\ndir = \"DIR\"\n").unwrap();
        let m = p.model("anything");
        assert_eq!(m.mode, Mode::Dense);
        assert_eq!(m.sparsity, None, "unset: the file's calibrated target");
        assert_eq!(m.cache_share, DEFAULT_CACHE_SHARE);
        assert!(p.models.is_empty());
    }

    #[test]
    fn per_model_tables_override_the_engine_defaults() {
        let p = params(
            "[models]\ndir = \"DIR\"\n\
             [models.SmolLM2]\nmode = \"leanstream\"\ncache_share = 0.5\nsparsity = 0\n\
             [models.other]\nsparsity = 0.4\n\
             [engine]\nmode = \"prefetch\"\ncache_share = 0.1\n",
        )
        .unwrap();
        let m = p.model("SmolLM2");
        assert_eq!(
            (m.mode, m.sparsity, m.cache_share),
            (Mode::LeanStream, Some(0.0), 0.5)
        );
        assert_eq!(m.cache_share_key, "models.SmolLM2.cache_share");
        assert_eq!(m.mode_key, "models.SmolLM2.mode");
        // Unset keys fall back to [engine], and messages name the key the value came from.
        let o = p.model("other");
        assert_eq!(
            (o.mode, o.sparsity, o.cache_share),
            (Mode::Prefetch, Some(0.4), 0.1)
        );
        assert_eq!(o.cache_share_key, "engine.cache_share");
        assert_eq!(o.sparsity_key, "models.other.sparsity");
        let d = p.model("unlisted");
        assert_eq!((d.mode, d.sparsity), (Mode::Prefetch, None));
        assert_eq!(d, &p.engine);
    }

    #[test]
    fn bad_model_settings_name_the_key() {
        let cases = [
            ("[engine]\nmode = \"turbo\"", "engine.mode"),
            ("[engine]\ncache_share = -1.0", "engine.cache_share"),
            ("[engine]\nsparsity = -0.1", "engine.sparsity"),
            ("[models.m]\nmode = \"turbo\"", "models.m.mode"),
            (
                "[models.m]\nmode = \"leanstream\"\ncache_share = 0",
                "models.m.cache_share",
            ),
            (
                "[models.m]\nmode = \"leanstream\"\ncache_share = 1.5",
                "models.m.cache_share",
            ),
            (
                "[models.m]\nmode = \"leanstream\"\ncache_share = nan",
                "models.m.cache_share",
            ),
            (
                "[models.m]\nmode = \"leanstream\"\nsparsity = 1.0",
                "models.m.sparsity",
            ),
            // Keys the model's mode would ignore.
            ("[models.m]\ncache_share = 0.2", "models.m.cache_share"),
            ("[models.m]\nsparsity = 0.2", "models.m.sparsity"),
            (
                "[models.m]\nmode = \"mmap\"\ncache_share = 0.2",
                "models.m.cache_share",
            ),
            // Misspelt keys and names that are not model names.
            (
                "[models.m]\nmode = \"leanstream\"\ncache_shar = 0.2",
                "cache_shar",
            ),
            (
                "[models.\".hidden\"]\nmode = \"leanstream\"",
                "models..hidden",
            ),
        ];
        for (body, key) in cases {
            let msg = params(&format!("[models]\ndir = \"DIR\"\n{body}\n"))
                .unwrap_err()
                .to_string();
            assert!(msg.contains(key), "{body:?}: {msg}");
        }
        // A misspelt `dir` reads as a model table that is not a table.
        let msg = params("[models]\ndri = \"DIR\"\n").unwrap_err().to_string();
        assert!(msg.contains("dri"), "{msg}");
    }

    #[test]
    fn a_missing_explicit_file_is_an_error_but_a_default_one_is_not() {
        let missing = Path::new("/nonexistent/leanstreamd.toml");
        assert!(Params::load(missing, true).is_err());
        // Not explicit: the file may be missing; the default model dir may not exist here, so
        // only check that the error (if any) is not about the file.
        if let Err(e) = Params::load(missing, false) {
            assert!(e.to_string().contains("models.dir"), "{e}");
        }
    }
}
