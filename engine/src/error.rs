//! The engine's one error type. Every variant carries enough context (file, tensor, offset) for a
//! user to see what is wrong without a debugger.

use std::path::PathBuf;

/// What a [`Grammar`](crate::constrain::Grammar) was compiled from; names the input in
/// [`Error::InvalidGrammar`]. Defined here, beside the error that carries it, so that the error
/// type depends on nothing else in the engine; [`crate::constrain`] re-exports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrammarKind {
    JsonSchema,
    Lark,
    Regex,
}

impl std::fmt::Display for GrammarKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GrammarKind::JsonSchema => "JSON Schema",
            GrammarKind::Lark => "Lark grammar",
            GrammarKind::Regex => "regex",
        })
    }
}

/// Errors from the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CUDA driver call failed (feature `cuda`).
    #[error("CUDA: {0}")]
    Cuda(String),
    /// An OS-level I/O failure on a named file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file whose bytes do not make sense (truncated, corrupted, wrong magic, bad offsets).
    #[error("{path}: invalid model file: {reason}")]
    InvalidFile { path: PathBuf, reason: String },
    /// A well-formed file that uses something we do not support (tensor type, architecture).
    #[error("{path}: unsupported: {reason}")]
    Unsupported { path: PathBuf, reason: String },
    /// A tensor the architecture needs is missing or has the wrong shape.
    #[error("{path}: tensor `{tensor}`: {reason}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    /// Tokenizer construction or encoding failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A JSON Schema, Lark grammar or regex for constrained decoding that does not compile
    /// (malformed JSON, an unsupported keyword, a syntax error); `reason` is the compiler's.
    #[error("invalid {kind}: {reason}")]
    InvalidGrammar { kind: GrammarKind, reason: String },
    /// Constrained decoding failed mid-generation: a token the grammar does not allow was
    /// advanced, no token can continue, or the parser hit one of its limits.
    #[error("constrained decoding: {0}")]
    Constraint(String),
    /// Chat template rendering failure.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A caller-supplied argument is out of range (e.g. a prompt longer than the context).
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },
    /// A chunk read that still failed after its retries.
    #[error("read of {len} bytes at offset {offset} failed after {attempts} attempt(s): {source}")]
    Read {
        offset: u64,
        len: usize,
        attempts: u32,
        #[source]
        source: std::io::Error,
    },
    /// A streamed FFN chunk whose bytes do not match the checksum the `.lsm` header records for
    /// it, read twice: the file was corrupted or replaced after it was opened. `expected` and
    /// `found` are CRC-32s (the last read's).
    #[error(
        "{path}: FFN layer {layer} chunk {chunk} checksum mismatch (expected {expected:#010x}, \
         read {found:#010x}, twice): the file is corrupted or was replaced while loaded"
    )]
    ChunkChecksum {
        path: PathBuf,
        layer: usize,
        chunk: usize,
        expected: u32,
        found: u32,
    },
    /// A read that ran past the end of the file: the file is shorter than when it was opened.
    #[error(
        "read of {len} bytes at offset {offset} ran past the end of the file: truncated while \
         loaded?"
    )]
    ShortRead { offset: u64, len: usize },
    /// A streamed FFN chunk that could not be read (`source` says why).
    #[error("{path}: reading FFN layer {layer} chunk {chunk}: {source}")]
    ChunkRead {
        path: PathBuf,
        layer: usize,
        chunk: usize,
        #[source]
        source: Box<Error>,
    },
    /// Something does not fit in the memory it was given; `needed` is the least that would do.
    #[error("{what} needs at least {needed} bytes but the budget is {budget} bytes")]
    OverBudget {
        what: String,
        needed: u64,
        budget: u64,
    },
    /// An OS resource other than a file could not be had (e.g. spawning a thread).
    #[error("{what}: {source}")]
    Os {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Result alias for the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for [`Error::InvalidFile`].
    pub fn invalid_file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::InvalidFile {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Unsupported`].
    pub fn unsupported(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Unsupported {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Io`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
