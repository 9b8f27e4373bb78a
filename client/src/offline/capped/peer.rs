//! llama.cpp as the peer of the capped bench: its `llama-completion` (one prompt, greedy, no
//! conversation mode) on the same GGUF, with its timings read from what it prints on stderr.
//! Built by the user (`scripts/build-llama` builds it from the `llama-cpp-python` sdist into
//! `target/tools/`); never part of LeanStream.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::bail;

/// A llama.cpp build.
#[derive(Debug)]
pub struct Llama {
    completion: PathBuf,
}

impl Llama {
    /// Finds `llama-completion` in `dir` or `dir/bin`.
    pub fn find(dir: &Path) -> anyhow::Result<Llama> {
        let bin = if dir.join("bin").is_dir() {
            dir.join("bin")
        } else {
            dir.to_path_buf()
        };
        let completion = bin.join("llama-completion");
        if !completion.is_file() {
            bail!(
                "no llama-completion in {} (scripts/build-llama builds one into target/tools/llama.cpp)",
                bin.display()
            );
        }
        Ok(Llama { completion })
    }

    /// Greedy completion of `prompt` for `tokens` tokens in a context of `context`.
    pub fn command(
        &self,
        gguf: &Path,
        prompt: &str,
        tokens: usize,
        context: usize,
        threads: usize,
    ) -> Command {
        let mut cmd = Command::new(&self.completion);
        cmd.arg("-m")
            .arg(gguf)
            .args(["-p", prompt])
            .args(["-n", &tokens.to_string()])
            .args(["-c", &context.to_string()])
            .args(["--temp", "0", "-no-cnv", "--no-warmup"])
            // No weight repacking: on x86 with AVX2 llama.cpp otherwise copies its Q4 tensors into
            // interleaved anonymous buffers at load (92 MiB of anonymous memory for SmolLM2 Q4_1,
            // OOM-killed under a 98 MB cap), so only the memory-mapped path can run under a cap.
            .arg("--no-repack");
        if threads > 0 {
            cmd.args(["-t", &threads.to_string()]);
        }
        cmd
    }
}

/// (decoded tokens, decode seconds) from llama.cpp's performance summary: the line
/// `eval time = X ms / N runs (...)` (not `prompt eval time`).
pub fn parse_timings(stderr: &str) -> Option<(u64, f64)> {
    stderr.lines().find_map(|l| {
        let rest = l.split_once("eval time =")?;
        if rest.0.trim_end().ends_with("prompt") {
            return None;
        }
        let (ms, runs) = rest.1.split_once("ms /")?;
        let runs = runs.split_whitespace().next()?.parse().ok()?;
        Some((runs, ms.trim().parse::<f64>().ok()? / 1000.0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_decode_line_not_the_prompt_line() {
        let err = "\
llama_perf_context_print: prompt eval time =      35.10 ms /     6 tokens (    5.85 ms per token,   170.94 tokens per second)
llama_perf_context_print:        eval time =     640.00 ms /    31 runs   (   20.65 ms per token,    48.44 tokens per second)
";
        assert_eq!(parse_timings(err), Some((31, 0.64)));
        assert_eq!(
            parse_timings("llama_perf_context_print: prompt eval time = 1 ms / 2 tokens"),
            None
        );
    }
}
