//! The configuration file as written: every key optional, units and names still text.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

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
    pub speculate: Option<String>,
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
    pub speculate: Option<String>,
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
