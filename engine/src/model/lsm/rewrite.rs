//! Rewrites a `.lsm` file with calibration data, optionally reordering the neurons of every
//! layer. The resident section is copied as is; the streamed section is copied, or re-laid out
//! chunk by chunk in the new neuron order with fresh checksums; the calibration section is
//! appended. As in `convert`, the header goes last into a reserved gap and the file is written to
//! `DST.partial` and renamed into place only when complete (so `DST` may be the source itself).

use std::path::Path;

use super::calibration::{CalTensor, CalTensorEntry, Calibration};
use super::write::{Out, align_up, commit};
use super::{LsmFile, PREAMBLE_LEN, Section};
use crate::{Error, Result};

const MAX_SECTION: Section = Section {
    offset: u64::MAX,
    len: u64::MAX,
    crc32: u32::MAX,
};

/// Checks that `reorder` holds one permutation of `0..n_ff` per layer.
fn check_reorder(reorder: &[Vec<u32>], n_layers: usize, n_ff: usize) -> Result<()> {
    let bad = |reason: String| Error::InvalidArgument {
        arg: "reorder",
        reason,
    };
    if reorder.len() != n_layers {
        return Err(bad(format!(
            "{} layers, the model has {n_layers}",
            reorder.len()
        )));
    }
    for (l, p) in reorder.iter().enumerate() {
        let mut seen = vec![false; n_ff];
        let ok = p.len() == n_ff
            && p.iter()
                .all(|&i| (i as usize) < n_ff && !std::mem::replace(&mut seen[i as usize], true));
        if !ok {
            return Err(bad(format!("layer {l} is not a permutation of 0..{n_ff}")));
        }
    }
    Ok(())
}

/// Writes `src` to `dst` with `calibration` and its `tensors` (given in
/// `src`'s stored neuron order). With `reorder`, new stored neuron `k` of layer `l` is old stored
/// neuron `reorder[l][k]`: bundles, the file's permutation and every neuron-major tensor are
/// permuted together. Returns the size of the written file in bytes.
pub fn write_calibrated(
    src: &LsmFile,
    dst: &Path,
    mut calibration: Calibration,
    mut tensors: Vec<CalTensor>,
    reorder: Option<&[Vec<u32>]>,
) -> Result<u64> {
    let c = &src.header.config;
    let mut header = src.header.clone();
    if let Some(q) = reorder {
        check_reorder(q, c.n_layers, c.n_ff)?;
        for t in tensors.iter_mut().filter(|t| t.neuron_major) {
            let l = t
                .layer
                .filter(|&l| l < c.n_layers)
                .ok_or_else(|| Error::InvalidArgument {
                    arg: "tensors",
                    reason: format!("neuron-major tensor `{}` names no layer", t.name),
                })?;
            if t.shape.first() != Some(&c.n_ff) {
                return Err(Error::InvalidArgument {
                    arg: "tensors",
                    reason: format!("neuron-major tensor `{}` has {:?} rows", t.name, t.shape),
                });
            }
            t.permute_rows(&q[l]);
        }
        let old = &src.header.ffn.permutation;
        header.ffn.permutation = q
            .iter()
            .enumerate()
            .map(|(l, ql)| {
                ql.iter()
                    .map(|&k| {
                        if old.is_empty() {
                            k
                        } else {
                            old[l][k as usize]
                        }
                    })
                    .collect()
            })
            .collect();
        for crcs in &mut header.ffn.chunk_crc32 {
            crcs.fill(u32::MAX);
        }
    }
    calibration.section = Some(MAX_SECTION);
    calibration.tensors = tensors
        .iter()
        .map(|t| CalTensorEntry {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            layer: t.layer,
            neuron_major: t.neuron_major,
            offset: u64::MAX,
            len: u64::MAX,
        })
        .collect();
    header.calibration = Some(calibration);
    header.resident = MAX_SECTION;
    header.streamed = MAX_SECTION;
    let json_err = |e: serde_json::Error| Error::invalid_file(dst, e.to_string());
    let reserve = serde_json::to_vec(&header).map_err(json_err)?.len();

    let partial = dst.with_extension("lsm.partial");
    let mut out = Out::create(&partial)?;
    let result = (|| {
        out.pad_to(align_up((PREAMBLE_LEN + reserve) as u64))?;
        let data = src.data.as_slice();
        let old = &src.header;

        let at = out.pos;
        out.write(&data[old.resident.offset as usize..][..old.resident.len as usize])?;
        header.resident = Section {
            offset: at,
            ..old.resident.clone()
        };

        out.pad_to(align_up(out.pos))?;
        let at = out.pos;
        let streamed = &data[old.streamed.offset as usize..][..old.streamed.len as usize];
        match reorder {
            None => {
                out.write(streamed)?;
                header.streamed = Section {
                    offset: at,
                    ..old.streamed.clone()
                };
            }
            Some(q) => {
                let f = &old.ffn;
                let (k, bb, cb) = (f.chunk_neurons, f.bundle_bytes, f.chunk_bytes);
                let mut crc = crc32fast::Hasher::new();
                let mut chunk = Vec::with_capacity(cb);
                // Layers are contiguous from offset 0 (as `convert` writes them); the gaps, if a
                // writer ever leaves some, are copied as they are.
                let mut copied = 0usize;
                for (l, ql) in q.iter().enumerate() {
                    let first = f.layer_offsets[l] as usize;
                    let gap = &streamed[copied..first.max(copied)];
                    crc.update(gap);
                    out.write(gap)?;
                    for (ci, neurons) in ql.chunks(k).enumerate() {
                        chunk.clear();
                        for &o in neurons {
                            let o = o as usize;
                            let from = first + (o / k) * cb + (o % k) * bb;
                            chunk.extend_from_slice(&streamed[from..from + bb]);
                        }
                        chunk.resize(cb, 0);
                        header.ffn.chunk_crc32[l][ci] = crc32fast::hash(&chunk);
                        crc.update(&chunk);
                        out.write(&chunk)?;
                    }
                    copied = first + ql.len().div_ceil(k) * cb;
                }
                let tail = &streamed[copied.min(streamed.len())..];
                crc.update(tail);
                out.write(tail)?;
                header.streamed = Section {
                    offset: at,
                    len: old.streamed.len,
                    crc32: crc.finalize(),
                };
            }
        }

        out.pad_to(align_up(out.pos))?;
        let start = out.pos;
        let mut crc = crc32fast::Hasher::new();
        let cal = header
            .calibration
            .as_mut()
            .expect("set above: the header carries calibration");
        for (t, e) in tensors.iter().zip(&mut cal.tensors) {
            (e.offset, e.len) = out.write_tensor(start, &t.bytes, &mut crc)?;
        }
        cal.section = Some(out.section_since(start, crc));

        let json = serde_json::to_vec(&header).map_err(json_err)?;
        assert!(json.len() <= reserve, "header outgrew its reservation");
        let file_bytes = out.pos;
        out.finish(&json)?;
        Ok(file_bytes)
    })();
    commit(&partial, dst, result)
}
