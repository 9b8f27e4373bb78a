//! `ListModels`, answered outside the state owner: the model directory's files, each with the
//! architecture and quantisation read from its header. A header is parsed once per file version
//! (path, size, modification time), not once per call; a call lists the directory and checks
//! each file's metadata on a blocking thread, one call at a time, so a client that floods
//! `ListModels` waits on its own calls and delays nobody else's requests.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use leanstream::contract::{LeanStreamError, ModelInfo};
use leanstream_engine::model::summarize;
use tokio::sync::{Mutex, watch};

use crate::models;

/// What one file version's header says: architecture and quantisation, or `unknown` and why.
#[derive(Clone, Debug)]
struct Summary {
    /// Size and modification time of the version summarised.
    stamp: (u64, Option<SystemTime>),
    architecture: String,
    quantization: String,
}

/// The model directory's list, with a cache of header summaries.
#[derive(Debug)]
pub struct Catalog {
    dir: PathBuf,
    /// Summaries by canonical path. The lock also makes calls take turns.
    summaries: Mutex<HashMap<PathBuf, Summary>>,
    /// The models loaded and ready (published by the state owner).
    loaded: watch::Receiver<BTreeSet<String>>,
}

impl Catalog {
    pub fn new(dir: PathBuf, loaded: watch::Receiver<BTreeSet<String>>) -> Catalog {
        Catalog {
            dir,
            summaries: Mutex::default(),
            loaded,
        }
    }

    /// Every model in the directory, sorted by name.
    pub async fn list(&self) -> Result<Vec<ModelInfo>, LeanStreamError> {
        let mut summaries = self.summaries.lock().await;
        let known = std::mem::take(&mut *summaries);
        let dir = self.dir.clone();
        let (files, fresh) = tokio::task::spawn_blocking(move || survey(&dir, known))
            .await
            .map_err(|e| LeanStreamError::Internal(e.to_string()))?
            .map_err(|e| LeanStreamError::Internal(format!("reading the model directory: {e}")))?;
        let loaded = self.loaded.borrow().clone();
        let infos = files
            .into_iter()
            .map(|f| {
                let s = &fresh[&f.path];
                ModelInfo {
                    loaded: loaded.contains(&f.name),
                    architecture: s.architecture.clone(),
                    quantization: s.quantization.clone(),
                    name: f.name,
                    format: f.format.to_string(),
                    file_bytes: f.bytes,
                }
            })
            .collect();
        *summaries = fresh;
        Ok(infos)
    }
}

/// Lists `dir` and summarises each file, reusing `known` summaries of unchanged files. Returns
/// the files and the summaries of exactly those files (a removed file's summary is dropped).
fn survey(
    dir: &Path,
    mut known: HashMap<PathBuf, Summary>,
) -> std::io::Result<(Vec<models::ModelFile>, HashMap<PathBuf, Summary>)> {
    let files = models::list(dir)?;
    let mut fresh = HashMap::with_capacity(files.len());
    for f in &files {
        let modified = std::fs::metadata(&f.path).and_then(|m| m.modified()).ok();
        let stamp = (f.bytes, modified);
        let summary = match known.remove(&f.path) {
            Some(s) if s.stamp == stamp => s,
            _ => {
                let (architecture, quantization) = match summarize(&f.path) {
                    Ok(s) => (s.architecture, s.quantization),
                    Err(e) => ("unknown".to_string(), e.to_string()),
                };
                Summary {
                    stamp,
                    architecture,
                    quantization,
                }
            }
        };
        fresh.insert(f.path.clone(), summary);
    }
    Ok((files, fresh))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_header_is_read_again_only_when_its_file_changes() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().canonicalize().unwrap();
        std::fs::write(dir.join("broken.gguf"), b"not a model").unwrap();
        let (files, first) = survey(&dir, HashMap::new()).unwrap();
        assert_eq!(files.len(), 1);
        let path = &files[0].path;
        assert_eq!(first[path].architecture, "unknown");
        // A summary that the file's stamp still matches is reused as it is (a marker shows it).
        let mut marked = first.clone();
        marked.get_mut(path).unwrap().quantization = "from the cache".into();
        let (_, second) = survey(&dir, marked).unwrap();
        assert_eq!(second[path].quantization, "from the cache");
        // A file that changed size is read again.
        std::fs::write(dir.join("broken.gguf"), b"still not a model, longer").unwrap();
        let mut marked = second.clone();
        marked.get_mut(path).unwrap().quantization = "from the cache".into();
        let (_, third) = survey(&dir, marked).unwrap();
        assert_ne!(third[path].quantization, "from the cache");
        // A removed file's summary goes.
        std::fs::remove_file(path).unwrap();
        let (files, fourth) = survey(&dir, third).unwrap();
        assert!(files.is_empty() && fourth.is_empty());
    }
}
