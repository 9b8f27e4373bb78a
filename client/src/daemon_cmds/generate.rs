//! `leanstream generate` and `leanstream chat`: stream a generation from the daemon.

use std::io::{IsTerminal, Write};

use anyhow::{Context, bail};
use clap::Args;
use leanstream::contract::{ChatTurn, GenerateParams, ModelInfo, Priority};
use leanstream::{Client, Generation, SessionHandle};
use serde_json::json;
use tokio::io::AsyncBufReadExt;

/// Sampling settings shared by `generate` and `chat`. Every numeric option takes a negative
/// number as its value (`--temperature -1`), so that the range check answers it rather than
/// clap's "unexpected argument".
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Maximum tokens to generate; 0 = the daemon's default.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole::<u32>)]
    pub max_tokens: u32,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = temperature)]
    pub temperature: f64,
    /// Keep only the K most likely tokens; 0 = off.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole::<u32>)]
    pub top_k: u32,
    /// Nucleus sampling mass, in (0, 1]; 1 = off.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = top_p)]
    pub top_p: f64,
    /// Penalty on already generated tokens; 1 = off.
    #[arg(
        long,
        default_value_t = 1.0,
        allow_negative_numbers = true,
        value_parser = repetition_penalty
    )]
    pub repetition_penalty: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole::<u64>)]
    pub seed: u64,
    /// Stop after this string appears (repeatable).
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Model name (a file stem in the daemon's model directory). Default: the only loaded
    /// model, else the only readable model.
    #[arg(long)]
    pub model: Option<String>,
    /// Context length of the session in tokens; 0 = the daemon's default.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole::<u32>)]
    pub context: u32,
    /// The request's class: realtime (root and the daemon's admin group only), interactive or
    /// background.
    #[arg(long, default_value = "interactive", value_parser = Priority::parse)]
    pub priority: Priority,
    /// Milliseconds by which the first token should be out; 0 = none. A missed deadline is
    /// reported at the end, not enforced.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole::<u32>)]
    pub first_token_deadline_ms: u32,
    /// Milliseconds by which the generation should be over; 0 = none.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole::<u32>)]
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

/// Parses a whole number ≥ 0, naming a negative one as such (clap's own message for `-3` is
/// "invalid digit found in string").
fn whole<T: std::str::FromStr<Err = std::num::ParseIntError>>(s: &str) -> Result<T, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!("{s} is negative: a whole number ≥ 0 is expected"));
    }
    s.parse()
        .map_err(|e| format!("{s:?} is not a whole number ≥ 0 ({e})"))
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
    /// validates against it when the generation ends with reason `eos`. Any other end (e.g.
    /// `--max-tokens` reached) may leave it incomplete: that exits with status 4.
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Constrain the output to the grammar in FILE (llguidance's Lark dialect); cut short, as
    /// with `--json-schema`, it exits with status 4.
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<std::path::PathBuf>,
    /// Send the prompt as raw text (special tokens written in it are recognised), for a base
    /// model or a prompt already in the model's chat format. Without it the prompt is one user
    /// message, rendered by the model's chat template.
    #[arg(long)]
    pub raw: bool,
    /// The prompt; `-` reads it from stdin.
    pub prompt: String,
}

impl GenerateArgs {
    /// What constrains the output, in words, for messages: `None` without `--json-schema` or
    /// `--grammar`.
    fn constraint(&self) -> Option<&'static str> {
        match (&self.json_schema, &self.grammar) {
            (Some(_), _) => Some("--json-schema"),
            (None, Some(_)) => Some("--grammar"),
            (None, None) => None,
        }
    }

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

/// Whether the daemon could read the model file's header: `ListModels` reports an unreadable
/// one with architecture `unknown` and the reason in `quantization` (see [`ModelInfo`]).
fn readable(model: &ModelInfo) -> bool {
    model.architecture != "unknown"
}

/// The model to use when none is named: the only loaded one, else the only readable one. A
/// model whose header cannot be read is never picked nor offered as a choice; the error names
/// it apart.
pub fn pick_model(models: &[ModelInfo]) -> anyhow::Result<String> {
    let (usable, unreadable): (Vec<&ModelInfo>, Vec<&ModelInfo>) =
        models.iter().partition(|m| m.loaded || readable(m));
    let loaded: Vec<&ModelInfo> = usable.iter().copied().filter(|m| m.loaded).collect();
    let candidates = if loaded.is_empty() { usable } else { loaded };
    let names = |models: &[&ModelInfo]| -> String {
        let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
        names.join(", ")
    };
    let skipped = match unreadable.as_slice() {
        [] => String::new(),
        broken => format!(
            " (not offered, their headers cannot be read: {}; `leanstream models` says why)",
            names(broken)
        ),
    };
    match candidates.as_slice() {
        [only] => Ok(only.name.clone()),
        [] if unreadable.is_empty() => {
            bail!("the daemon's model directory has no models; pass --model NAME")
        }
        [] => bail!(
            "the daemon's model directory has no readable model: the headers of {} cannot be \
             read (`leanstream models` says why)",
            names(&unreadable)
        ),
        several => bail!(
            "several models to choose from ({}); pass --model NAME{skipped}",
            names(several)
        ),
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
    // Speculative decoding: the tokens each decode pass gave, when a pass gave more than one.
    let speculated = if s.speculation_tokens_per_pass > 1.0 {
        format!(
            " ({:.2} tokens a pass, {:.0} % of drafts accepted)",
            s.speculation_tokens_per_pass,
            s.draft_acceptance * 100.0
        )
    } else {
        String::new()
    };
    let missed = match s.missed_deadlines.as_slice() {
        [] => String::new(),
        m => format!("; missed deadlines: {}", m.join(", ")),
    };
    eprintln!(
        "[{} prompt{cached} + {} generated tokens, stop: {}; first token {:.2} s, prefill {:.1} tok/s, decode {:.1} tok/s{speculated}{missed}]",
        s.prompt_tokens,
        s.generated_tokens,
        generation.reason,
        s.time_to_first_token_s,
        s.prefill_tokens_per_s,
        s.decode_tokens_per_s
    );
}

/// A `done` event's reason in words, for messages; an unknown reason (a newer daemon) as it is.
fn stop_words(reason: &str) -> &str {
    match reason {
        "eos" => "end of turn",
        "max_tokens" => "--max-tokens reached",
        "stop_string" => "a --stop string",
        "context_full" => "the context is full",
        other => other,
    }
}

/// What to say when a generation ended without text (`None` when it has text). A raw prompt
/// that the model answered with its end of turn gets the hint to send it as a chat message.
fn no_text_note(generation: &Generation, raw: bool) -> Option<String> {
    if !generation.text.is_empty() {
        return None;
    }
    // A generation that ends at end of turn streams that token too, without text.
    let end_token = usize::from(generation.reason == "eos");
    let why = stop_words(&generation.reason);
    let how = match generation.ids.len().saturating_sub(end_token) {
        0 => format!("it ended at once: {why}"),
        1 => format!("1 token without text, then {why}"),
        n => format!("{n} tokens without text, then {why}"),
    };
    let hint = if raw && generation.reason == "eos" {
        "; --raw sent the prompt as plain text: without it, it goes in as a chat message"
    } else {
        ""
    };
    Some(format!(
        "leanstream: the model produced no text ({how}){hint}"
    ))
}

/// A constrained generation (`--json-schema`, `--grammar`) that stopped before its grammar was
/// known to be complete, so its text may not parse; `leanstream` exits with
/// [`super::EXIT_INCOMPLETE`]. The `done` event does not say whether the grammar was complete,
/// but once it is the engine lets only end of turn through: any other reason counts as cut short.
#[derive(Debug, thiserror::Error)]
#[error(
    "the {constraint} output is incomplete: the generation stopped ({}) after {tokens} tokens, \
     before the grammar was known to be complete, so the text may not parse; {fix}",
    stop_words(reason)
)]
pub struct CutShort {
    constraint: &'static str,
    reason: String,
    tokens: usize,
    fix: String,
}

impl CutShort {
    /// `None` when `generation` ended at end of turn (or was not constrained).
    fn check(generation: &Generation, args: &GenerateArgs) -> Option<CutShort> {
        let constraint = args.constraint()?;
        let fix = match generation.reason.as_str() {
            "eos" => return None,
            "max_tokens" if args.sampling.max_tokens == 0 => {
                "pass --max-tokens N above the daemon's default".to_owned()
            }
            "max_tokens" => format!(
                "pass a larger --max-tokens (it was {})",
                args.sampling.max_tokens
            ),
            "context_full" => "pass a larger --context".to_owned(),
            "stop_string" => "drop the --stop strings that cut it".to_owned(),
            _ => "--json shows the reason it stopped".to_owned(),
        };
        Some(CutShort {
            constraint,
            reason: generation.reason.clone(),
            tokens: generation.ids.len(),
            fix,
        })
    }
}

/// Streams one generation to stdout (or prints it as JSON). A plain prompt goes in as one user
/// message in the model's chat template, as `chat` sends it; `--raw` sends the text as is.
pub async fn generate(client: &Client, args: GenerateArgs) -> anyhow::Result<()> {
    let params = args.params()?;
    let prompt = if args.prompt == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the prompt from stdin")?
    } else {
        args.prompt.clone()
    };
    let session = open(client, &args.sampling).await?;
    let stream = if args.raw {
        session.generate(&prompt, &params).await?
    } else {
        let turn = ChatTurn {
            role: "user".into(),
            content: prompt,
        };
        session.generate_chat(&[turn], &params).await?
    };
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
    if let Some(note) = no_text_note(&generation, args.raw) {
        eprintln!("{note}");
    }
    match CutShort::check(&generation, &args) {
        Some(cut) => Err(cut.into()),
        None => Ok(()),
    }
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
        if let Some(note) = no_text_note(&generation, false) {
            eprintln!("{note}");
        }
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

    fn unreadable(name: &str) -> ModelInfo {
        ModelInfo {
            architecture: "unknown".into(),
            quantization: "not a GGUF file: bad magic".into(),
            ..model(name, false)
        }
    }

    #[test]
    fn unreadable_models_are_never_picked_nor_offered() {
        // One readable model beside a broken one: the readable one, no question asked.
        let m = pick_model(&[unreadable("broken"), model("good", false)]).expect("good");
        assert_eq!(m, "good");
        // Several readable ones: the broken one is named apart, not as a choice.
        let e = pick_model(&[model("a", false), unreadable("broken"), model("b", false)])
            .expect_err("ambiguous");
        let text = e.to_string();
        assert!(text.contains("choose from (a, b);"), "{text}");
        assert!(text.contains("not offered"), "{text}");
        assert!(text.contains("cannot be read: broken;"), "{text}");
        // Only broken ones: nothing to pick.
        let e = pick_model(&[unreadable("broken")]).expect_err("nothing readable");
        assert!(e.to_string().contains("no readable model"), "{e}");
        // A loaded model is served whatever its file reads like now.
        let loaded = ModelInfo {
            loaded: true,
            ..unreadable("replaced")
        };
        assert_eq!(pick_model(&[loaded]).expect("loaded"), "replaced");
    }

    fn generation(ids: &[u32], text: &str, reason: &str) -> Generation {
        Generation {
            ids: ids.to_vec(),
            text: text.into(),
            reason: reason.into(),
            ..Generation::default()
        }
    }

    #[test]
    fn an_empty_generation_is_named_with_why_it_ended() {
        let at_once =
            Some("leanstream: the model produced no text (it ended at once: end of turn)");
        assert_eq!(
            no_text_note(&generation(&[], "", "eos"), false).as_deref(),
            at_once
        );
        // The daemon streams the end-of-turn token itself, with no text.
        assert_eq!(
            no_text_note(&generation(&[2], "", "eos"), false).as_deref(),
            at_once
        );
        let raw = no_text_note(&generation(&[], "", "eos"), true).expect("a note");
        assert!(raw.contains("--raw"), "{raw}");
        let spent = no_text_note(&generation(&[1, 2], "", "max_tokens"), false).expect("a note");
        assert!(
            spent.contains("2 tokens without text, then --max-tokens reached"),
            "{spent}"
        );
        assert_eq!(no_text_note(&generation(&[1], "a", "eos"), true), None);
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: GenerateArgs,
    }

    fn args(argv: &[&str]) -> GenerateArgs {
        use clap::Parser;
        let argv = std::iter::once("generate").chain(argv.iter().copied());
        Cli::try_parse_from(argv).expect("valid arguments").args
    }

    #[test]
    fn a_constrained_generation_is_cut_short_unless_it_ended_at_end_of_turn() {
        let schema = args(&["--json-schema", "s.json", "--max-tokens", "4", "x"]);
        let cut = CutShort::check(&generation(&[1, 2, 3, 4], "{\"a", "max_tokens"), &schema)
            .expect("cut short");
        let text = cut.to_string();
        assert!(
            text.contains("--json-schema output is incomplete"),
            "{text}"
        );
        assert!(text.contains("after 4 tokens"), "{text}");
        assert!(
            text.ends_with("pass a larger --max-tokens (it was 4)"),
            "{text}"
        );
        assert!(CutShort::check(&generation(&[1], "{}", "eos"), &schema).is_none());
        let grammar = args(&["--grammar", "g.lark", "--context", "64", "x"]);
        let cut =
            CutShort::check(&generation(&[1], "y", "context_full"), &grammar).expect("cut short");
        assert!(
            cut.to_string().ends_with("pass a larger --context"),
            "{cut}"
        );
        let default_limit = args(&["--grammar", "g.lark", "x"]);
        let cut = CutShort::check(&generation(&[1], "y", "max_tokens"), &default_limit)
            .expect("cut short");
        assert!(
            cut.to_string().contains("above the daemon's default"),
            "{cut}"
        );
        // Unconstrained, any end is fine.
        let free = args(&["--max-tokens", "4", "x"]);
        assert!(CutShort::check(&generation(&[1], "y", "max_tokens"), &free).is_none());
    }

    #[test]
    fn whole_numbers_name_a_negative_value() {
        assert_eq!(whole::<u32>("7"), Ok(7));
        assert!(whole::<u32>("-3").is_err_and(|e| e.contains("-3 is negative")));
        assert!(whole::<u64>(" -0").is_err_and(|e| e.contains("negative")));
        assert!(whole::<u32>("4294967296").is_err_and(|e| e.contains("too large")));
        assert!(whole::<u32>("x").is_err_and(|e| e.contains("not a whole number")));
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
