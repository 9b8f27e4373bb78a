//! A session's KV cache: keys and values of every layer, stored as f16 (the default), q8_0 or
//! f32, in blocks of [`KV_BLOCK_TOKENS`] tokens allocated as the conversation grows.
//!
//! - [`KvType`]: the element type, chosen per session;
//! - [`KvCache`]: the blocks, their bytes, growth, writes and the per-layer [`KvSpan`]s (runs of
//!   [`KvRows`]) the CPU attention kernel ([`crate::backend::cpu::attend_spans`]) reads in place;
//! - [`KvPrefix`]: a cache's first positions frozen, so that caches of conversations starting
//!   with the same tokens share those blocks (copy-on-write) instead of computing them again.
//!
//! A session's `max_context` is a limit, not a reservation: the cache holds whole blocks up to
//! the positions written, and only the last block may be partly empty. A block shared through a
//! [`KvPrefix`] is paid once, by the prefix's holder (the rule is stated in `cache.rs`'s module
//! documentation and on [`KvCache::bytes`]).

mod block;
mod cache;
mod prefix;

use std::fmt;
use std::str::FromStr;

pub use cache::KvCache;
pub use prefix::KvPrefix;

use crate::quant::{DType, QK};
use crate::{Error, Result};

/// Tokens per KV block. A block holds every layer's keys and values of these tokens in one
/// allocation: f16 on SmolLM2-135M (30 layers, kv_dim 192) is 1.4 MiB a block, on Llama-2-7B
/// shapes (32 layers, kv_dim 4096) 32 MiB. 64 keeps the unused tail of a session under 64 tokens
/// (under 1.6 % of a 4096-token context, 32 MiB at worst on 7B shapes) while a 4096-token
/// conversation needs only 64 allocations, each amortised over 64 forward passes; 128 would
/// halve a count that costs nothing and double the waste a tight budget has to carry. A multiple
/// of [`crate::forward::MAX_BATCH`], so a prefill chunk crosses at most one block boundary.
pub const KV_BLOCK_TOKENS: usize = 64;

/// Keys or values of consecutive cached positions, one row of `stride` values per position
/// (row `p` starts at value `p * stride`), in the element type of the cache.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    /// Plain f32 values.
    F32(&'a [f32]),
    /// f16 values, little-endian, 2 bytes each.
    F16(&'a [u8]),
    /// GGUF Q8_0 blocks along each row (`stride` is a multiple of 32): 34 bytes per 32 values,
    /// value = f16 scale × i8.
    Q8_0(&'a [u8]),
}

/// A run of consecutive cached positions of one layer: their keys and values.
#[derive(Clone, Copy, Debug)]
pub struct KvSpan<'a> {
    pub keys: KvRows<'a>,
    pub values: KvRows<'a>,
    /// Positions held by `keys` and `values`.
    pub positions: usize,
}

/// Element type of a session's KV cache. Attention reads it in this type; the keys and values
/// are computed in f32 and converted when written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    /// IEEE half precision: half the bytes of f32, about 3 decimal digits per value.
    #[default]
    F16,
    /// Plain f32: exactly the numbers of the reference forward pass.
    F32,
    /// GGUF Q8_0 blocks of 32 values with one f16 scale (34 bytes per 32 values): 27 % of f32.
    Q8_0,
}

impl KvType {
    /// Every type, default first.
    pub const ALL: [KvType; 3] = [KvType::F16, KvType::F32, KvType::Q8_0];

    /// Lower-case name, as the CLI and configuration spell it: `f16`, `f32` or `q8_0`.
    pub const fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// The tensor element type rows of this cache are stored in.
    pub const fn dtype(self) -> DType {
        match self {
            KvType::F16 => DType::F16,
            KvType::F32 => DType::F32,
            KvType::Q8_0 => DType::Q8_0,
        }
    }

    /// Errors unless rows of `kv_dim` values can be stored in this type (q8_0 needs whole blocks
    /// of 32).
    pub fn check(self, kv_dim: usize) -> Result<()> {
        if self.dtype().row_bytes(kv_dim).is_none() {
            return Err(Error::InvalidArgument {
                arg: "kv_type",
                reason: format!(
                    "{self} stores rows in blocks of {QK} values; this model's kv_dim is {kv_dim}"
                ),
            });
        }
        Ok(())
    }

    /// Bytes of one stored row of `kv_dim` values (a key or a value of one layer and token).
    ///
    /// Panics if [`KvType::check`] refuses `kv_dim`.
    pub fn row_bytes(self, kv_dim: usize) -> usize {
        self.dtype()
            .row_bytes(kv_dim)
            .unwrap_or_else(|| panic!("{kv_dim} values are not whole {self} rows"))
    }

    /// KV cache bytes one token takes: a key and a value row in each of `n_layers` layers.
    ///
    /// Panics if [`KvType::check`] refuses `kv_dim`.
    pub fn bytes_per_token(self, n_layers: usize, kv_dim: usize) -> u64 {
        (2 * n_layers * self.row_bytes(kv_dim)) as u64
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = Error;

    /// Parses `f16`, `f32` or `q8_0` (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<KvType> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::InvalidArgument {
                arg: "kv_type",
                reason: format!("`{s}` is not a KV cache type; choose one of f16, f32, q8_0"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_to_their_type_and_others_list_the_choices() {
        for t in KvType::ALL {
            assert_eq!(t.to_string().parse::<KvType>().unwrap(), t);
        }
        assert_eq!("Q8_0".parse::<KvType>().unwrap(), KvType::Q8_0);
        assert_eq!(KvType::default(), KvType::F16);
        let err = "q4_0".parse::<KvType>().unwrap_err().to_string();
        assert!(
            err.contains("`q4_0`") && err.contains("f16, f32, q8_0"),
            "{err}"
        );
    }

    #[test]
    fn bytes_per_token_follow_the_stored_type() {
        // SmolLM2-135M: 30 layers, kv_dim 192.
        assert_eq!(KvType::F32.bytes_per_token(30, 192), 46_080);
        assert_eq!(KvType::F16.bytes_per_token(30, 192), 23_040);
        assert_eq!(KvType::Q8_0.bytes_per_token(30, 192), 12_240);
        // Llama-2-7B shapes: 32 layers, kv_dim 4096.
        assert_eq!(KvType::F32.bytes_per_token(32, 4096), 1_048_576);
        assert_eq!(KvType::F16.bytes_per_token(32, 4096), 524_288);
        assert_eq!(KvType::Q8_0.bytes_per_token(32, 4096), 278_528);
    }

    #[test]
    fn q8_0_refuses_rows_that_are_not_whole_blocks() {
        assert!(KvType::Q8_0.check(48).is_err());
        assert!(KvType::Q8_0.check(64).is_ok());
        assert!(KvType::F16.check(48).is_ok());
    }
}
