//! Matrices stored as tiles ([`crate::quant::tiles`]) give every table the bits of the same rows
//! stored as rows: through the tile kernels where a table has them, by untiling where not.

use super::*;
use crate::quant::tiles::{self, TILE_ROWS};

/// A copy of `m` (contiguous) stored as tiles.
fn tiled(m: &QRows) -> QRows {
    let mut bytes = m.backing().as_slice().to_vec();
    tiles::tile_matrix_in_place(m.dtype, m.rows, &mut bytes);
    QRows::contiguous(m.dtype, m.rows, m.cols, TensorBytes::from_vec(bytes))
        .and_then(|q| q.as_tiled())
        .expect("a tiled copy")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn tiled_matrices_give_the_bits_of_their_rows_in_every_table_and_precision() {
    let mut rng = Rng(41);
    for k in tables() {
        for dtype in DTYPES.into_iter().filter(|&d| tiles::tiles(d)) {
            // Eight rows exactly, tiles and a tail, and a tail only.
            for (rows, blocks) in [(8, 1), (29, 3), (70, 18), (5, 2)] {
                let cols = 32 * blocks;
                let m = matrix(&mut rng, dtype, rows, cols, false);
                let t = tiled(&m);
                assert_eq!(t.tiled_rows(), rows / 8 * 8);
                for n in [1, 3, TOKEN_GROUP] {
                    let x = rng.vec(n * cols, 2.0);
                    for precision in [Precision::Exact, Precision::Fast] {
                        let what = format!(
                            "{} {dtype} {rows}x{cols} {precision:?}, {n} tokens",
                            k.name()
                        );
                        let mut scratch = QuantizedActs::new(x.len());
                        let prepared = k.prepare(&x, precision, &mut scratch);
                        for first in [0, TILE_ROWS].into_iter().filter(|&f| f < rows) {
                            let mut want = vec![vec![f32::NAN; rows - first]; n];
                            let mut got = want.clone();
                            let mut w: Vec<&mut [f32]> =
                                want.iter_mut().map(|o| &mut o[..]).collect();
                            k.rows_dot_each(&m, first, prepared, &mut w);
                            let mut g: Vec<&mut [f32]> =
                                got.iter_mut().map(|o| &mut o[..]).collect();
                            k.rows_dot_each(&t, first, prepared, &mut g);
                            for (a, b) in got.iter().zip(&want) {
                                assert_eq!(bits(a), bits(b), "{what} from row {first}");
                            }
                        }
                        let mut single = QuantizedActs::new(cols);
                        let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
                        k.matvec(&m, &x[..cols], &mut a, precision, &mut single);
                        k.matvec(&t, &x[..cols], &mut b, precision, &mut single);
                        assert_eq!(bits(&b), bits(&a), "{what}: matvec");
                    }
                }
            }
        }
    }
}

#[test]
fn a_tiled_row_dequantises_to_its_values() {
    let mut rng = Rng(43);
    for dtype in DTYPES.into_iter().filter(|&d| tiles::tiles(d)) {
        let m = matrix(&mut rng, dtype, 19, 96, false);
        let t = tiled(&m);
        for i in 0..19 {
            let (mut a, mut b) = (vec![0f32; 96], vec![1f32; 96]);
            m.dequantize_row(i, &mut a);
            t.dequantize_row(i, &mut b);
            assert_eq!(bits(&b), bits(&a), "{dtype} row {i}");
        }
    }
}

#[test]
#[should_panic(expected = "stored in tiles")]
fn a_tiled_row_is_not_read_as_a_row() {
    let m = matrix(&mut Rng(47), DType::Q4_1, 16, 64, false);
    let _ = tiled(&m).row(3);
}

#[test]
fn pieces_of_a_tiled_matrix_keep_whole_tiles() {
    let m = matrix(&mut Rng(53), DType::Q8_0, 21, 64, false);
    let t = tiled(&m);
    assert!(t.sub_rows(4..16).is_none(), "starts inside a tile");
    assert!(t.sub_rows(0..12).is_none(), "ends inside a tile");
    let piece = t.sub_rows(8..21).expect("a tile and the tail");
    assert_eq!(piece.tiled_rows(), 8);
    assert_eq!(
        t.sub_rows(16..18).expect("rows of the tail").tiled_rows(),
        0
    );
    // Types that do not tile, and grouped rows, are refused.
    assert!(
        matrix(&mut Rng(59), DType::Q4K, 8, 256, false)
            .as_tiled()
            .is_none()
    );
    assert!(
        matrix(&mut Rng(61), DType::Q4_1, 8, 64, true)
            .as_tiled()
            .is_none()
    );
}

/// Every SIMD table has a tile kernel for every type that tiles (so a load for it stores them
/// as tiles, and the test above compares those kernels); the scalar table untiles.
#[test]
fn every_simd_table_reads_tiles_of_every_tiling_type() {
    for k in tables() {
        for dtype in DTYPES {
            let want = k.name() != "scalar" && tiles::tiles(dtype);
            assert_eq!(k.reads_tiles(dtype), want, "{} {dtype}", k.name());
        }
    }
}
