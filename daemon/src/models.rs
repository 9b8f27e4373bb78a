//! The model directory: a model's name is the stem of a `.lsm` or `.gguf` file directly in the
//! configured directory. A client never names a path: names with separators, `..`, NUL or a
//! leading `/` are refused, and a file (or symlink) whose real path lies outside the directory
//! does not exist as far as clients are concerned.
//!
//! Policy: a malformed name is `InvalidArgument`; a well-formed name with no file, or whose file
//! resolves outside the directory, is `ModelNotFound` (a client learns nothing about the rest of
//! the file system).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use leanstream::contract::LeanStreamError;

/// Extensions a model file may have, in lookup order (a converted `.lsm` wins over its `.gguf`).
pub const EXTENSIONS: [&str; 2] = ["lsm", "gguf"];

/// Longest model name accepted.
const MAX_NAME: usize = 255;

/// A model file found in the directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFile {
    pub name: String,
    /// `lsm` or `gguf`.
    pub format: &'static str,
    /// Canonical path, inside the model directory.
    pub path: PathBuf,
    pub bytes: u64,
}

/// Checks that `name` is a plain file stem.
pub fn check_name(name: &str) -> Result<(), LeanStreamError> {
    let invalid = |why: &str| {
        Err(LeanStreamError::InvalidArgument(format!(
            "model name {name:?} {why}"
        )))
    };
    if name.is_empty() {
        return invalid("is empty");
    }
    if name.len() > MAX_NAME {
        return invalid("is too long");
    }
    if name.contains(['/', '\\', '\0']) {
        return invalid("contains a path separator or NUL (give a model name, not a path)");
    }
    if name == "." || name == ".." || name.starts_with('.') {
        return invalid("starts with a dot");
    }
    if name.chars().any(char::is_control) {
        return invalid("contains control characters");
    }
    Ok(())
}

/// Resolves `name` in the canonical directory `dir`. Blocking (file system): call off the async
/// workers or accept a few syscalls.
pub fn resolve(dir: &Path, name: &str) -> Result<ModelFile, LeanStreamError> {
    check_name(name)?;
    for ext in EXTENSIONS {
        let candidate = dir.join(format!("{name}.{ext}"));
        if let Some(found) = inspect(dir, &candidate, name, ext) {
            return Ok(found);
        }
    }
    Err(LeanStreamError::ModelNotFound(format!(
        "no model {name:?} (a {name}.lsm or {name}.gguf file in the model directory)"
    )))
}

/// The file at `candidate` if it is a regular file whose real path is inside `dir`.
fn inspect(dir: &Path, candidate: &Path, name: &str, ext: &'static str) -> Option<ModelFile> {
    let real = candidate.canonicalize().ok()?;
    if !real.starts_with(dir) {
        if first_sight(candidate) {
            tracing::warn!(
                "model {name:?}: {} resolves outside the model directory; ignored",
                candidate.display()
            );
        }
        return None;
    }
    let meta = std::fs::metadata(&real).ok()?;
    meta.is_file().then(|| ModelFile {
        name: name.to_string(),
        format: ext,
        path: real,
        bytes: meta.len(),
    })
}

/// Whether `path` is reported for the first time: a bad file is logged once per process, not
/// once per `ListModels` call (a client polling the list would flood the journal).
fn first_sight(path: &Path) -> bool {
    static SEEN: std::sync::Mutex<BTreeSet<PathBuf>> = std::sync::Mutex::new(BTreeSet::new());
    SEEN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(path.to_path_buf())
}

/// Every model in `dir`, sorted by name (one entry per name; `.lsm` preferred).
pub fn list(dir: &Path) -> std::io::Result<Vec<ModelFile>> {
    let mut out: Vec<ModelFile> = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let (Some(stem), Some(ext)) = (
            path.file_stem().and_then(|s| s.to_str()),
            path.extension().and_then(|s| s.to_str()),
        ) else {
            continue;
        };
        if !EXTENSIONS.contains(&ext) {
            continue;
        }
        if check_name(stem).is_err() || out.iter().any(|m| m.name == stem) {
            continue;
        }
        if let Ok(found) = resolve(dir, stem) {
            out.push(found);
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn names_resolve_only_inside_the_directory() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("models");
        std::fs::create_dir(&dir).unwrap();
        let dir = dir.canonicalize().unwrap();
        std::fs::write(dir.join("tiny.gguf"), b"0123").unwrap();
        std::fs::write(dir.join("tiny.lsm"), b"01234567").unwrap();
        std::fs::write(dir.join("other.gguf"), b"x").unwrap();
        std::fs::write(dir.join("notes.txt"), b"x").unwrap();
        std::fs::write(root.path().join("secret.gguf"), b"x").unwrap();
        std::os::unix::fs::symlink(root.path().join("secret.gguf"), dir.join("escape.gguf"))
            .unwrap();
        std::os::unix::fs::symlink(dir.join("other.gguf"), dir.join("alias.gguf")).unwrap();

        let m = resolve(&dir, "tiny").unwrap();
        assert_eq!((m.format, m.bytes), ("lsm", 8));
        assert_eq!(resolve(&dir, "alias").unwrap().bytes, 1);
        for name in ["escape", "missing", "notes"] {
            assert!(
                matches!(resolve(&dir, name), Err(LeanStreamError::ModelNotFound(_))),
                "{name}"
            );
        }
        for name in [
            "../secret",
            "/etc/passwd",
            "..",
            ".",
            "",
            "a\0b",
            "a/b",
            ".hidden",
        ] {
            assert!(
                matches!(
                    resolve(&dir, name),
                    Err(LeanStreamError::InvalidArgument(_))
                ),
                "{name:?}"
            );
        }
        let names: Vec<_> = list(&dir).unwrap().into_iter().map(|m| m.name).collect();
        assert_eq!(names, ["alias", "other", "tiny"]);
        // The escaping link was reported above; listing again does not report it again.
        assert!(!first_sight(&dir.join("escape.gguf")));
        assert!(first_sight(&dir.join("never-seen.gguf")));
        assert!(!first_sight(&dir.join("never-seen.gguf")));
    }
}
