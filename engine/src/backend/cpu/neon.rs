//! aarch64 kernels on NEON (Advanced SIMD), with an `sdot` variant of the integer kernels for
//! CPUs that have the dot-product extension (Armv8.2 `dotprod`: Cortex-A55, A76, A78 and the
//! Orin's A78AE; not the Cortex-A57 of the first Jetson Nano).
//!
//! Two tables: [`NEON`] and [`NEON_DOTPROD`]. They share every float kernel, every exact dot
//! product, every axpy and the activation quantiser; they differ only in how the integer
//! kernels multiply 16 pairs of bytes ([`simd::dot16`] or [`simd::sdot16`]). Both give every
//! group's 16 products as the same four i32 lanes, so the two tables return the same bits.
//!
//! Every kernel is a safe `#[target_feature]` function; the tables hold plain-fn wrappers around
//! them and are only handed out by [`detect`] and [`supported`] after the features were found,
//! which is what makes the wrappers' `unsafe` calls sound. Memory access goes through the
//! bounds-checked load and store helpers of [`simd`].
//!
//! Files: [`simd`] (loads, conversions, the shared 16-value products), [`float`] (f32, f16,
//! bf16 rows), [`blocks`] (the 32-value types q8_0 … q5_1), [`kquant`] (the 256-value k-quants,
//! one span decoder per type over shared bodies), [`tiles`] (the 32-value types' integer kernels
//! over tiles of eight rows, the one-row kernels' bits), [`quantize`] (activations to 8-bit blocks).
//!
//! Little-endian only: the loads reinterpret row bytes as lanes.

mod blocks;
mod float;
mod kquant;
mod math;
mod quantize;
mod simd;
mod tiles;

use super::{AxpyFn, DotFn, Kernels, Q8Block, Transcendentals};
use crate::quant::DType;

/// The best NEON table this CPU supports: `neon+dotprod`, else `neon`, else none.
pub(super) fn detect() -> Option<&'static Kernels> {
    supported().last().copied()
}

/// Every NEON table this CPU supports, plainest first.
pub(super) fn supported() -> Vec<&'static Kernels> {
    let mut tables = Vec::new();
    if std::arch::is_aarch64_feature_detected!("neon") {
        tables.push(&NEON);
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            tables.push(&NEON_DOTPROD);
        }
    }
    tables
}

/// The exact dot products, in [`DType::ALL`] order (shared by both tables).
const DOT: [DotFn; DType::ALL.len()] = [
    table::dot_f32,
    table::dot_f16,
    table::dot_bf16,
    table::dot_q8_0,
    table::dot_q4_0,
    table::dot_q4_1,
    table::dot_q5_0,
    table::dot_q5_1,
    table::dot_q2_k,
    table::dot_q3_k,
    table::dot_q4_k,
    table::dot_q5_k,
    table::dot_q6_k,
];

/// The axpys, in [`DType::ALL`] order (shared by both tables).
const AXPY: [AxpyFn; DType::ALL.len()] = [
    table::axpy_f32,
    table::axpy_f16,
    table::axpy_bf16,
    table::axpy_q8_0,
    table::axpy_q4_0,
    table::axpy_q4_1,
    table::axpy_q5_0,
    table::axpy_q5_1,
    table::axpy_q2_k,
    table::axpy_q3_k,
    table::axpy_q4_k,
    table::axpy_q5_k,
    table::axpy_q6_k,
];

/// The exponential kernels (shared by both tables).
const MATH: Transcendentals = Transcendentals {
    silu_mul: table::silu_mul,
    gelu_mul: table::gelu_mul,
    exp_shifted: table::exp_shifted,
};

static NEON: Kernels = Kernels {
    name: "neon",
    dot: DOT,
    dot_q8: [
        None,
        None,
        None,
        Some(table::q8_0_q8),
        Some(table::q4_0_q8),
        Some(table::q4_1_q8),
        Some(table::q5_0_q8),
        Some(table::q5_1_q8),
        Some(table::q2_k_q8),
        Some(table::q3_k_q8),
        Some(table::q4_k_q8),
        Some(table::q5_k_q8),
        Some(table::q6_k_q8),
    ],
    axpy: AXPY,
    dot_q8_x8: super::NO_ROW_GROUPS,
    dot_q8_tile: super::tile_column([
        table::q8_0_q8_tile,
        table::q4_0_q8_tile,
        table::q4_1_q8_tile,
        table::q5_0_q8_tile,
        table::q5_1_q8_tile,
    ]),
    dot_x8: super::NO_EXACT_ROW_GROUPS,
    dot_tokens: super::NO_TOKEN_KERNELS,
    quantize: table::quantize,
    math: MATH,
};

static NEON_DOTPROD: Kernels = Kernels {
    name: "neon+dotprod",
    dot: DOT,
    dot_q8: [
        None,
        None,
        None,
        Some(table_dotprod::q8_0_q8),
        Some(table_dotprod::q4_0_q8),
        Some(table_dotprod::q4_1_q8),
        Some(table_dotprod::q5_0_q8),
        Some(table_dotprod::q5_1_q8),
        Some(table_dotprod::q2_k_q8),
        Some(table_dotprod::q3_k_q8),
        Some(table_dotprod::q4_k_q8),
        Some(table_dotprod::q5_k_q8),
        Some(table_dotprod::q6_k_q8),
    ],
    axpy: AXPY,
    dot_q8_x8: super::NO_ROW_GROUPS,
    dot_q8_tile: super::tile_column([
        table_dotprod::q8_0_q8_tile,
        table_dotprod::q4_0_q8_tile,
        table_dotprod::q4_1_q8_tile,
        table_dotprod::q5_0_q8_tile,
        table_dotprod::q5_1_q8_tile,
    ]),
    dot_x8: super::NO_EXACT_ROW_GROUPS,
    dot_tokens: super::NO_TOKEN_KERNELS,
    quantize: table::quantize,
    math: MATH,
};

/// Plain-fn wrappers of the NEON kernels, for both tables.
mod table {
    use super::Q8Block;
    use super::{blocks, float, kquant, math, quantize as q, tiles};

    macro_rules! wrap {
        ($(fn $name:ident = $kernel:path, ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?;)*) => {$(
            pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: these wrappers are private to this module and only reachable through
                // `NEON` and `NEON_DOTPROD`, which `detect` and `supported` hand out after finding
                // neon.
                unsafe { $kernel($($arg),*) }
            }
        )*};
    }

    wrap! {
        fn dot_f32 = float::dot_f32, (row: &[u8], x: &[f32]) -> f32;
        fn dot_f16 = float::dot_f16, (row: &[u8], x: &[f32]) -> f32;
        fn dot_bf16 = float::dot_bf16, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q8_0 = blocks::dot_q8_0, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q4_0 = blocks::dot_q4_0, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q4_1 = blocks::dot_q4_1, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q5_0 = blocks::dot_q5_0, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q5_1 = blocks::dot_q5_1, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q2_k = kquant::dot_q2_k, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q3_k = kquant::dot_q3_k, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q4_k = kquant::dot_q4_k, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q5_k = kquant::dot_q5_k, (row: &[u8], x: &[f32]) -> f32;
        fn dot_q6_k = kquant::dot_q6_k, (row: &[u8], x: &[f32]) -> f32;
        fn q8_0_q8 = blocks::q8_0_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q4_0_q8 = blocks::q4_0_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q4_1_q8 = blocks::q4_1_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q5_0_q8 = blocks::q5_0_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q5_1_q8 = blocks::q5_1_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q2_k_q8 = kquant::q2_k_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q3_k_q8 = kquant::q3_k_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q4_k_q8 = kquant::q4_k_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q5_k_q8 = kquant::q5_k_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn q6_k_q8 = kquant::q6_k_q8, (row: &[u8], acts: &[Q8Block]) -> f32;
        fn axpy_f32 = float::axpy_f32, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_f16 = float::axpy_f16, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_bf16 = float::axpy_bf16, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q8_0 = blocks::axpy_q8_0, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q4_0 = blocks::axpy_q4_0, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q4_1 = blocks::axpy_q4_1, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q5_0 = blocks::axpy_q5_0, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q5_1 = blocks::axpy_q5_1, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q2_k = kquant::axpy_q2_k, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q3_k = kquant::axpy_q3_k, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q4_k = kquant::axpy_q4_k, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q5_k = kquant::axpy_q5_k, (row: &[u8], a: f32, out: &mut [f32]);
        fn axpy_q6_k = kquant::axpy_q6_k, (row: &[u8], a: f32, out: &mut [f32]);
        fn q8_0_q8_tile = tiles::q8_0_q8_tile, (t: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn q4_0_q8_tile = tiles::q4_0_q8_tile, (t: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn q4_1_q8_tile = tiles::q4_1_q8_tile, (t: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn q5_0_q8_tile = tiles::q5_0_q8_tile, (t: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn q5_1_q8_tile = tiles::q5_1_q8_tile, (t: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]);
        fn quantize = q::quantize, (x: &[f32], out: &mut [Q8Block]);
        fn silu_mul = math::silu_mul, (gate: &mut [f32], up: &[f32]);
        fn gelu_mul = math::gelu_mul, (gate: &mut [f32], up: &[f32]);
        fn exp_shifted = math::exp_shifted, (x: &mut [f32], shift: f32) -> f32;
    }
}

/// Plain-fn wrappers of the `sdot` integer kernels, for [`NEON_DOTPROD`] only.
mod table_dotprod {
    use super::Q8Block;
    use super::{blocks, kquant, tiles};

    macro_rules! wrap_tiles {
        ($(fn $name:ident = $kernel:path;)*) => {$(
            pub(super) fn $name(t: &[u8], acts: &[&[Q8Block]], out: &mut [[f32; 8]]) {
                // SAFETY: as for the one-row wrappers below.
                unsafe { $kernel(t, acts, out) }
            }
        )*};
    }

    wrap_tiles! {
        fn q8_0_q8_tile = tiles::q8_0_q8_tile_sdot;
        fn q4_0_q8_tile = tiles::q4_0_q8_tile_sdot;
        fn q4_1_q8_tile = tiles::q4_1_q8_tile_sdot;
        fn q5_0_q8_tile = tiles::q5_0_q8_tile_sdot;
        fn q5_1_q8_tile = tiles::q5_1_q8_tile_sdot;
    }

    macro_rules! wrap {
        ($(fn $name:ident = $kernel:path;)*) => {$(
            pub(super) fn $name(row: &[u8], acts: &[Q8Block]) -> f32 {
                // SAFETY: these wrappers are private to this module and only reachable through
                // `NEON_DOTPROD`, which `supported` (and so `detect`) hands out only after finding
                // neon and dotprod.
                unsafe { $kernel(row, acts) }
            }
        )*};
    }

    wrap! {
        fn q8_0_q8 = blocks::q8_0_q8_sdot;
        fn q4_0_q8 = blocks::q4_0_q8_sdot;
        fn q4_1_q8 = blocks::q4_1_q8_sdot;
        fn q5_0_q8 = blocks::q5_0_q8_sdot;
        fn q5_1_q8 = blocks::q5_1_q8_sdot;
        fn q2_k_q8 = kquant::q2_k_q8_sdot;
        fn q3_k_q8 = kquant::q3_k_q8_sdot;
        fn q4_k_q8 = kquant::q4_k_q8_sdot;
        fn q5_k_q8 = kquant::q5_k_q8_sdot;
        fn q6_k_q8 = kquant::q6_k_q8_sdot;
    }
}
