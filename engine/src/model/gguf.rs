//! GGUF reader. STUB: being written.
use std::path::Path;

use super::ImportedModel;
use crate::{Error, Result};

/// Imports a GGUF file.
pub fn import(path: &Path) -> Result<ImportedModel> {
    Err(Error::unsupported(path, "GGUF import not yet built"))
}
