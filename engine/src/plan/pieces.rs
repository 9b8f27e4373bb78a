//! How a layer's weights are cut into pieces: row ranges of its matrices of at most
//! [`PIECE_BYTES`], in the order the forward pass computes them. The cut depends on the model's
//! shapes only, never on the budget, so a layer computes piece by piece in the same way whether
//! it is resident or streamed — and its results are the same bits either way.

use std::ops::Range;

use crate::model::{Down, LayerWeights, QRows};

/// The largest piece by default ([`pieces`] takes any size: tests cut tiny models small): the
/// weight stream's read unit of a 7B-shape layer (its attention matrices
/// are ~9 MiB in Q4_0) is about this size, so its ring of three slots holds tens of megabytes
/// rather than three whole layers.
pub const PIECE_BYTES: usize = 8 << 20;

/// What a piece of a layer computes, in compute order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    /// Rows of `wq`, `wk`, `wv`, `wo`.
    Q,
    K,
    V,
    O,
    /// The gate and up rows of the same neurons (a layer whose down matrix has a row per output).
    GateUp,
    /// Rows of a down matrix with a row per output.
    Down,
    /// The gate row, up row and down column of the same neurons (a `.lsm` layer's bundles).
    Neurons,
}

impl Part {
    /// The parts of `layer`, in compute order.
    pub fn of(layer: &LayerWeights) -> &'static [Part] {
        match layer.ffn.down {
            Down::Rows(_) => &[Part::Q, Part::K, Part::V, Part::O, Part::GateUp, Part::Down],
            Down::Neurons(_) => &[Part::Q, Part::K, Part::V, Part::O, Part::Neurons],
        }
    }

    /// Whether this part is the FFN's (what a layer that streams by neuron leaves out).
    pub fn is_ffn(self) -> bool {
        matches!(self, Part::GateUp | Part::Down | Part::Neurons)
    }

    /// The matrices of this part of `layer`, in a fixed order (gate, up, down for the FFN).
    pub fn matrices(self, layer: &LayerWeights) -> Vec<&QRows> {
        let (gate, up) = (&layer.ffn.gate, &layer.ffn.up);
        match (self, &layer.ffn.down) {
            (Part::Q, _) => vec![&layer.wq],
            (Part::K, _) => vec![&layer.wk],
            (Part::V, _) => vec![&layer.wv],
            (Part::O, _) => vec![&layer.wo],
            (Part::GateUp, _) => vec![gate, up],
            (Part::Down, Down::Rows(m)) => vec![m],
            (Part::Neurons, Down::Neurons(m)) => vec![gate, up, m],
            (Part::Down | Part::Neurons, _) => Vec::new(),
        }
    }
}

/// One piece: rows `rows` of every matrix of `part`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub part: Part,
    pub rows: Range<usize>,
}

/// The pieces of `layer`, in compute order: each part's rows split evenly into pieces of at most
/// `max_bytes` (more only where one group of rows, a `.lsm` chunk, is larger).
pub fn pieces(layer: &LayerWeights, max_bytes: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    for &part in Part::of(layer) {
        let ms = part.matrices(layer);
        let Some(first) = ms.first() else { continue };
        let rows = first.rows;
        // Rows of a grouped layout (the `.lsm` bundles) are cut at group boundaries only, and
        // rows stored as tiles at tile boundaries.
        let step = if first.is_grouped() {
            first.group_rows()
        } else if ms.iter().any(|m| m.tiled_rows() > 0) {
            crate::quant::tiles::TILE_ROWS
        } else {
            1
        };
        let row_bytes: usize = ms.iter().map(|m| m.row_bytes()).sum();
        let count = (rows * row_bytes).div_ceil(max_bytes.max(1)).max(1);
        let per = rows.div_ceil(count).next_multiple_of(step).max(step);
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + per).min(rows);
            out.push(Piece { part, rows: r0..r1 });
            r0 = r1;
        }
    }
    out
}

/// The matrices of `piece` of `layer`, each cut to the piece's rows (views of the same bytes).
/// `None` if the piece does not fit the layer (a plan made for another model).
pub fn piece_matrices(layer: &LayerWeights, piece: &Piece) -> Option<Vec<QRows>> {
    piece
        .part
        .matrices(layer)
        .into_iter()
        .map(|m| m.sub_rows(piece.rows.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FfnWeights, TensorBytes};
    use crate::quant::DType;

    fn matrix(rows: usize, cols: usize) -> QRows {
        let bytes = DType::Q4_0.row_bytes(cols).unwrap() * rows;
        QRows::contiguous(
            DType::Q4_0,
            rows,
            cols,
            TensorBytes::from_vec(vec![0; bytes]),
        )
        .unwrap()
    }

    /// A layer of zeros with the matrices of a model of width `d` and `n_ff` neurons.
    fn layer_of_shape(d: usize, n_ff: usize) -> LayerWeights {
        LayerWeights {
            attn_norm: vec![1.0; d],
            wq: matrix(d, d),
            wk: matrix(d, d),
            wv: matrix(d, d),
            wo: matrix(d, d),
            bq: None,
            bk: None,
            bv: None,
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            ffn_norm: vec![1.0; d],
            ffn: FfnWeights {
                gate: matrix(n_ff, d),
                up: matrix(n_ff, d),
                down: Down::Rows(matrix(d, n_ff)),
            },
            post_ffn_norm: None,
        }
    }

    #[test]
    fn pieces_cover_every_row_once_in_compute_order() {
        let layer = layer_of_shape(4096, 11008);
        let ps = pieces(&layer, PIECE_BYTES);
        for &part in Part::of(&layer) {
            let mut at = 0;
            for p in ps.iter().filter(|p| p.part == part) {
                assert_eq!(p.rows.start, at, "{part:?} pieces are contiguous");
                let bytes: usize = part.matrices(&layer).iter().map(|m| m.row_bytes()).sum();
                assert!(p.rows.len() * bytes <= PIECE_BYTES, "{part:?} {:?}", p.rows);
                at = p.rows.end;
            }
            assert_eq!(
                at,
                part.matrices(&layer)[0].rows,
                "{part:?} covers its rows"
            );
        }
        let order: Vec<Part> = ps.iter().map(|p| p.part).collect();
        let mut sorted = order.clone();
        sorted.sort_by_key(|p| Part::of(&layer).iter().position(|q| q == p));
        assert_eq!(order, sorted, "parts in compute order");
        // A 7B layer: attention matrices of 9 MiB come in two pieces, gate and up together in 7.
        assert_eq!(ps.iter().filter(|p| p.part == Part::Q).count(), 2);
        assert_eq!(ps.iter().filter(|p| p.part == Part::GateUp).count(), 7);
    }

    #[test]
    fn a_small_layer_is_one_piece_per_part() {
        let layer = layer_of_shape(576, 1536);
        assert_eq!(pieces(&layer, PIECE_BYTES).len(), Part::of(&layer).len());
    }

    #[test]
    fn piece_matrices_are_views_of_the_pieces_rows() {
        let layer = layer_of_shape(4096, 11008);
        for p in pieces(&layer, PIECE_BYTES) {
            let ms = piece_matrices(&layer, &p).unwrap();
            for (m, whole) in ms.iter().zip(p.part.matrices(&layer)) {
                assert_eq!(m.rows, p.rows.len());
                assert_eq!(m.byte_range().start, whole.row_range(p.rows.start).start);
                assert_eq!(m.byte_range().end, whole.row_range(p.rows.end - 1).end);
            }
        }
    }
}
