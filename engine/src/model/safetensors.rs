//! Hugging Face safetensors directory import. STUB: being written.
use std::path::Path;

use super::ImportedModel;
use crate::{Error, Result};

/// Imports a Hugging Face model directory.
pub fn import(path: &Path) -> Result<ImportedModel> {
    Err(Error::unsupported(path, "safetensors import not yet built"))
}
