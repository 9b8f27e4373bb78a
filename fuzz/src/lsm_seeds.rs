//! Writes seed `.lsm` files (tiny seeded models, several chunk sizes and down types) into the
//! directory given as the first argument.

use std::path::PathBuf;

use leanstream_engine::model::gguf::TinyLlama;
use leanstream_engine::model::{load_imported, lsm};
use leanstream_engine::quant::DType;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::args().nth(1).ok_or("usage: lsm_seeds DIR")?);
    std::fs::create_dir_all(&out)?;
    let tmp = std::env::temp_dir().join("leanstream-lsm-seed.gguf");
    for (i, (dtype, chunk, down)) in [
        (DType::Q4_1, 16, DType::F16),
        (DType::Q8_0, 7, DType::Q8_0),
        (DType::F16, 128, DType::F32),
    ]
    .into_iter()
    .enumerate()
    {
        TinyLlama::new(i as u64).write_gguf(&tmp, dtype)?;
        let opts = lsm::ConvertOptions { chunk_neurons: Some(chunk), down_dtype: down };
        lsm::convert(&load_imported(&tmp)?, &out.join(format!("seed{i}.lsm")), &opts, &mut |_, _| {})?;
    }
    std::fs::remove_file(&tmp)?;
    Ok(())
}
