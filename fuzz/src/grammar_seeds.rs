//! Writes a seed corpus for the `grammar` fuzz target into the directory given as the argument:
//! the seeds of `grammar_input.rs`, the reproducers among them.

use std::path::PathBuf;

mod grammar_input;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: grammar_seeds DIR")?);
    std::fs::create_dir_all(&dir)?;
    for seed in grammar_input::seeds() {
        std::fs::write(
            dir.join(seed.name),
            grammar_input::encode(seed.kind, &seed.text),
        )?;
    }
    Ok(())
}
