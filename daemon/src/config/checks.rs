//! Checks of single keys and of one `[models.NAME]` table against `[engine]`: each error names
//! the key.

use super::*;

pub(super) fn parse_mode(key: &str, value: Option<&str>) -> Result<Option<Mode>, ConfigError> {
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

pub(super) fn parse_cache_class(
    key: &str,
    value: Option<&str>,
) -> Result<Option<CacheClass>, ConfigError> {
    value
        .map(|p| match p {
            "background" => Ok(CacheClass::Background),
            "normal" => Ok(CacheClass::Normal),
            "interactive" => Ok(CacheClass::Interactive),
            other => Err(bad(
                key,
                format!("`{other}` is not one of background, normal, interactive"),
            )),
        })
        .transpose()
}

pub(super) fn parse_kv_type(key: &str, value: Option<&str>) -> Result<Option<KvType>, ConfigError> {
    value
        .map(|t| {
            t.parse::<KvType>()
                .map_err(|e: leanstream_engine::Error| bad(key, e.to_string()))
        })
        .transpose()
}

/// Parses a `speculate` key: `auto` or `off`.
pub(super) fn parse_speculate(
    key: &str,
    value: Option<&str>,
) -> Result<Option<SpeculateMode>, ConfigError> {
    value
        .map(|v| {
            SpeculateMode::parse(v).ok_or_else(|| bad(key, format!("`{v}` is not auto or off")))
        })
        .transpose()
}

pub(super) fn check_sparsity(key: &str, value: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match value {
        Some(s) if !(s.is_finite() && (0.0..1.0).contains(&s)) => Err(bad(
            key,
            format!("{s} is outside [0, 1) (0 turns sparsity off)"),
        )),
        v => Ok(v),
    }
}

pub(super) fn check_cache_share(key: &str, value: Option<f64>) -> Result<Option<f64>, ConfigError> {
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
pub(super) fn model_params(
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
    let cache_class = parse_cache_class(&key("priority"), m.priority.as_deref())?;
    let kv_type = parse_kv_type(&key("kv_type"), m.kv_type.as_deref())?;
    let keep_alive = parse_keep_alive(&key("keep_alive"), m.keep_alive)?;
    let speculate = parse_speculate(&key("speculate"), m.speculate.as_deref())?;
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
        cache_class: cache_class.unwrap_or(engine.cache_class),
        kv_type: kv_type.unwrap_or(engine.kv_type),
        max_bytes: m.max_bytes.map(|b| b.0),
        placement: placement.unwrap_or(engine.placement),
        keep_alive: keep_alive.unwrap_or(engine.keep_alive),
        preload: m.preload.unwrap_or(false),
        speculate: speculate.unwrap_or(engine.speculate),
    })
}
