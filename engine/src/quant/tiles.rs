//! Eight rows interleaved block by block ("tiles"): the layout the eight-row integer kernels read
//! without rearranging anything per token.
//!
//! Stored row by row, block `i` of eight rows sits in eight places a row apart. The eight-row
//! kernels then spend much of each block gathering: they transpose the rows' quant bytes into
//! columns (lane `r` holding row `r`'s bytes `4k..4k + 4`) and collect the eight `d` (and `m`)
//! one by one. A tile stores block `i` of its eight rows in exactly that order, once, at load:
//!
//! ```text
//! block i of the tile (8 × block_bytes bytes, at i · 8 · block_bytes):
//!   d of rows 0..8           8 × f16
//!   m of rows 0..8           8 × f16           (Q4_1 and Q5_1 only)
//!   word 0 of rows 0..8      8 × 4 bytes       (word w = the block's bytes after its scales,
//!   word 1 of rows 0..8      8 × 4 bytes        4w..4w + 4)
//!   ...
//! ```
//!
//! so the scales are one load each and every column one aligned 32-byte load. The bytes are
//! the same bytes, permuted: a tile is exactly as long as its eight rows, and the integer sums
//! the kernels form from it are the ones they form from the rows (`backend::cpu` tests that bit
//! for bit). Only the 32-value block types are tiled: after their one or two f16 scales, the rest
//! of a block is a whole number of 4-byte words (Q5's high bits are word 0).

use super::DType;

/// Rows per tile.
pub const TILE_ROWS: usize = 8;

/// Bytes of the largest block of a type that tiles (Q8_0's).
pub const MAX_BLOCK: usize = 34;

/// Bytes of a block's f16 scales (`d`, or `d` and `m`) for a type that tiles, `None` for the rest.
pub const fn scale_bytes(dtype: DType) -> Option<usize> {
    match dtype {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => Some(2),
        DType::Q4_1 | DType::Q5_1 => Some(4),
        _ => None,
    }
}

/// Whether rows of `dtype` can be stored as tiles.
pub const fn tiles(dtype: DType) -> bool {
    scale_bytes(dtype).is_some()
}

/// Where byte `at` of row `lane`'s block sits inside that block's part of a tile (which starts
/// at `i · 8 · block_bytes` for block `i`).
fn position(block_bytes: usize, scales: usize, lane: usize, at: usize) -> usize {
    if at < scales {
        // `d` of every row, then `m` of every row.
        (at / 2) * 2 * TILE_ROWS + 2 * lane + at % 2
    } else {
        let (w, b) = ((at - scales) / 4, (at - scales) % 4);
        debug_assert!(at < block_bytes);
        scales * TILE_ROWS + w * 4 * TILE_ROWS + 4 * lane + b
    }
}

/// Rewrites eight rows of `dtype` stored back to back (`bytes.len()` = 8 rows) as one tile, in
/// place. Panics unless `dtype` tiles and `bytes` is eight whole rows.
pub fn tile_in_place(dtype: DType, bytes: &mut [u8]) {
    tile_with(dtype, bytes, &mut Vec::new());
}

/// [`tile_in_place`] with `rows` as scratch for the eight rows' bytes.
fn tile_with(dtype: DType, bytes: &mut [u8], rows: &mut Vec<u8>) {
    let b = dtype.block_bytes();
    let s = scale_bytes(dtype).unwrap_or_else(|| panic!("{dtype} rows do not tile"));
    assert!(
        bytes.len().is_multiple_of(TILE_ROWS * b),
        "{} bytes are not eight rows of whole {dtype} blocks",
        bytes.len()
    );
    let row = bytes.len() / TILE_ROWS;
    rows.clear();
    rows.extend_from_slice(bytes);
    for (i, part) in bytes.chunks_exact_mut(TILE_ROWS * b).enumerate() {
        for lane in 0..TILE_ROWS {
            let block = &rows[lane * row + i * b..lane * row + (i + 1) * b];
            // The f16 scales, then the words; `position` says where each goes.
            for at in (0..s).step_by(2) {
                let to = position(b, s, lane, at);
                part[to..to + 2].copy_from_slice(&block[at..at + 2]);
            }
            for at in (s..b).step_by(4) {
                let to = position(b, s, lane, at);
                part[to..to + 4].copy_from_slice(&block[at..at + 4]);
            }
        }
    }
}

/// Rewrites a matrix of `rows` rows stored back to back (`bytes`) as [`QRows::as_tiled`] reads
/// it: every whole group of eight rows a tile, the last `rows % 8` rows left as they are.
/// Panics unless `dtype` tiles and `bytes` is `rows` whole rows.
///
/// [`QRows::as_tiled`]: crate::model::QRows::as_tiled
pub fn tile_matrix_in_place(dtype: DType, rows: usize, bytes: &mut [u8]) {
    assert!(
        rows > 0 && bytes.len().is_multiple_of(rows),
        "{} bytes are not {rows} rows",
        bytes.len()
    );
    let group = TILE_ROWS * (bytes.len() / rows);
    let mut scratch = Vec::with_capacity(group);
    for tile in bytes.chunks_exact_mut(group) {
        tile_with(dtype, tile, &mut scratch);
    }
}

/// The eight rows of a tile, back to back as stored before tiling (`out.len() == tile.len()`).
pub fn untile(dtype: DType, tile: &[u8], out: &mut [u8]) {
    assert_eq!(out.len(), tile.len(), "a tile and its rows are one length");
    let b = dtype.block_bytes();
    let row = tile.len() / TILE_ROWS;
    for lane in 0..TILE_ROWS {
        for i in 0..row / b {
            let at = lane * row + i * b;
            block_of(dtype, tile, lane, i, &mut out[at..at + b]);
        }
    }
}

/// Block `i` of row `lane` of a tile, as a row stores it (`out.len()` = one block). Panics unless
/// `dtype` tiles and the tile holds block `i`.
pub fn block_of(dtype: DType, tile: &[u8], lane: usize, i: usize, out: &mut [u8]) {
    let b = dtype.block_bytes();
    let s = scale_bytes(dtype).unwrap_or_else(|| panic!("{dtype} rows do not tile"));
    let part = &tile[i * TILE_ROWS * b..(i + 1) * TILE_ROWS * b];
    for (at, o) in out[..b].iter_mut().enumerate() {
        *o = part[position(b, s, lane, at)];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(dtype: DType, blocks: usize) -> Vec<u8> {
        (0..TILE_ROWS * blocks * dtype.block_bytes())
            .map(|i| (i * 7 + i / 251) as u8)
            .collect()
    }

    #[test]
    fn tiling_permutes_the_bytes_and_untiling_restores_them() {
        for dtype in DType::ALL.into_iter().filter(|&d| tiles(d)) {
            let before = rows(dtype, 3);
            let mut tiled = before.clone();
            tile_in_place(dtype, &mut tiled);
            assert_ne!(tiled, before, "{dtype}: tiling moves bytes");
            let (mut a, mut b) = (before.clone(), tiled.clone());
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b, "{dtype}: the same bytes");
            let mut back = vec![0u8; tiled.len()];
            untile(dtype, &tiled, &mut back);
            assert_eq!(back, before, "{dtype}");
        }
    }

    #[test]
    fn scales_come_first_then_one_word_of_every_row_per_column() {
        // Q4_1: d, m, then 16 quant bytes per block. Row r's bytes are marked with r.
        let dtype = DType::Q4_1;
        let mut bytes: Vec<u8> = (0..TILE_ROWS)
            .flat_map(|r| (0..20).map(move |at| (r * 20 + at) as u8))
            .collect();
        tile_in_place(dtype, &mut bytes);
        // d of rows 0 and 1, then m of row 0.
        assert_eq!(&bytes[..4], &[0, 1, 20, 21]);
        assert_eq!(&bytes[16..18], &[2, 3]);
        // Word 0 of row 0, then of row 1; word 1 of row 0 after all eight rows' word 0.
        assert_eq!(&bytes[32..40], &[4, 5, 6, 7, 24, 25, 26, 27]);
        assert_eq!(&bytes[64..68], &[8, 9, 10, 11]);
    }
}
