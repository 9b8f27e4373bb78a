//! `leanstream generate` and `leanstream chat`: stream a generation from the daemon.

use std::io::{IsTerminal, Write};

use anyhow::{Context, bail};
use clap::Args;
use leanstream::contract::{ChatTurn, GenerateParams, ModelInfo, Priority};
use leanstream::{Client, Generation, SessionHandle};
use serde_json::json;
use tokio::io::AsyncBufReadExt;

/// Sampling settings shared by `generate` and `chat`.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Maximum tokens to generate; 0 = the daemon's default.
    #[arg(long, default_value_t = 0)]
    pub max_tokens: u32,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0, value_parser = temperature)]
    pub temperature: f64,
    /// Keep only the K most likely tokens; 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Nucleus sampling mass, in (0, 1]; 1 = off.
    #[arg(long, default_value_t = 1.0, value_parser = top_p)]
    pub top_p: f64,
    /// Penalty on already generated tokens; 1 = off.
    #[arg(long, default_value_t = 1.0, value_parser = repetition_penalty)]
    pub repetition_penalty: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop after this string appears (repeatable).
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Model name (a file stem in the daemon's model directory). Default: the only loaded
    /// model, else the only model.
    #[arg(long)]
    pub model: Option<String>,
    /// Context length of the session in tokens; 0 = the daemon's default.
    #[arg(long, default_value_t = 0)]
    pub context: u32,
    /// The request's class: realtime (root and the daemon's admin group only), interactive or
    /// background.
    #[arg(long, default_value = "interactive", value_parser = Priority::parse)]
    pub priority: Priority,
    /// Milliseconds by which the first token should be out; 0 = none. A missed deadline is
    /// reported at the end, not enforced.
    #[arg(long, default_value_t = 0)]
    pub first_token_deadline_ms: u32,
    /// Milliseconds by which the generation should be over; 0 = none.
    #[arg(long, default_value_t = 0)]
    pub deadline_ms: u32,
}

impl SamplingArgs {
    fn params(&self) -> GenerateParams {
        GenerateParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            priority: self.priority.name().into(),
            first_token_deadline_ms: self.first_token_deadline_ms,
            deadline_ms: self.deadline_ms,
            ..GenerateParams::default()
        }
    }
}

/// Parses a finite number.
fn parse_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(format!("{s} is not finite"))
    }
}

/// Parses one sampling value and checks it with the engine's `SamplerConfig::validate`, the
/// one place the ranges are written (the daemon checks the wire values with it too, see
/// `GenerateParams::sampler_config`). Without the engine linked, the daemon's check alone holds.
fn sampling_value(s: &str, set: fn(&mut GenerateParams, f64)) -> Result<f64, String> {
    let v = parse_f64(s)?;
    let mut params = GenerateParams::default();
    set(&mut params, v);
    #[cfg(feature = "engine")]
    params
        .sampler_config()
        .validate()
        .map_err(|e| e.to_string())?;
    Ok(v)
}

fn temperature(s: &str) -> Result<f64, String> {
    sampling_value(s, |p, v| p.temperature = v)
}

fn top_p(s: &str) -> Result<f64, String> {
    sampling_value(s, |p, v| p.top_p = v)
}

fn repetition_penalty(s: &str) -> Result<f64, String> {
    sampling_value(s, |p, v| p.repetition_penalty = v)
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Print one JSON object `{"ids":[...],"text":"...","reason":"...","stats":{...}}` at the
    /// end instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Constrain the output to the JSON Schema in FILE: the text is one line of JSON that
    /// validates against it when the generation ends with reason `eos`.
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Constrain the output to the grammar in FILE (llguidance's Lark dialect).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<std::path::PathBuf>,
    /// The prompt; `-` reads it from stdin.
    pub prompt: String,
}

impl GenerateArgs {
    /// The sampling parameters, with the grammar `--json-schema` or `--grammar` names.
    fn params(&self) -> anyhow::Result<GenerateParams> {
        let mut params = self.sampling.params();
        let (kind, path) = match (&self.json_schema, &self.grammar) {
            (Some(p), _) => ("json_schema", p),
            (None, Some(p)) => ("lark", p),
            (None, None) => return Ok(params),
        };
        params.grammar_kind = kind.into();
        params.grammar =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Ok(params)
    }
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
}

/// The model to use when none is named: the only loaded one, else the only one there is.
pub fn pick_model(models: &[ModelInfo]) -> anyhow::Result<String> {
    let loaded: Vec<&ModelInfo> = models.iter().filter(|m| m.loaded).collect();
    match (loaded.as_slice(), models) {
        ([only], _) => Ok(only.name.clone()),
        ([], [only]) => Ok(only.name.clone()),
        (_, []) => bail!("the daemon's model directory has no models; pass --model NAME"),
        (several, _) => {
            let names: Vec<&str> = if several.is_empty() {
                models.iter().map(|m| m.name.as_str()).collect()
            } else {
                several.iter().map(|m| m.name.as_str()).collect()
            };
            bail!(
                "several models to choose from ({}); pass --model NAME",
                names.join(", ")
            )
        }
    }
}

async fn open(client: &Client, sampling: &SamplingArgs) -> anyhow::Result<SessionHandle> {
    let model = match &sampling.model {
        Some(m) => m.clone(),
        None => pick_model(&client.list_models().await?)?,
    };
    Ok(client.open_session(&model, sampling.context).await?)
}

/// Writes token text to stdout as it arrives; remembers the first write error (a closed pipe).
fn stdout_sink(failure: &mut Option<std::io::Error>) -> impl FnMut(&str) + '_ {
    let mut stdout = std::io::stdout();
    move |text: &str| {
        if failure.is_none()
            && let Err(e) = stdout
                .write_all(text.as_bytes())
                .and_then(|_| stdout.flush())
        {
            *failure = Some(e);
        }
    }
}

fn report_end(generation: &Generation) {
    let s = &generation.stats;
    let cached = match s.cached_prompt_tokens {
        0 => String::new(),
        n => format!(" ({n} cached)"),
    };
    let missed = match s.missed_deadlines.as_slice() {
        [] => String::new(),
        m => format!("; missed deadlines: {}", m.join(", ")),
    };
    eprintln!(
        "[{} prompt{cached} + {} generated tokens, stop: {}; first token {:.2} s, prefill {:.1} tok/s, decode {:.1} tok/s{missed}]",
        s.prompt_tokens,
        s.generated_tokens,
        generation.reason,
        s.time_to_first_token_s,
        s.prefill_tokens_per_s,
        s.decode_tokens_per_s
    );
}

pub async fn generate(client: &Client, args: GenerateArgs) -> anyhow::Result<()> {
    let params = args.params()?;
    let prompt = if args.prompt == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the prompt from stdin")?
    } else {
        args.prompt
    };
    let session = open(client, &args.sampling).await?;
    let stream = session.generate(&prompt, &params).await?;
    let result = if args.json {
        stream.finish().await
    } else {
        let mut failure = None;
        let generation = stream.finish_with(stdout_sink(&mut failure)).await;
        if let Some(e) = failure {
            return Err(e).context("writing to stdout");
        }
        generation
    };
    // Close before reporting an error, so that the session's memory goes back at once.
    let closed = session.close().await;
    let generation = result?;
    closed?;
    if args.json {
        let out = json!({
            "ids": generation.ids,
            "text": generation.text,
            "reason": generation.reason,
            "stats": generation.stats,
        });
        println!("{out}");
    } else {
        println!();
        report_end(&generation);
    }
    Ok(())
}

pub async fn chat(client: &Client, args: ChatArgs) -> anyhow::Result<()> {
    let session = open(client, &args.sampling).await?;
    let result = chat_loop(&session, &args).await;
    let closed = session.close().await;
    result?;
    Ok(closed?)
}

async fn chat_loop(session: &SessionHandle, args: &ChatArgs) -> anyhow::Result<()> {
    let interactive = std::io::stdin().is_terminal();
    let params = args.sampling.params();
    let mut history: Vec<ChatTurn> = args
        .system
        .iter()
        .map(|s| ChatTurn {
            role: "system".into(),
            content: s.clone(),
        })
        .collect();
    if interactive {
        eprintln!("chat with the model; /exit or Ctrl-D ends");
    }
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next_line().await.context("reading stdin")? else {
            break;
        };
        let line = line.trim();
        if line == "/exit" {
            break;
        }
        if line.is_empty() {
            continue;
        }
        history.push(ChatTurn {
            role: "user".into(),
            content: line.to_owned(),
        });
        let stream = session.generate_chat(&history, &params).await?;
        let mut failure = None;
        let generation = stream.finish_with(stdout_sink(&mut failure)).await?;
        if let Some(e) = failure {
            return Err(e).context("writing to stdout");
        }
        println!();
        if generation.reason == "context_full" {
            eprintln!(
                "[the session's context is full; start a new chat or pass a larger --context]"
            );
        }
        history.push(ChatTurn {
            role: "assistant".into(),
            content: generation.text,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str, loaded: bool) -> ModelInfo {
        ModelInfo {
            name: name.into(),
            format: "lsm".into(),
            architecture: "llama".into(),
            quantization: "q8_0 100%".into(),
            file_bytes: 1,
            loaded,
        }
    }

    #[test]
    fn picks_the_only_loaded_model_then_the_only_model() {
        let m = pick_model(&[model("a", false), model("b", true)]).expect("b is loaded");
        assert_eq!(m, "b");
        assert_eq!(pick_model(&[model("a", false)]).expect("only a"), "a");
    }

    #[test]
    fn ambiguity_and_absence_are_clear_errors() {
        let e = pick_model(&[model("a", false), model("b", false)]).expect_err("ambiguous");
        assert!(e.to_string().contains("a, b"), "{e}");
        assert!(e.to_string().contains("--model"), "{e}");
        let e = pick_model(&[model("a", true), model("b", true)]).expect_err("ambiguous");
        assert!(e.to_string().contains("a, b"), "{e}");
        let e = pick_model(&[]).expect_err("none");
        assert!(e.to_string().contains("no models"), "{e}");
    }

    #[test]
    fn sampling_values_are_checked_as_the_sampler_checks_them() {
        assert_eq!(temperature("0.5"), Ok(0.5));
        assert!(temperature("nan").is_err());
        assert!(temperature("x").is_err());
        assert!(temperature("-0.1").is_err_and(|e| e.contains("temperature")));
        assert_eq!(top_p("1"), Ok(1.0));
        assert!(top_p("0").is_err());
        // Positive, but 0 as the f32 the sampler uses.
        assert!(top_p("5e-324").is_err());
        assert!(top_p("1.5").is_err());
        assert!(repetition_penalty("inf").is_err());
        assert!(repetition_penalty("0").is_err());
    }
}
