//! The blocks of one session's KV cache: how they are laid out, grown, written and read.

use super::{KV_BLOCK_TOKENS, KvType};
use crate::backend::cpu::{KvRows, KvSpan};
use crate::quant::quantize_row_into;
use crate::{Error, Result};

/// One block: `tokens` positions of every layer, laid out `(n_layers, 2, tokens, row)` with keys
/// (index 0) before values (index 1), one row of a key or value per token.
#[derive(Debug)]
struct Block {
    tokens: usize,
    data: Data,
}

/// A block's storage, in its cache's element type.
#[derive(Debug)]
enum Data {
    F32(Vec<f32>),
    /// Little-endian f16 values.
    F16(Vec<u8>),
    /// GGUF Q8_0 blocks along each row.
    Q8_0(Vec<u8>),
}

/// Keys and values of every layer of one conversation, in blocks of [`KV_BLOCK_TOKENS`] tokens
/// (the last block of a `max_context` that is not a multiple holds only the tokens up to it).
///
/// Invariant: blocks are grown in order, so position `p` lives in block `p / KV_BLOCK_TOKENS`,
/// row `p % KV_BLOCK_TOKENS`; the block table is reserved at creation for every block up to
/// `max_context`, so growing never reallocates it.
#[derive(Debug)]
pub struct KvCache {
    kv: KvType,
    n_layers: usize,
    kv_dim: usize,
    max_context: usize,
    blocks: Vec<Block>,
}

/// Entries of the block table of a cache of `max_context` tokens.
fn table_len(max_context: usize) -> usize {
    max_context.div_ceil(KV_BLOCK_TOKENS)
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
        (table_len(max_context) * std::mem::size_of::<Block>()) as u64
    }

    /// The element type of the keys and values.
    pub fn kv_type(&self) -> KvType {
        self.kv
    }

    /// Tokens the allocated blocks hold.
    pub fn capacity(&self) -> usize {
        self.blocks.iter().map(|b| b.tokens).sum()
    }

    /// Heap bytes held now: the block table and every block, from their capacities.
    pub fn bytes(&self) -> u64 {
        let table = self.blocks.capacity() * std::mem::size_of::<Block>();
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| match &b.data {
                Data::F32(v) => v.capacity() * std::mem::size_of::<f32>(),
                Data::F16(v) | Data::Q8_0(v) => v.capacity(),
            })
            .sum();
        (table + blocks) as u64
    }

    /// Tokens block `i` holds.
    fn block_tokens(&self, i: usize) -> usize {
        (self.max_context - i * KV_BLOCK_TOKENS).min(KV_BLOCK_TOKENS)
    }

    /// Stored elements (f32 values or bytes) of one row.
    fn row_elems(&self) -> usize {
        match self.kv {
            KvType::F32 => self.kv_dim,
            KvType::F16 | KvType::Q8_0 => self.kv.row_bytes(self.kv_dim),
        }
    }

    /// Bytes [`KvCache::grow`]`(tokens)` would allocate so that `tokens` positions in all fit
    /// (0 when they already do). Positions beyond `max_context` are not counted.
    pub fn growth_bytes(&self, tokens: usize) -> u64 {
        let want = tokens.min(self.max_context);
        let (mut have, mut bytes) = (self.capacity(), 0u64);
        let per_token = self.kv.bytes_per_token(self.n_layers, self.kv_dim);
        let mut i = self.blocks.len();
        while have < want {
            let t = self.block_tokens(i);
            bytes += t as u64 * per_token;
            have += t;
            i += 1;
        }
        bytes
    }

    /// Allocates the blocks that [`KvCache::growth_bytes`]`(tokens)` counts, so positions
    /// `0..tokens` can be written. Errors if `tokens` exceeds `max_context` or the allocator
    /// refuses a block (the blocks grown before stay).
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
            let n = 2 * self.n_layers * t * self.row_elems();
            let data = match self.kv {
                KvType::F32 => Data::F32(zeroed(n, t)?),
                KvType::F16 => Data::F16(zeroed(n, t)?),
                KvType::Q8_0 => Data::Q8_0(zeroed(n, t)?),
            };
            self.blocks.push(Block { tokens: t, data });
        }
        Ok(())
    }

    /// Frees every block (the block table stays: it is part of what the cache holds at open).
    pub fn release(&mut self) {
        self.blocks.clear();
    }

    /// Writes the key and value of layer `l` at position `pos`, converted to the cache's type.
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
        let block = &mut self.blocks[pos / KV_BLOCK_TOKENS];
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

/// `n` zeroed elements of one block of `tokens` tokens, with an error instead of an abort when
/// the allocator refuses.
fn zeroed<T: Clone + Default>(n: usize, tokens: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| Error::Os {
        what: format!(
            "allocating a KV block of {tokens} tokens ({} bytes)",
            n * std::mem::size_of::<T>()
        ),
        source: std::io::Error::new(std::io::ErrorKind::OutOfMemory, e),
    })?;
    v.resize(n, T::default());
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let block = (KV_BLOCK_TOKENS as u64) * KvType::F16.bytes_per_token(2, 64);
        assert_eq!(c.growth_bytes(0), 0);
        assert_eq!(c.growth_bytes(1), block);
        assert_eq!(c.growth_bytes(KV_BLOCK_TOKENS + 1), 2 * block);
        c.grow(KV_BLOCK_TOKENS + 1).unwrap();
        assert_eq!(c.capacity(), 2 * KV_BLOCK_TOKENS);
        assert_eq!(c.bytes(), KvCache::open_bytes(1000) + 2 * block);
        assert_eq!(c.growth_bytes(2 * KV_BLOCK_TOKENS), 0);
        c.release();
        assert_eq!((c.capacity(), c.bytes()), (0, KvCache::open_bytes(1000)));
    }

    #[test]
    fn the_last_block_stops_at_max_context_and_growth_beyond_it_is_refused() {
        let max = KV_BLOCK_TOKENS + 36;
        let mut c = KvCache::new(KvType::Q8_0, 3, 64, max).unwrap();
        let per_token = KvType::Q8_0.bytes_per_token(3, 64);
        assert_eq!(c.growth_bytes(max + 50), max as u64 * per_token);
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
