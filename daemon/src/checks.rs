//! What a call's arguments must be before anything runs: a generation's settings against the
//! daemon's limits, a prompt's size, a chat's messages. Pure functions, so that the bus face
//! stays thin and these are tested without a bus.

use std::time::Duration;

use leanstream::contract::{ChatTurn, GenerateParams, LeanStreamError, Priority};
use leanstream_engine::chat::ChatMessage;

use crate::config::Params;
use crate::scheduler::GenSpec;

/// Most stop strings per request, and the longest one in bytes.
const MAX_STOP_STRINGS: usize = 16;
const MAX_STOP_BYTES: usize = 256;
/// Most chat turns per request.
const MAX_TURNS: usize = 1024;
/// The longest JSON Schema, grammar or regex a request may carry (it is compiled per request).
const MAX_GRAMMAR_BYTES: usize = 64 * 1024;
/// Longest deadline a request may set: a day.
const MAX_DEADLINE_MS: u32 = 24 * 3600 * 1000;

/// Checks sampling and length settings against the limits; `max_tokens` 0 means the limit.
pub fn validate_params(p: &GenerateParams, params: &Params) -> Result<GenSpec, LeanStreamError> {
    let invalid = |m: String| Err(LeanStreamError::InvalidArgument(m));
    let max_tokens = match p.max_tokens as usize {
        0 => params.max_tokens,
        n if n <= params.max_tokens => n,
        n => {
            return invalid(format!(
                "max_tokens {n} is over the limit of {}",
                params.max_tokens
            ));
        }
    };
    if p.top_k > 1_000_000 {
        return invalid(format!("top_k {} is absurd", p.top_k));
    }
    if p.stop.len() > MAX_STOP_STRINGS
        || p.stop
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return invalid(format!(
            "stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_BYTES} bytes"
        ));
    }
    let sampler = p.sampler_config();
    sampler
        .validate()
        .map_err(|e| LeanStreamError::InvalidArgument(e.to_string()))?;
    let grammar = p.grammar().map_err(LeanStreamError::InvalidArgument)?;
    if p.grammar.len() > MAX_GRAMMAR_BYTES {
        return invalid(format!(
            "the grammar is {} bytes; at most {MAX_GRAMMAR_BYTES}",
            p.grammar.len()
        ));
    }
    let priority = Priority::parse(&p.priority).map_err(LeanStreamError::InvalidArgument)?;
    let deadline = |ms: u32, name: &str| match ms {
        0 => Ok(None),
        ms if ms <= MAX_DEADLINE_MS => Ok(Some(Duration::from_millis(ms.into()))),
        ms => Err(LeanStreamError::InvalidArgument(format!(
            "{name} {ms} ms is over the limit of {MAX_DEADLINE_MS} ms"
        ))),
    };
    Ok(GenSpec {
        max_tokens,
        sampler,
        stop: p.stop.clone(),
        grammar: grammar.map(|(kind, text)| (kind, text.to_string())),
        priority,
        first_token_within: deadline(p.first_token_deadline_ms, "first_token_deadline_ms")?,
        within: deadline(p.deadline_ms, "deadline_ms")?,
        sentences: p.sentences,
    })
}

pub fn check_prompt(len: usize, params: &Params) -> Result<(), LeanStreamError> {
    if len == 0 {
        return Err(LeanStreamError::InvalidArgument(
            "the prompt is empty".into(),
        ));
    }
    if len > params.max_prompt_bytes {
        return Err(LeanStreamError::InvalidArgument(format!(
            "the prompt is {len} bytes, over the limit of {}",
            params.max_prompt_bytes
        )));
    }
    Ok(())
}

/// A chat's messages checked (count, size, roles) and in the engine's form.
pub fn chat_messages(
    messages: Vec<ChatTurn>,
    params: &Params,
) -> Result<Vec<ChatMessage>, LeanStreamError> {
    if messages.is_empty() || messages.len() > MAX_TURNS {
        return Err(LeanStreamError::InvalidArgument(format!(
            "a chat needs 1..={MAX_TURNS} messages"
        )));
    }
    let total: usize = (messages.iter())
        .map(|m| m.content.len() + m.role.len())
        .sum();
    check_prompt(total, params)?;
    let roles = ["system", "user", "assistant", "tool"];
    if messages.iter().any(|m| !roles.contains(&m.role.as_str())) {
        return Err(LeanStreamError::InvalidArgument(
            "a message role must be system, user, assistant or tool".into(),
        ));
    }
    Ok((messages.into_iter())
        .map(|m| ChatMessage::new(m.role, m.content))
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::RawConfig;

    fn params() -> Params {
        let mut raw = RawConfig::default();
        raw.models.dir = Some(std::env::temp_dir());
        Params::validate(raw).unwrap()
    }

    #[test]
    fn absurd_sampling_settings_are_refused() {
        let p = params();
        let ok = GenerateParams::default();
        assert_eq!(validate_params(&ok, &p).unwrap().max_tokens, p.max_tokens);
        let cases: [fn(&mut GenerateParams); 12] = [
            |g| g.priority = "urgent".into(),
            |g| g.deadline_ms = u32::MAX,
            |g| g.temperature = f64::NAN,
            |g| g.temperature = -1.0,
            |g| g.temperature = 1e9,
            |g| g.top_p = 0.0,
            |g| g.top_p = f64::INFINITY,
            // Positive as an f64, zero as the f32 the sampler uses.
            |g| g.top_p = 5e-324,
            |g| g.repetition_penalty = 0.0,
            |g| g.max_tokens = u32::MAX,
            |g| g.stop = vec![String::new()],
            |g| g.top_k = u32::MAX,
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut g = ok.clone();
            f(&mut g);
            assert!(
                matches!(
                    validate_params(&g, &p),
                    Err(LeanStreamError::InvalidArgument(_))
                ),
                "case {i}"
            );
        }
        assert!(check_prompt(0, &p).is_err());
        assert!(check_prompt(p.max_prompt_bytes + 1, &p).is_err());
        assert!(check_prompt(p.max_prompt_bytes, &p).is_ok());
    }
}
