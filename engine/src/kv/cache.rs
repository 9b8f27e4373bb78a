//! The blocks of one session's KV cache: how they are laid out, grown, shared, written and read.
//!
//! # Sharing and accounting
//! Blocks are held through `Arc`s. [`KvCache::prefix`] hands out clones of the `Arc`s of a
//! cache's first blocks as a [`KvPrefix`], and [`KvCache::adopt`] puts a prefix's into another
//! cache: several holders then read one allocation. A block is written only while its cache
//! holds it alone: [`KvCache::make_writable`] copies a shared block before positions in it are
//! written (copy-on-write), and [`KvCache::write`] copies one itself if nobody did.
//!
//! The accounting rule: every block is paid once. [`KvCache::bytes`] counts the block table
//! and the blocks the cache holds alone (`Arc::strong_count == 1`); a shared block is paid by
//! the holder of the [`KvPrefix`] that shares it ([`KvPrefix::bytes`] counts its blocks in
//! full). The sum over a prefix and the caches sharing its blocks is then what they allocated,
//! for as long as the prefix is held: a cache's count of a block changes without any
//! allocation when the other holders drop it (the last holder pays), and a block two caches
//! still share after its prefix is dropped is counted by neither until one of them copies or
//! frees it. [`KvCache::growth_bytes`] counts the copies a write will make, so a scheduler that
//! reserves them before [`KvCache::make_writable`] stays within its budget.

use std::mem::size_of;
use std::ops::Range;
use std::sync::Arc;

use super::block::{Block, Data, fresh_bytes};
use super::{KV_BLOCK_TOKENS, KvPrefix, KvRows, KvSpan, KvType};
use crate::quant::quantize_row_into;
use crate::{Error, Result};

/// Keys and values of every layer of one conversation, in blocks of [`KV_BLOCK_TOKENS`] tokens
/// (the last block of a `max_context` that is not a multiple holds only the tokens up to it).
///
/// Invariant: blocks are grown in order, so position `p` lives in block `p / KV_BLOCK_TOKENS`,
/// row `p % KV_BLOCK_TOKENS`, and block `i` holds `min(KV_BLOCK_TOKENS, max_context - i *
/// KV_BLOCK_TOKENS)` tokens (adopted blocks too: [`KvCache::adopt`] checks it); the block table
/// is reserved at creation for every block up to `max_context`, so growing or adopting never
/// reallocates it. A block may be shared with [`KvPrefix`]es and other caches (see the module
/// documentation for who pays for it); it is written only once this cache holds it alone.
#[derive(Debug)]
pub struct KvCache {
    kv: KvType,
    n_layers: usize,
    kv_dim: usize,
    max_context: usize,
    blocks: Vec<Arc<Block>>,
}

/// Entries of the block table of a cache of `max_context` tokens.
fn table_len(max_context: usize) -> usize {
    max_context.div_ceil(KV_BLOCK_TOKENS)
}

/// The blocks holding positions `writes` (empty when `writes` is).
fn blocks_of(writes: Range<usize>) -> Range<usize> {
    if writes.is_empty() {
        return 0..0;
    }
    writes.start / KV_BLOCK_TOKENS..(writes.end - 1) / KV_BLOCK_TOKENS + 1
}

impl KvCache {
    /// An empty cache (no block) of `n_layers` layers with rows of `kv_dim` values, for at most
    /// `max_context` tokens. Errors if `kv` cannot store rows of `kv_dim` values.
    pub fn new(kv: KvType, n_layers: usize, kv_dim: usize, max_context: usize) -> Result<KvCache> {
        kv.check(kv_dim)?;
        Ok(KvCache {
            kv,
            n_layers,
            kv_dim,
            max_context,
            blocks: Vec::with_capacity(table_len(max_context)),
        })
    }

    /// Heap bytes [`KvCache::new`] allocates for `max_context` tokens: its block table.
    pub fn open_bytes(max_context: usize) -> u64 {
        (table_len(max_context) * size_of::<Arc<Block>>()) as u64
    }

    /// Heap bytes of the blocks of a cache of `max_context` tokens grown to its end (the block
    /// table, [`KvCache::open_bytes`], apart): every block's storage and the `Arc` holding it.
    /// What a cache holding its blocks alone reaches at most; `max_context` =
    /// [`KV_BLOCK_TOKENS`] gives the bytes of one whole block.
    pub fn full_bytes(kv: KvType, n_layers: usize, kv_dim: usize, max_context: usize) -> u64 {
        (0..table_len(max_context))
            .map(|i| {
                let tokens = (max_context - i * KV_BLOCK_TOKENS).min(KV_BLOCK_TOKENS);
                fresh_bytes(kv, n_layers, kv_dim, tokens)
            })
            .sum()
    }

    /// The element type of the keys and values.
    pub fn kv_type(&self) -> KvType {
        self.kv
    }

    /// Tokens the allocated blocks hold (shared ones included).
    pub fn capacity(&self) -> usize {
        self.blocks.iter().map(|b| b.tokens).sum()
    }

    /// Heap bytes this cache pays for now: the block table and every block it holds alone, from
    /// their capacities. Blocks shared with a [`KvPrefix`] or another cache are the prefix
    /// holder's (see the module documentation). A snapshot: another holder dropping a block
    /// makes it this cache's.
    pub fn bytes(&self) -> u64 {
        let table = (self.blocks.capacity() * size_of::<Arc<Block>>()) as u64;
        let alone: u64 = self
            .blocks
            .iter()
            .filter(|b| Arc::strong_count(b) == 1)
            .map(|b| b.bytes())
            .sum();
        table + alone
    }

    /// Tokens block `i` holds.
    fn block_tokens(&self, i: usize) -> usize {
        (self.max_context - i * KV_BLOCK_TOKENS).min(KV_BLOCK_TOKENS)
    }

    /// Bytes of a fresh block `i`, as growing or copying it allocates.
    fn fresh_block_bytes(&self, i: usize) -> u64 {
        fresh_bytes(self.kv, self.n_layers, self.kv_dim, self.block_tokens(i))
    }

    /// Stored elements (f32 values or bytes) of one row.
    fn row_elems(&self) -> usize {
        match self.kv {
            KvType::F32 => self.kv_dim,
            KvType::F16 | KvType::Q8_0 => self.kv.row_bytes(self.kv_dim),
        }
    }

    /// The indices of the grown blocks holding positions `writes` that are shared.
    fn shared_blocks(&self, writes: Range<usize>) -> impl Iterator<Item = usize> + '_ {
        let blocks = blocks_of(writes);
        let grown = blocks.start.min(self.blocks.len())..blocks.end.min(self.blocks.len());
        grown.filter(|&i| Arc::strong_count(&self.blocks[i]) > 1)
    }

    /// Bytes [`KvCache::make_writable`]`(writes)` would allocate so that positions `writes` can
    /// be written: the blocks [`KvCache::grow`]`(writes.end)` adds, and a copy of every shared
    /// block holding one of the positions (0 when nothing is missing). Positions beyond
    /// `max_context` are not counted.
    pub fn growth_bytes(&self, writes: Range<usize>) -> u64 {
        let end = writes.end.min(self.max_context);
        let (mut have, mut bytes) = (self.capacity(), 0u64);
        let mut i = self.blocks.len();
        while have < end {
            bytes += self.fresh_block_bytes(i);
            have += self.block_tokens(i);
            i += 1;
        }
        let copies: u64 = self
            .shared_blocks(writes.start..end)
            .map(|i| self.fresh_block_bytes(i))
            .sum();
        bytes + copies
    }

    /// Allocates the blocks that [`KvCache::growth_bytes`]`(0..tokens)` counts, so positions
    /// `0..tokens` can be read and written ([`KvCache::write`] copies a shared block itself, or
    /// [`KvCache::make_writable`] does before). Errors if `tokens` exceeds `max_context` or the
    /// allocator refuses a block (the blocks grown before stay).
    pub fn grow(&mut self, tokens: usize) -> Result<()> {
        if tokens > self.max_context {
            return Err(Error::InvalidArgument {
                arg: "tokens",
                reason: format!(
                    "{tokens} positions do not fit in a context of {}",
                    self.max_context
                ),
            });
        }
        while self.capacity() < tokens {
            let t = self.block_tokens(self.blocks.len());
            let block = Block::zeroed(self.kv, t, 2 * self.n_layers * t * self.row_elems())?;
            self.blocks.push(Arc::new(block));
        }
        Ok(())
    }

    /// Allocates what [`KvCache::growth_bytes`]`(writes)` counts: grows to `writes.end`, then
    /// copies every shared block holding a position of `writes`, so that writing them allocates
    /// nothing. Errors like [`KvCache::grow`] (nothing allocated when `writes.end` is beyond
    /// `max_context`); the blocks grown or copied before a refusal stay.
    pub fn make_writable(&mut self, writes: Range<usize>) -> Result<()> {
        self.grow(writes.end)?;
        for i in blocks_of(writes) {
            let block = &mut self.blocks[i];
            if Arc::strong_count(block) > 1 {
                *block = Arc::new(block.try_clone()?);
            }
        }
        Ok(())
    }

    /// Frees every block this cache holds alone and lets go of the shared ones (the block table
    /// stays: it is part of what the cache holds at open).
    pub fn release(&mut self) {
        self.blocks.clear();
    }

    /// A snapshot of positions `0..n` that other caches can [`KvCache::adopt`]: the blocks
    /// holding them, shared (this cache stops paying for them: see the module documentation).
    /// Allocates only the prefix's block list. The positions are what was written there; the
    /// cache does not know which were, its caller does.
    ///
    /// Errors if `n` exceeds [`KvCache::capacity`].
    pub fn prefix(&self, n: usize) -> Result<KvPrefix> {
        if n > self.capacity() {
            return Err(Error::InvalidArgument {
                arg: "prefix",
                reason: format!(
                    "{n} positions exceed the {} the KV cache has grown",
                    self.capacity()
                ),
            });
        }
        Ok(KvPrefix {
            tokens: n,
            kv: self.kv,
            n_layers: self.n_layers,
            kv_dim: self.kv_dim,
            blocks: self.blocks[..n.div_ceil(KV_BLOCK_TOKENS)].to_vec(),
        })
    }

    /// Makes `prefix`'s blocks this cache's first blocks (shared with the prefix; a write copies
    /// one first), so positions `0..prefix.tokens()` read what the prefix's source wrote there.
    /// The cache's own blocks they replace are let go; blocks beyond them are kept, as after a
    /// reset. Allocates nothing.
    ///
    /// Errors, changing nothing, unless the prefix has this cache's KV type, `n_layers` and
    /// `kv_dim`, fits in its `max_context`, and each of its blocks holds as many tokens as this
    /// cache's block there would (no `max_context` cuts one of them short in one cache and not
    /// in the other).
    pub fn adopt(&mut self, prefix: &KvPrefix) -> Result<()> {
        if let Some(reason) = self.unadoptable(prefix) {
            return Err(Error::InvalidArgument {
                arg: "prefix",
                reason,
            });
        }
        for (i, block) in prefix.blocks.iter().enumerate() {
            match self.blocks.get_mut(i) {
                Some(slot) => *slot = Arc::clone(block),
                None => self.blocks.push(Arc::clone(block)),
            }
        }
        Ok(())
    }

    /// Why this cache cannot adopt `prefix` ([`KvCache::adopt`]), if it cannot.
    fn unadoptable(&self, prefix: &KvPrefix) -> Option<String> {
        let ours = (self.kv, self.n_layers, self.kv_dim);
        let theirs = (prefix.kv, prefix.n_layers, prefix.kv_dim);
        if ours != theirs {
            return Some(format!(
                "a prefix of {} KV, {} layers × {} values cannot be adopted by a cache of {} KV, \
                 {} layers × {} values",
                theirs.0, theirs.1, theirs.2, ours.0, ours.1, ours.2
            ));
        }
        if prefix.tokens > self.max_context {
            return Some(format!(
                "a prefix of {} tokens does not fit in a context of {}",
                prefix.tokens, self.max_context
            ));
        }
        let (i, block) = prefix
            .blocks
            .iter()
            .enumerate()
            .find(|(i, b)| b.tokens != self.block_tokens(*i))?;
        Some(format!(
            "block {i} of the prefix holds {} tokens, this cache's holds {}",
            block.tokens,
            self.block_tokens(i)
        ))
    }

    /// Writes the key and value of layer `l` at position `pos`, converted to the cache's type.
    /// Copies the block first if it is shared (an allocation nobody reserved, unless
    /// [`KvCache::make_writable`] made it before; it aborts when the allocator refuses).
    ///
    /// Panics if `pos` lies beyond the grown blocks or `k`, `v` are not `kv_dim` values (broken
    /// internal invariants: the session grows before it writes).
    pub fn write(&mut self, l: usize, pos: usize, k: &[f32], v: &[f32]) {
        assert!(
            pos < self.capacity() && l < self.n_layers,
            "KV write at layer {l}, position {pos} beyond the grown blocks"
        );
        assert!(k.len() == self.kv_dim && v.len() == self.kv_dim, "KV rows");
        let (row, dtype) = (self.row_elems(), self.kv.dtype());
        // Copy-on-write: a no-op on a block this cache holds alone.
        let block = Arc::make_mut(&mut self.blocks[pos / KV_BLOCK_TOKENS]);
        let plane = block.tokens * row;
        let at_k = 2 * l * plane + (pos % KV_BLOCK_TOKENS) * row;
        let at_v = at_k + plane;
        match &mut block.data {
            Data::F32(d) => {
                d[at_k..at_k + row].copy_from_slice(k);
                d[at_v..at_v + row].copy_from_slice(v);
            }
            Data::F16(d) | Data::Q8_0(d) => {
                quantize_row_into(dtype, k, &mut d[at_k..at_k + row]);
                quantize_row_into(dtype, v, &mut d[at_v..at_v + row]);
            }
        }
    }

    /// Layer `l`'s keys and values of positions `0..n_pos`, one span per block, in order. Rows
    /// are `kv_dim` values. Positions beyond the grown blocks are absent (the attention kernel
    /// then panics on its count).
    pub fn spans(&self, l: usize, n_pos: usize) -> impl Iterator<Item = KvSpan<'_>> + Clone + '_ {
        let row = self.row_elems();
        self.blocks
            .iter()
            .take(n_pos.div_ceil(KV_BLOCK_TOKENS))
            .enumerate()
            .map(move |(i, b)| {
                let plane = b.tokens * row;
                let (k, v) = (2 * l * plane, (2 * l + 1) * plane);
                let (keys, values) = match &b.data {
                    Data::F32(d) => (KvRows::F32(&d[k..v]), KvRows::F32(&d[v..v + plane])),
                    Data::F16(d) => (KvRows::F16(&d[k..v]), KvRows::F16(&d[v..v + plane])),
                    Data::Q8_0(d) => (KvRows::Q8_0(&d[k..v]), KvRows::Q8_0(&d[v..v + plane])),
                };
                KvSpan {
                    keys,
                    values,
                    positions: (n_pos - i * KV_BLOCK_TOKENS).min(b.tokens),
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::block::ARC_BLOCK_BYTES;
    use crate::quant::dequantize_row;

    fn row(pos: usize, l: usize, value: bool, kv_dim: usize) -> Vec<f32> {
        (0..kv_dim)
            .map(|j| ((pos * 31 + l * 7 + j + usize::from(value) * 3) % 17) as f32 / 8.0 - 1.0)
            .collect()
    }

    /// Row `p` of `rows` decoded to f32.
    fn decode(rows: KvRows<'_>, p: usize, kv_dim: usize) -> Vec<f32> {
        let mut out = vec![0f32; kv_dim];
        match rows {
            KvRows::F32(r) => out.copy_from_slice(&r[p * kv_dim..][..kv_dim]),
            KvRows::F16(r) => dequantize_row(KvType::F16.dtype(), &r[p * 2 * kv_dim..], &mut out),
            KvRows::Q8_0(r) => {
                let n = KvType::Q8_0.row_bytes(kv_dim);
                dequantize_row(KvType::Q8_0.dtype(), &r[p * n..][..n], &mut out)
            }
        }
        out
    }

    #[test]
    fn a_new_cache_holds_no_block_and_grows_whole_blocks() {
        let mut c = KvCache::new(KvType::F16, 2, 64, 1000).unwrap();
        assert_eq!((c.capacity(), c.bytes()), (0, KvCache::open_bytes(1000)));
        // The storage and the Arc's own allocation (its counts and the block's header).
        let block = (KV_BLOCK_TOKENS as u64) * KvType::F16.bytes_per_token(2, 64) + ARC_BLOCK_BYTES;
        assert_eq!(
            KvCache::full_bytes(KvType::F16, 2, 64, KV_BLOCK_TOKENS),
            block
        );
        assert_eq!(
            c.growth_bytes(0..1000),
            KvCache::full_bytes(KvType::F16, 2, 64, 1000)
        );
        assert_eq!(c.growth_bytes(0..0), 0);
        assert_eq!(c.growth_bytes(0..1), block);
        assert_eq!(c.growth_bytes(0..KV_BLOCK_TOKENS + 1), 2 * block);
        c.grow(KV_BLOCK_TOKENS + 1).unwrap();
        assert_eq!(c.capacity(), 2 * KV_BLOCK_TOKENS);
        assert_eq!(c.bytes(), KvCache::open_bytes(1000) + 2 * block);
        assert_eq!(c.growth_bytes(0..2 * KV_BLOCK_TOKENS), 0);
        assert_eq!(c.growth_bytes(70..2 * KV_BLOCK_TOKENS + 1), block);
        c.release();
        assert_eq!((c.capacity(), c.bytes()), (0, KvCache::open_bytes(1000)));
    }

    #[test]
    fn the_last_block_stops_at_max_context_and_growth_beyond_it_is_refused() {
        let max = KV_BLOCK_TOKENS + 36;
        let mut c = KvCache::new(KvType::Q8_0, 3, 64, max).unwrap();
        let per_token = KvType::Q8_0.bytes_per_token(3, 64);
        assert_eq!(
            c.growth_bytes(0..max + 50),
            max as u64 * per_token + 2 * ARC_BLOCK_BYTES
        );
        assert_eq!(
            KvCache::full_bytes(KvType::Q8_0, 3, 64, max),
            c.growth_bytes(0..max)
        );
        c.grow(max).unwrap();
        assert_eq!(c.capacity(), max);
        assert!(c.grow(max + 1).is_err());
        assert_eq!(c.capacity(), max);
    }

    #[test]
    fn rows_written_across_blocks_read_back_in_their_type() {
        let (layers, kv_dim, n) = (2, 64, 2 * KV_BLOCK_TOKENS + 5);
        for kv in KvType::ALL {
            let mut c = KvCache::new(kv, layers, kv_dim, 4 * KV_BLOCK_TOKENS).unwrap();
            c.grow(n).unwrap();
            for p in 0..n {
                for l in 0..layers {
                    c.write(l, p, &row(p, l, false, kv_dim), &row(p, l, true, kv_dim));
                }
            }
            let tol = match kv {
                KvType::F32 => 0.0,
                KvType::F16 => 1e-3,
                KvType::Q8_0 => 1.0 / 127.0,
            };
            for l in 0..layers {
                let spans: Vec<_> = c.spans(l, n).collect();
                assert_eq!(spans.len(), 3);
                assert_eq!(spans.iter().map(|s| s.positions).sum::<usize>(), n);
                let mut p = 0;
                for s in &spans {
                    for i in 0..s.positions {
                        for (rows, value) in [(s.keys, false), (s.values, true)] {
                            let got = decode(rows, i, kv_dim);
                            let want = row(p, l, value, kv_dim);
                            for (a, b) in got.iter().zip(&want) {
                                assert!((a - b).abs() <= tol, "{kv} l{l} p{p}: {a} vs {b}");
                            }
                        }
                        p += 1;
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "beyond the grown blocks")]
    fn a_write_before_growing_is_a_broken_invariant() {
        let mut c = KvCache::new(KvType::F32, 1, 32, 128).unwrap();
        c.write(0, 0, &[0.0; 32], &[0.0; 32]);
    }
}
