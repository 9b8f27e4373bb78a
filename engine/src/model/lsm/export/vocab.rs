//! The exported file's metadata: llama.cpp's keys for the architecture, and the vocabulary fitted
//! to the embedding's rows.

use super::*;

/// llama.cpp's `general.file_type` (`llama_ftype`) for a model mostly of `dtype`, where one
/// type says it.
pub(super) fn file_type(dtype: DType) -> Option<u32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Bf16 => 32,
        _ => return None,
    })
}

/// The metadata llama.cpp reads for the architecture, and the tokenizer.
pub(super) fn metadata(w: &mut GgufWriter, h: &Header, v: &GgufVocab) {
    let c = &h.config;
    let a = c.architecture.name();
    let u = |n: usize| Value::U32(n as u32);
    let k = |s: &str| format!("{a}.{s}");
    w.add("general.architecture", Value::String(a.into()))
        .add("general.name", Value::String(h.source.clone()))
        .add(&k("block_count"), u(c.n_layers))
        .add(&k("context_length"), u(c.context_length))
        .add(&k("embedding_length"), u(c.d_model))
        .add(&k("feed_forward_length"), u(c.n_ff))
        .add(&k("attention.head_count"), u(c.n_heads))
        .add(&k("attention.head_count_kv"), u(c.n_kv_heads))
        .add(&k("rope.dimension_count"), u(c.head_dim))
        .add(&k("rope.freq_base"), Value::F32(c.rope_base))
        .add(
            &k("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_eps),
        )
        .add(&k("vocab_size"), u(c.vocab_size));
    if c.head_dim * c.n_heads != c.d_model {
        w.add(&k("attention.key_length"), u(c.head_dim))
            .add(&k("attention.value_length"), u(c.head_dim));
    }
    if let Some(ft) = file_type(h.ffn.gate_dtype) {
        w.add("general.file_type", Value::U32(ft));
    }
    w.add("tokenizer.ggml.model", Value::String(v.model.clone()));
    if let Some(pre) = &v.pre {
        w.add("tokenizer.ggml.pre", Value::String(pre.clone()));
    }
    w.add(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(v.tokens.clone())),
    );
    if !v.token_types.is_empty() {
        w.add(
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(v.token_types.clone())),
        );
    }
    if !v.scores.is_empty() {
        w.add(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(v.scores.clone())),
        );
    }
    if !v.merges.is_empty() {
        w.add(
            "tokenizer.ggml.merges",
            Value::Array(Array::String(v.merges.clone())),
        );
    }
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", v.bos),
        ("tokenizer.ggml.eos_token_id", v.eos),
        ("tokenizer.ggml.unknown_token_id", v.unk),
    ] {
        if let Some(id) = id {
            w.add(key, Value::U32(id));
        }
    }
    w.add("tokenizer.ggml.add_bos_token", Value::Bool(v.add_bos));
    if let Some(p) = v.add_space_prefix {
        w.add("tokenizer.ggml.add_space_prefix", Value::Bool(p));
    }
    if let Some(t) = &h.chat_template {
        w.add("tokenizer.chat_template", Value::String(t.clone()));
    }
}

/// How the tokenizer was fitted to the embedding's rows.
#[derive(Default)]
pub(super) struct VocabFit {
    pub(super) dropped: usize,
    pub(super) padded: usize,
    pub(super) merges_dropped: usize,
}

/// GGUF token type of an id no stored token has.
pub(super) const TYPE_UNUSED: i32 = 5;

/// The GGUF vocabulary of the stored tokenizer with exactly `n` tokens (the embedding's rows):
/// ids beyond it left out (with the merges that need them), missing ones filled with
/// placeholders; the special ids are `specials`. Checked by building the engine's tokenizer from
/// it, so that the exported file imports.
pub(super) fn gguf_vocab(
    stored: StoredTokenizer,
    specials: &SpecialTokens,
    n: usize,
) -> std::result::Result<(GgufVocab, VocabFit), String> {
    let mut v = match stored {
        StoredTokenizer::Vocab(v) => v,
        StoredTokenizer::Json(json) => vocab_from_json(&json)?,
    };
    v.bos = specials.bos;
    v.eos = specials.eos.first().copied();
    v.add_bos = specials.add_bos;
    let mut fit = VocabFit::default();
    if v.token_types.is_empty() {
        v.token_types = vec![1; v.tokens.len()];
    }
    if v.tokens.len() > n {
        fit.dropped = v.tokens.len() - n;
        v.tokens.truncate(n);
        v.token_types.truncate(n);
        v.scores.truncate(n);
        let kept: std::collections::HashSet<&str> = v.tokens.iter().map(String::as_str).collect();
        let before = v.merges.len();
        let keep = |m: &String| {
            split_merge(m).is_some_and(|(a, b)| {
                kept.contains(a) && kept.contains(b) && kept.contains(format!("{a}{b}").as_str())
            })
        };
        let merges: Vec<String> = v.merges.iter().filter(|m| keep(m)).cloned().collect();
        fit.merges_dropped = before - merges.len();
        v.merges = merges;
        for id in [&mut v.bos, &mut v.eos, &mut v.unk] {
            if id.is_some_and(|i| i as usize >= n) {
                *id = None;
            }
        }
    }
    while v.tokens.len() < n {
        fit.padded += 1;
        v.tokens.push(format!("[PAD{}]", v.tokens.len()));
        v.token_types.push(TYPE_UNUSED);
        if !v.scores.is_empty() {
            v.scores.push(f32::MIN);
        }
    }
    Tokenizer::from_gguf(&v).map_err(|e| format!("the exported vocabulary is not valid: {e}"))?;
    Ok((v, fit))
}

/// A merge's two origins, split as llama.cpp does: at the first space after the first character.
pub(super) fn split_merge(m: &str) -> Option<(&str, &str)> {
    let first = m.chars().next()?.len_utf8();
    let pos = m[first..].find(' ')? + first;
    Some((&m[..pos], &m[pos + 1..]))
}

/// `tokenizer.ggml.pre` values, one for each pre-tokenizer the engine builds for a `gpt2`
/// vocabulary; a `tokenizer.json` whose pre-tokenizer is one of them exports under its name.
pub(super) const PRE_NAMES: [&str; 5] = ["smollm", "gpt-2", "llama-bpe", "qwen2", "default"];

/// The GGUF vocabulary of a byte-level BPE `tokenizer.json` (the form `leanstream synth` and
/// safetensors imports store): tokens by id, added tokens typed control (special) or
/// user-defined, merges as `"left right"`, and the `pre` whose pre-tokenizer it uses. Special
/// ids are left to the caller.
pub(super) fn vocab_from_json(json: &str) -> std::result::Result<GgufVocab, String> {
    use serde_json::Value as J;
    let v: J = serde_json::from_str(json).map_err(|e| format!("tokenizer.json: {e}"))?;
    let model = &v["model"];
    if model["type"].as_str() != Some("BPE")
        || !matches!(v["decoder"]["type"].as_str(), Some("ByteLevel"))
    {
        return Err(format!(
            "only byte-level BPE tokenizers can be exported (this one is model {}, decoder {})",
            model["type"], v["decoder"]["type"]
        ));
    }
    let mut tokens: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |id: u64, text: &str, ty: i32| -> std::result::Result<(), String> {
        let id = usize::try_from(id)
            .ok()
            .filter(|&i| i < crate::tokenizer::MAX_VOCAB)
            .ok_or_else(|| format!("token id {id} is too large"))?;
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some((text.to_string(), ty));
        Ok(())
    };
    for (text, id) in model["vocab"]
        .as_object()
        .ok_or("tokenizer.json has no model.vocab")?
    {
        put(
            id.as_u64().ok_or("a vocabulary id is not a number")?,
            text,
            1,
        )?;
    }
    for t in v["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(text)) = (t["id"].as_u64(), t["content"].as_str()) else {
            return Err("an added token has no id or content".into());
        };
        let ty = if t["special"].as_bool() == Some(true) {
            3
        } else {
            4
        };
        put(id, text, ty)?;
    }
    let (tokens, token_types) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), TYPE_UNUSED)))
        .unzip();
    let merges = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            J::String(s) => Ok(s.clone()),
            J::Array(p) => match (p.first().and_then(J::as_str), p.get(1).and_then(J::as_str)) {
                (Some(a), Some(b)) if p.len() == 2 => Ok(format!("{a} {b}")),
                _ => Err("a merge is not a pair of strings".to_string()),
            },
            _ => Err("a merge is neither a string nor a pair".to_string()),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let unk = model["unk_token"]
        .as_str()
        .and_then(|u| model["vocab"][u].as_u64())
        .map(|id| id as u32);
    Ok(GgufVocab {
        model: "gpt2".into(),
        pre: Some(pre_of(&v)?.to_string()),
        tokens,
        token_types,
        merges,
        unk,
        ..GgufVocab::default()
    })
}

/// The `pre` name whose pre-tokenizer (as the engine builds it for a GGUF vocabulary) is the
/// one of `tokenizer` (parsed `tokenizer.json`), compared as written and, failing that, as the
/// `tokenizers` crate writes it back.
pub(super) fn pre_of(tokenizer: &serde_json::Value) -> std::result::Result<&'static str, String> {
    let candidates: Vec<(&str, serde_json::Value)> = PRE_NAMES
        .iter()
        .filter_map(|&pre| {
            let probe = GgufVocab {
                model: "gpt2".into(),
                pre: Some(pre.into()),
                tokens: vec!["a".into(), "b".into(), "ab".into()],
                token_types: vec![1; 3],
                merges: vec!["a b".into()],
                ..GgufVocab::default()
            };
            let json = Tokenizer::from_gguf(&probe).ok()?.to_json().ok()?;
            let v: serde_json::Value = serde_json::from_str(&json).ok()?;
            Some((pre, v["pre_tokenizer"].clone()))
        })
        .collect();
    let find = |pt: &serde_json::Value| candidates.iter().find(|(_, c)| c == pt).map(|(p, _)| *p);
    if let Some(pre) = find(&tokenizer["pre_tokenizer"]) {
        return Ok(pre);
    }
    let rewritten = Tokenizer::from_json(&tokenizer.to_string(), Default::default())
        .and_then(|t| t.to_json())
        .ok()
        .and_then(|j| serde_json::from_str::<serde_json::Value>(&j).ok());
    rewritten
        .and_then(|r| find(&r["pre_tokenizer"]))
        .ok_or_else(|| {
            format!(
                "its pre-tokenizer matches none of GGUF's {}: {}",
                PRE_NAMES.join(", "),
                tokenizer["pre_tokenizer"]
            )
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly on purpose
mod tests {
    use super::*;
    use crate::model::TensorBytes;
    use crate::model::gguf::TinyLlama;
    use crate::model::gguf::{GgufFile, GgufModel};

    /// The tiny models' GGUF vocabulary (128 tokens, 29 merges, `pre` smollm).
    fn tiny_vocab() -> GgufVocab {
        let bytes = TinyLlama::new(0).gguf_writer(DType::F32).to_bytes();
        let f = GgufFile::parse(Path::new("tiny.gguf"), TensorBytes::from_vec(bytes)).unwrap();
        GgufModel::from_file(&f).unwrap().vocab
    }

    fn eos(id: u32) -> SpecialTokens {
        SpecialTokens {
            bos: None,
            eos: vec![id],
            add_bos: false,
        }
    }

    #[test]
    fn a_tokenizer_json_gives_back_the_gguf_vocabulary() {
        let want = tiny_vocab();
        // Written by hand (the tiny models' tokenizer.json) and by the tokenizers crate from the
        // GGUF vocabulary (what `synth --tokenizer-from` stores).
        let crate_json = Tokenizer::from_gguf(&want).unwrap().to_json().unwrap();
        for json in [TinyLlama::new(0).tokenizer_json(), crate_json] {
            let v = vocab_from_json(&json).unwrap();
            assert_eq!(v.tokens, want.tokens);
            assert_eq!(v.token_types, want.token_types);
            assert_eq!(v.merges, want.merges);
            assert_eq!(
                (v.model.as_str(), v.pre.as_deref()),
                ("gpt2", Some("smollm"))
            );
        }
        // Each pre-tokenizer maps back to its name.
        for pre in ["gpt-2", "llama-bpe", "qwen2", "default"] {
            let mut v = tiny_vocab();
            v.pre = Some(pre.into());
            let json = Tokenizer::from_gguf(&v).unwrap().to_json().unwrap();
            assert_eq!(vocab_from_json(&json).unwrap().pre.as_deref(), Some(pre));
        }
    }

    #[test]
    fn what_cannot_be_a_gguf_vocabulary_is_named() {
        let mut v: serde_json::Value =
            serde_json::from_str(&TinyLlama::new(0).tokenizer_json()).unwrap();
        v["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"});
        let e = vocab_from_json(&v.to_string()).unwrap_err();
        assert!(
            e.contains("pre-tokenizer matches none") && e.contains("Whitespace"),
            "{e}"
        );
        v["decoder"] = serde_json::json!({"type": "Metaspace", "replacement": "▁",
            "prepend_scheme": "always", "split": true});
        let e = vocab_from_json(&v.to_string()).unwrap_err();
        assert!(e.contains("only byte-level BPE"), "{e}");
    }

    #[test]
    fn the_vocabulary_is_cut_or_padded_to_the_embedding_rows() {
        let stored = StoredTokenizer::Vocab(tiny_vocab());
        let (v, fit) = gguf_vocab(stored.clone(), &eos(2), 110).unwrap();
        assert_eq!((v.tokens.len(), v.token_types.len()), (110, 110));
        assert_eq!((fit.dropped, fit.padded), (18, 0));
        // Merge results are ids 99.. in merge order: the first 11 merges stay.
        assert_eq!(v.merges, tiny_vocab().merges[..11]);
        assert_eq!(fit.merges_dropped, 18);
        assert_eq!(v.eos, Some(2));
        let t = Tokenizer::from_gguf(&v).unwrap();
        let ids = t.encode("the cat sat").unwrap();
        assert!(ids.iter().all(|&i| i < 110), "{ids:?}");
        assert_eq!(t.decode(&ids).unwrap(), "the cat sat");

        let (v, fit) = gguf_vocab(stored.clone(), &eos(2), 140).unwrap();
        assert_eq!((v.tokens.len(), fit.padded, fit.dropped), (140, 12, 0));
        assert_eq!(
            (v.tokens[139].as_str(), v.token_types[139]),
            ("[PAD139]", 5)
        );
        assert_eq!(v.merges.len(), 29);

        // A special id beyond the cut is left out rather than pointing nowhere.
        let (v, _) = gguf_vocab(stored, &eos(120), 110).unwrap();
        assert_eq!(v.eos, None);
    }
}
