//! The tokenizer a synthetic model carries: borrowed from a real model (or the tiny test
//! vocabulary) and, when the donor's vocabulary is larger than the shape's, cut down to the
//! shape's size.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::gguf::TinyLlama;
use crate::tokenizer::{SpecialTokens, Tokenizer};
use crate::{Error, Result};

/// A tokenizer for a synthetic model, as the `.lsm` header stores it. It serialises (JSON) so
/// that it can travel without its donor model (`leanstream synth --save-tokenizer`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SynthTokenizer {
    /// `tokenizer.json` text.
    pub json: String,
    pub specials: SpecialTokens,
    pub chat_template: Option<String>,
    /// Where it came from (recorded in the header's `source`).
    pub source: String,
}

impl SynthTokenizer {
    /// The 128-token byte-level BPE vocabulary of the tiny test models.
    pub fn tiny() -> SynthTokenizer {
        let m = TinyLlama::new(0);
        SynthTokenizer {
            json: m.tokenizer_json(),
            specials: SpecialTokens {
                bos: None,
                eos: vec![m.eos],
                add_bos: false,
            },
            chat_template: Some(m.chat_template.clone()),
            source: "tiny test vocabulary".into(),
        }
    }

    /// A real model's tokenizer (e.g. SmolLM2's, from its GGUF file).
    pub fn from_tokenizer(
        t: &Tokenizer,
        chat_template: Option<String>,
        source: String,
    ) -> Result<SynthTokenizer> {
        Ok(SynthTokenizer {
            json: t.to_json()?,
            specials: t.specials().clone(),
            chat_template,
            source,
        })
    }

    /// The tokenizer JSON with every id `>= vocab` removed: vocabulary entries, added tokens, and
    /// the BPE merges whose parts or result are gone. Ids of a byte-level BPE vocabulary follow
    /// merge order, so the first `vocab` ids form a working (smaller) tokenizer. Fails when the
    /// donor has fewer than `vocab` ids, or a special token falls outside.
    pub fn fitted(&self, vocab: usize) -> Result<(String, usize)> {
        let t = Tokenizer::from_json(&self.json, self.specials.clone())?;
        let have = t.vocab_size();
        if have < vocab {
            return Err(Error::InvalidArgument {
                arg: "tokenizer",
                reason: format!(
                    "{} has {have} tokens; the shape needs a vocabulary of {vocab}",
                    self.source
                ),
            });
        }
        if have == vocab {
            return Ok((self.json.clone(), have));
        }
        let bad = |what: &str| Error::Tokenizer(format!("cannot cut down the vocabulary: {what}"));
        let mut v: Value = serde_json::from_str(&self.json).map_err(|e| bad(&e.to_string()))?;
        let model = v.get_mut("model").ok_or_else(|| bad("no `model`"))?;
        if model.get("type").and_then(Value::as_str) != Some("BPE") {
            return Err(bad("only BPE vocabularies can be cut"));
        }
        let keep = |id: &Value| id.as_u64().is_some_and(|i| (i as usize) < vocab);
        let vocab_map = model
            .get_mut("vocab")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| bad("no `model.vocab`"))?;
        vocab_map.retain(|_, id| keep(id));
        let kept: std::collections::HashSet<String> = vocab_map.keys().cloned().collect();
        if let Some(merges) = model.get_mut("merges").and_then(Value::as_array_mut) {
            merges.retain(|m| {
                let (a, b) = match m {
                    Value::String(s) => match s.split_once(' ') {
                        Some((a, b)) => (a.to_string(), b.to_string()),
                        None => return false,
                    },
                    Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                        (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                        _ => return false,
                    },
                    _ => return false,
                };
                kept.contains(&a) && kept.contains(&b) && kept.contains(&format!("{a}{b}"))
            });
        }
        if let Some(added) = v.get_mut("added_tokens").and_then(Value::as_array_mut) {
            added.retain(|t| t.get("id").is_some_and(keep));
        }
        let json = v.to_string();
        let cut = Tokenizer::from_json(&json, self.specials.clone())?;
        Ok((json, cut.vocab_size()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn cutting_keeps_a_working_tokenizer_below_the_size() {
        let t = SynthTokenizer::tiny();
        let (json, n) = t.fitted(128).unwrap();
        assert_eq!((json.len(), n), (t.json.len(), 128));
        let (json, n) = t.fitted(100).unwrap();
        assert_eq!(n, 100);
        let cut = Tokenizer::from_json(&json, t.specials.clone()).unwrap();
        let ids = cut.encode("the cat sat on the mat").unwrap();
        assert!(ids.iter().all(|&i| i < 100), "{ids:?}");
        assert_eq!(cut.decode(&ids).unwrap(), "the cat sat on the mat");
        let err = t.fitted(129).unwrap_err().to_string();
        assert!(err.contains("128 tokens"), "{err}");
    }
}
