//! `systemd/leanstreamd.toml`, the file users read and edit, names every key the daemon reads
//! (set, or commented out with an example value) and no other, and its values load.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use super::{Params, RawAccess, RawConfig, RawEngine, RawLimits, RawMemory, RawModel};

/// The installed configuration file.
const FILE: &str = include_str!("../../../systemd/leanstreamd.toml");

/// The field names serde's derive gives `T`: read from its `deserialize_struct` call, so the
/// struct stays the one place that names them.
fn fields<T: for<'de> Deserialize<'de>>() -> BTreeSet<&'static str> {
    let mut names: &'static [&'static str] = &[];
    let _ = T::deserialize(Capture(&mut names));
    names.iter().copied().collect()
}

/// A deserializer that only records the field names it is asked for.
struct Capture<'a>(&'a mut &'static [&'static str]);

#[derive(Debug)]
struct Stop;

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("field names captured")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Stop
    }
}

impl<'de> Deserializer<'de> for Capture<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        *self.0 = fields;
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// The file with its commented-out keys and tables written in: `# key = value` and
/// `# [table]` lines lose their `# `; prose comments stay comments.
fn uncommented(file: &str) -> String {
    let is_entry = |t: &str| {
        t.starts_with('[')
            || t.split_once(" = ").is_some_and(|(k, _)| {
                !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            })
    };
    file.lines()
        .map(|line| match line.strip_prefix("# ") {
            Some(t) if is_entry(t) => t,
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Each table's keys: `[models.NAME]` tables under `models.NAME`.
fn keys(toml: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut tables: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut table = String::new();
    for line in toml.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            table = match name.split_once('.') {
                Some(("models", _)) => "models.NAME".to_string(),
                _ => name.to_string(),
            };
            tables.entry(table.clone()).or_default();
        } else if let Some((key, _)) = line.split_once('=').filter(|_| !line.starts_with('#')) {
            tables
                .entry(table.clone())
                .or_default()
                .insert(key.trim().to_string());
        }
    }
    tables
}

fn owned(names: BTreeSet<&'static str>) -> BTreeSet<String> {
    names.into_iter().map(str::to_string).collect()
}

#[test]
fn the_installed_file_names_every_key_and_no_other() {
    let found = keys(&uncommented(FILE));
    let mut want: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    want.insert("models".into(), ["dir".to_string()].into()); // the rest are model tables
    want.insert("models.NAME".into(), owned(fields::<RawModel>()));
    want.insert("memory".into(), owned(fields::<RawMemory>()));
    want.insert("engine".into(), owned(fields::<RawEngine>()));
    want.insert("limits".into(), owned(fields::<RawLimits>()));
    want.insert("access".into(), owned(fields::<RawAccess>()));
    // Every table of the file is a section of the configuration.
    let sections = owned(fields::<RawConfig>());
    assert!(
        found
            .keys()
            .all(|t| sections.contains(t.split('.').next().unwrap_or(t))),
        "tables {:?}, sections {sections:?}",
        found.keys()
    );
    assert_eq!(found, want);
}

#[test]
fn the_installed_files_values_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leanstreamd.toml");
    // The model directory must exist: the packaged one is not installed here.
    let file = uncommented(FILE).replace(
        "dir = \"/usr/share/leanstream/models\"",
        &format!("dir = {:?}", dir.path().display().to_string()),
    );
    assert_ne!(file, uncommented(FILE), "the file names no models.dir");
    std::fs::write(&path, file).unwrap();
    let p = Params::load(&path, true).unwrap();
    assert_eq!(p.budget_bytes, 1 << 30);
    assert!(p.models.contains_key("smollm2") && p.models.contains_key("smollm2-small"));
}

#[test]
fn field_names_come_from_the_struct_and_entries_from_comments() {
    assert_eq!(fields::<RawMemory>(), ["budget"].into());
    assert_eq!(
        uncommented("# Prose = not a key\n# max_tokens = 5 # note\n# [t]"),
        "# Prose = not a key\nmax_tokens = 5 # note\n[t]"
    );
    let k = keys("[a]\nx = 1\n[models.m]\ny = 2\n# z = 3");
    assert_eq!(k["a"], ["x".to_string()].into());
    assert_eq!(k["models.NAME"], ["y".to_string()].into());
}
