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
fn speculate_is_auto_by_default_per_model_overrides_and_other_values_name_the_key() {
    use leanstream_engine::generate::SpeculateMode;
    let p = params("[models]\ndir = \"DIR\"\n").unwrap();
    assert_eq!(p.model("m").speculate, SpeculateMode::Auto);
    let p = params(
        "[models]\ndir = \"DIR\"\n[engine]\nspeculate = \"off\"\n\
         [models.a]\nspeculate = \"auto\"\n[models.b]\nmode = \"dense\"\n",
    )
    .unwrap();
    assert_eq!(p.model("a").speculate, SpeculateMode::Auto);
    assert_eq!(
        p.model("b").speculate,
        SpeculateMode::Off,
        "[engine]'s value"
    );
    assert_eq!(p.model("other").speculate, SpeculateMode::Off);
    for (body, key) in [
        ("[engine]\nspeculate = \"on\"", "engine.speculate"),
        ("[models.m]\nspeculate = \"Auto\"", "models.m.speculate"),
        ("[models.m]\nspeculate = true", "models.m"),
    ] {
        let msg = params(&format!("[models]\ndir = \"DIR\"\n{body}\n"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains(key), "{body:?}: {msg}");
    }
    let msg = params("[models]\ndir = \"DIR\"\n[engine]\nspeculate = \"on\"\n")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("`on` is not auto or off"), "{msg}");
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
    let five_minutes = KeepAlive::Idle(std::time::Duration::from_secs(300));
    assert_eq!(p.model("x").keep_alive, five_minutes, "the default");
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
