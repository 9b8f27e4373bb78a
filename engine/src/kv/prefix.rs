//! [`KvPrefix`]: the keys and values of a conversation's first tokens, frozen and shareable.

use std::mem::size_of;
use std::sync::Arc;

use super::KvType;
use super::block::Block;

/// An immutable snapshot of the first [`KvPrefix::tokens`] positions of a [`super::KvCache`]
/// (made by [`super::KvCache::prefix`]): clones of the `Arc`s of the blocks covering them, so
/// that caches adopting it ([`super::KvCache::adopt`]) read those positions without computing
/// them again, and a writer copies a block before changing it.
///
/// Whoever holds the prefix pays for its blocks ([`KvPrefix::bytes`] counts them in full) for
/// as long as it holds it; the caches sharing them do not count them. Its last block is whole:
/// rows beyond `tokens` hold what the source cache had there, which an adopter overwrites
/// before it reads them.
///
/// Keys and values depend on the weights (and precision) that computed them, which a prefix does
/// not know: adopt one only into sessions of the model it was made on. Not `Clone`: one holder
/// pays for it (share it through an `Arc` if several need it).
#[derive(Debug)]
pub struct KvPrefix {
    pub(super) tokens: usize,
    pub(super) kv: KvType,
    pub(super) n_layers: usize,
    pub(super) kv_dim: usize,
    /// The blocks covering positions `0..tokens`, in order (`tokens.div_ceil(KV_BLOCK_TOKENS)`).
    pub(super) blocks: Vec<Arc<Block>>,
}

impl KvPrefix {
    /// Positions the prefix holds: `0..tokens`.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The element type of its keys and values.
    pub fn kv_type(&self) -> KvType {
        self.kv
    }

    /// Whether a session reads any of its blocks (it holds them beside this prefix).
    pub fn in_use(&self) -> bool {
        self.blocks.iter().any(|b| Arc::strong_count(b) > 1)
    }

    /// Heap bytes the prefix holds, in full whoever else shares them: its block list and every
    /// block in it (whole blocks, from their capacities).
    pub fn bytes(&self) -> u64 {
        let list = (self.blocks.capacity() * size_of::<Arc<Block>>()) as u64;
        list + self.blocks.iter().map(|b| b.bytes()).sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{KV_BLOCK_TOKENS, KvCache};
    use super::*;
    use crate::kv::KvRows;

    const KV_DIM: usize = 32;

    /// A key row (or with `value`, a value row) marked by `mark` and its position.
    fn row(pos: usize, value: bool, mark: f32) -> Vec<f32> {
        (0..KV_DIM)
            .map(|j| mark + pos as f32 + j as f32 / 64.0 + f32::from(u8::from(value)) / 2.0)
            .collect()
    }

    fn write(c: &mut KvCache, pos: usize, mark: f32) {
        c.write(0, pos, &row(pos, false, mark), &row(pos, true, mark));
    }

    /// The key and value rows of layer 0 at `pos`, of an f32 cache.
    fn read(c: &KvCache, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let span = c.spans(0, pos + 1).last().unwrap();
        let at = (pos % KV_BLOCK_TOKENS) * KV_DIM;
        match (span.keys, span.values) {
            (KvRows::F32(k), KvRows::F32(v)) => {
                (k[at..at + KV_DIM].to_vec(), v[at..at + KV_DIM].to_vec())
            }
            _ => panic!("an f32 cache"),
        }
    }

    fn reads(c: &KvCache, pos: usize, mark: f32) -> bool {
        read(c, pos) == (row(pos, false, mark), row(pos, true, mark))
    }

    #[test]
    fn a_write_into_a_shared_block_copies_it_and_the_other_holders_keep_theirs() {
        let mut source = KvCache::new(KvType::F32, 1, KV_DIM, 256).unwrap();
        source.grow(100).unwrap();
        (0..100).for_each(|p| write(&mut source, p, 0.0));
        let prefix = source.prefix(70).unwrap();
        let mut adopter = KvCache::new(KvType::F32, 1, KV_DIM, 256).unwrap();
        adopter.adopt(&prefix).unwrap();
        assert!(reads(&adopter, 69, 0.0) && reads(&adopter, 0, 0.0));

        // Straight writes, nobody having made the blocks writable: `write` copies by itself.
        write(&mut source, 69, 1000.0);
        write(&mut adopter, 75, 2000.0);
        assert!(reads(&source, 69, 1000.0), "the source reads its write");
        assert!(reads(&adopter, 69, 0.0), "the adopter does not");
        assert!(reads(&adopter, 75, 2000.0), "the adopter reads its write");
        assert!(reads(&source, 75, 0.0), "the source does not");
        // Neither reached the prefix: a late adopter reads the source's first rows.
        let mut late = KvCache::new(KvType::F32, 1, KV_DIM, 256).unwrap();
        late.adopt(&prefix).unwrap();
        assert!(reads(&late, 69, 0.0) && reads(&late, 75, 0.0));
        // Block 0, never written since, is still one allocation for all four holders.
        assert_eq!(
            source.bytes(),
            KvCache::open_bytes(256) + prefix.blocks[1].bytes()
        );
    }

    #[test]
    fn make_writable_counts_and_copies_only_the_shared_blocks_it_will_write() {
        let mut source = KvCache::new(KvType::F32, 1, KV_DIM, 256).unwrap();
        source.make_writable(0..130).unwrap();
        let prefix = source.prefix(130).unwrap();
        let block = prefix.blocks[0].bytes();
        let open = KvCache::open_bytes(256);
        assert_eq!(source.bytes(), open, "three blocks, all shared");
        assert_eq!(source.growth_bytes(130..131), block, "block 2 is copied");
        assert_eq!(
            source.growth_bytes(60..200),
            3 * block + block,
            "blocks 0-2 and block 3"
        );
        assert_eq!(source.growth_bytes(130..130), 0, "no write, no copy");
        source.make_writable(60..70).unwrap();
        assert_eq!(source.bytes(), open + 2 * block, "blocks 0 and 1, not 2");
        assert_eq!(source.growth_bytes(0..128), 0);
        assert_eq!(prefix.bytes(), 3 * block + 3 * size_of::<usize>() as u64);
    }

    #[test]
    fn a_prefix_beyond_the_grown_blocks_is_refused_and_one_of_them_shares_them_whole() {
        let mut c = KvCache::new(KvType::F16, 2, KV_DIM, 256).unwrap();
        assert!(c.prefix(1).is_err());
        assert_eq!(c.prefix(0).unwrap().blocks.len(), 0);
        c.grow(70).unwrap();
        let err = c.prefix(129).unwrap_err().to_string();
        assert!(err.contains("129 positions exceed the 128"), "{err}");
        let p = c.prefix(128).unwrap();
        assert_eq!(
            (p.tokens(), p.kv_type(), p.blocks.len()),
            (128, KvType::F16, 2)
        );
        assert_eq!(c.prefix(65).unwrap().blocks.len(), 2);
        assert_eq!(c.prefix(64).unwrap().blocks.len(), 1);
    }

    #[test]
    fn adopting_keeps_the_own_blocks_beyond_the_prefix() {
        let mut source = KvCache::new(KvType::F32, 1, KV_DIM, 256).unwrap();
        source.grow(64).unwrap();
        write(&mut source, 10, 0.0);
        let prefix = source.prefix(64).unwrap();
        let mut c = KvCache::new(KvType::F32, 1, KV_DIM, 256).unwrap();
        c.grow(200).unwrap();
        write(&mut c, 10, 5.0);
        let pointer = size_of::<usize>() as u64;
        let (open, block) = (KvCache::open_bytes(256), prefix.bytes() - pointer);
        assert_eq!(c.bytes(), open + 4 * block);
        c.adopt(&prefix).unwrap();
        assert!(reads(&c, 10, 0.0), "block 0 is the prefix's");
        assert_eq!((c.capacity(), c.bytes()), (256, open + 3 * block));
    }
}
