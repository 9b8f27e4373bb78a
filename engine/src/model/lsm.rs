//! The LeanStream model file. STUB: being written.
use std::path::Path;

use super::Weights;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// File magic.
pub const MAGIC: [u8; 8] = *b"LEANSTRM";

/// Loads a `.lsm` file.
pub fn load(path: &Path) -> Result<(Weights, Tokenizer, Option<String>)> {
    Err(Error::unsupported(path, ".lsm not yet built"))
}
