//! The engine's block decoders against the format definitions, as an independent implementation
//! (the `gguf` Python package's dequantiser) decodes random blocks of every block type:
//! `tests/fixtures/quant-blocks.json`, written by `scripts/reference/quant-blocks.py`.

use leanstream_engine::backend::cpu::Kernels;
use leanstream_engine::quant::{DType, dequantize_row};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    #[serde(rename = "type")]
    dtype: DType,
    bytes: String,
    values: Vec<f32>,
}

fn cases() -> Vec<(DType, Vec<u8>, Vec<f32>)> {
    let f: Fixture = serde_json::from_str(include_str!("../fixtures/quant-blocks.json"))
        .expect("the fixture parses");
    f.cases
        .into_iter()
        .map(|c| {
            let bytes = (0..c.bytes.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&c.bytes[i..i + 2], 16).expect("hex"))
                .collect();
            (c.dtype, bytes, c.values)
        })
        .collect()
}

#[test]
fn every_block_type_decodes_as_the_format_defines() {
    let cases = cases();
    let types: Vec<DType> = cases.iter().map(|c| c.0).collect();
    for t in DType::ALL.iter().filter(|t| !t.is_float()) {
        assert!(types.contains(t), "{t} has no fixture case");
    }
    for (dtype, bytes, want) in cases {
        let mut got = vec![0f32; want.len()];
        dequantize_row(dtype, &bytes, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // The same products in another order may round differently in the last bit.
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                "{dtype} value {i}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn every_kernel_table_dots_and_accumulates_the_decoded_values() {
    for (dtype, bytes, want) in cases() {
        let x: Vec<f32> = (0..want.len())
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let exact: f64 = want
            .iter()
            .zip(&x)
            .map(|(w, x)| f64::from(*w) * f64::from(*x))
            .sum();
        let scale: f64 = want
            .iter()
            .zip(&x)
            .map(|(w, x)| f64::from((w * x).abs()))
            .sum();
        for k in [Kernels::scalar(), Kernels::best()] {
            let got = f64::from(k.dot(dtype, &bytes, &x));
            assert!(
                (got - exact).abs() <= 1e-5 * scale.max(1.0),
                "{} {dtype}: dot {got} vs {exact}",
                k.name()
            );
            let mut acc = vec![1f32; want.len()];
            k.axpy(dtype, &bytes, 0.5, &mut acc);
            for (a, w) in acc.iter().zip(&want) {
                assert!(
                    (a - (1.0 + 0.5 * w)).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{dtype} axpy"
                );
            }
        }
    }
}
