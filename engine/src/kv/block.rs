//! One KV block: its storage, its bytes, and its allocation (fallible, fresh or as a copy).
//!
//! Blocks are held through an [`Arc`](std::sync::Arc) so that caches and prefixes can share
//! them ([`super::KvPrefix`]); a shared block is never written, its writer copies it first.

use std::mem::size_of;

use super::KvType;
use crate::{Error, Result};

/// One block: `tokens` positions of every layer, laid out `(n_layers, 2, tokens, row)` with keys
/// (index 0) before values (index 1), one row of a key or value per token.
///
/// `Clone` is what [`std::sync::Arc::make_mut`] calls when a shared block is written without
/// having been copied first; that copy aborts instead of erring when the allocator refuses, so
/// the cache copies with [`Block::try_clone`] ahead of the writes and `Clone` stays unused.
#[derive(Clone, Debug)]
pub(super) struct Block {
    pub tokens: usize,
    pub data: Data,
}

/// A block's storage, in its cache's element type.
#[derive(Clone, Debug)]
pub(super) enum Data {
    F32(Vec<f32>),
    /// Little-endian f16 values.
    F16(Vec<u8>),
    /// GGUF Q8_0 blocks along each row.
    Q8_0(Vec<u8>),
}

/// Bytes of the allocation an `Arc<Block>` makes besides the block's storage: the `Block`
/// itself after the two reference counts (`ArcInner` is `#[repr(C)]`: strong, weak, value).
pub(super) const ARC_BLOCK_BYTES: u64 = (2 * size_of::<usize>() + size_of::<Block>()) as u64;

/// Heap bytes of a block of `tokens` tokens of `n_layers` layers with rows of `kv_dim` values
/// in `kv`, held through an `Arc`: what growing or copying one allocates.
pub(super) fn fresh_bytes(kv: KvType, n_layers: usize, kv_dim: usize, tokens: usize) -> u64 {
    tokens as u64 * kv.bytes_per_token(n_layers, kv_dim) + ARC_BLOCK_BYTES
}

impl Block {
    /// A zeroed block of `tokens` tokens whose storage is `elems` elements of `kv`'s storage
    /// type (f32 values or bytes). Errors if the allocator refuses.
    pub fn zeroed(kv: KvType, tokens: usize, elems: usize) -> Result<Block> {
        let data = match kv {
            KvType::F32 => Data::F32(filled(elems, tokens, |v| v.resize(elems, 0.0))?),
            KvType::F16 => Data::F16(filled(elems, tokens, |v| v.resize(elems, 0))?),
            KvType::Q8_0 => Data::Q8_0(filled(elems, tokens, |v| v.resize(elems, 0))?),
        };
        Ok(Block { tokens, data })
    }

    /// A copy of this block in a fresh allocation of exactly its length. Errors if the allocator
    /// refuses.
    pub fn try_clone(&self) -> Result<Block> {
        let t = self.tokens;
        let data = match &self.data {
            Data::F32(d) => Data::F32(filled(d.len(), t, |v| v.extend_from_slice(d))?),
            Data::F16(d) => Data::F16(filled(d.len(), t, |v| v.extend_from_slice(d))?),
            Data::Q8_0(d) => Data::Q8_0(filled(d.len(), t, |v| v.extend_from_slice(d))?),
        };
        Ok(Block { tokens: t, data })
    }

    /// Heap bytes of this block held through an `Arc`: its storage (from its capacity) and
    /// [`ARC_BLOCK_BYTES`].
    pub fn bytes(&self) -> u64 {
        let storage = match &self.data {
            Data::F32(v) => v.capacity() * size_of::<f32>(),
            Data::F16(v) | Data::Q8_0(v) => v.capacity(),
        };
        storage as u64 + ARC_BLOCK_BYTES
    }
}

/// A vector with room for exactly `n` elements (of a block of `tokens` tokens), filled by
/// `fill`; an error instead of an abort when the allocator refuses.
fn filled<T>(n: usize, tokens: usize, fill: impl FnOnce(&mut Vec<T>)) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| Error::Os {
        what: format!(
            "allocating a KV block of {tokens} tokens ({} bytes)",
            n * size_of::<T>()
        ),
        source: std::io::Error::new(std::io::ErrorKind::OutOfMemory, e),
    })?;
    fill(&mut v);
    Ok(v)
}
