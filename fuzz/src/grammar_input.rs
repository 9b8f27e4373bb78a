//! The `grammar` fuzz target's input and what it does with it, shared by the target
//! (`fuzz_targets/grammar.rs`), its seed writer (`src/grammar_seeds.rs`) and the engine's test
//! that runs every seed as an ordinary test (`engine/tests/integration/grammar_seeds.rs`).
//!
//! An input is one byte naming the kind (its value mod 3: JSON Schema, Lark, regex), then the
//! grammar's UTF-8 text. [`run`] does what the daemon does with a request's grammar —
//! `Grammar::new`: the limit checks, then the compilation — and then masks a few steps of a
//! generation. Errors are fine; a panic, an abort or a stack overflow is a bug, and one the
//! daemon would have.
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};

use leanstream_engine::constrain::{ConstraintVocab, Grammar, GrammarKind};
use leanstream_engine::tokenizer::{GgufVocab, Tokenizer};

/// The kinds, by the first byte of an input mod 3.
pub const KINDS: [GrammarKind; 3] = [
    GrammarKind::JsonSchema,
    GrammarKind::Lark,
    GrammarKind::Regex,
];

/// Most generation steps [`run`] masks.
const STEPS: usize = 16;

/// The input for `text` as a grammar of `kind`.
pub fn encode(kind: GrammarKind, text: &str) -> Vec<u8> {
    let tag = KINDS.iter().position(|&k| k == kind).unwrap_or(0) as u8;
    let mut out = vec![tag];
    out.extend_from_slice(text.as_bytes());
    out
}

/// The kind and text of an input; `None` if it is empty or not UTF-8.
pub fn decode(data: &[u8]) -> Option<(GrammarKind, &str)> {
    let (&tag, text) = data.split_first()?;
    Some((KINDS[usize::from(tag) % 3], std::str::from_utf8(text).ok()?))
}

/// GPT-2's byte → char map, in which byte-level vocabularies are written.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or('?')
}

/// A byte-level vocabulary (SmolLM2's kind): three control tokens (`<|im_end|>` is eos), the
/// 256 bytes, and a few merges JSON output uses.
pub fn vocab() -> &'static Arc<ConstraintVocab> {
    static VOCAB: OnceLock<Arc<ConstraintVocab>> = OnceLock::new();
    VOCAB.get_or_init(|| {
        let spell = |s: &str| s.bytes().map(byte_char).collect::<String>();
        let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .map(String::from)
            .to_vec();
        tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
        let mut merges = Vec::new();
        for (a, b) in [
            ("{", "\""),
            ("\"", ":"),
            (",", " "),
            ("u", "e"),
            ("r", "ue"),
            ("t", "rue"),
        ] {
            let joined = spell(&format!("{a}{b}"));
            if !tokens.contains(&joined) {
                tokens.push(joined);
            }
            merges.push(format!("{} {}", spell(a), spell(b)));
        }
        let mut token_types = vec![1; tokens.len()];
        token_types[..3].fill(3);
        let v = GgufVocab {
            model: "gpt2".into(),
            pre: Some("gpt2".into()),
            tokens,
            token_types,
            merges,
            bos: Some(1),
            eos: Some(2),
            ..GgufVocab::default()
        };
        let tok = Tokenizer::from_gguf(&v).expect("the fuzz vocabulary builds");
        ConstraintVocab::new(&tok).expect("the fuzz vocabulary has an eos")
    })
}

/// Compiles the input's grammar as the daemon does and masks up to [`STEPS`] tokens of a
/// generation, each the allowed id the input's length and the step pick. Returns whether the
/// grammar compiled.
pub fn run(data: &[u8]) -> bool {
    let Some((kind, text)) = decode(data) else {
        return false;
    };
    let vocab = vocab();
    let Ok(grammar) = Grammar::new(vocab, kind, text) else {
        return false;
    };
    let mut constraint = grammar.start();
    let mut logits = vec![0.0f32; vocab.vocab_size()];
    for step in 0..STEPS {
        logits.fill(0.0);
        if constraint.mask(&mut logits).is_err() {
            break;
        }
        let allowed: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize].is_finite())
            .collect();
        let pick = allowed.get(data.len().wrapping_add(step * 7) % allowed.len().max(1));
        match pick {
            Some(&id) if constraint.advance(id).is_ok() && !constraint.is_done() => {}
            _ => break,
        }
    }
    true
}

/// One seed: a file name, the grammar, and whether [`run`] compiles it.
pub struct Seed {
    pub name: &'static str,
    pub kind: GrammarKind,
    pub text: String,
    pub compiles: bool,
}

impl Seed {
    fn new(name: &'static str, kind: GrammarKind, text: impl Into<String>, compiles: bool) -> Seed {
        Seed {
            name,
            kind,
            text: text.into(),
            compiles,
        }
    }
}

/// `start: r1`, then `r{i}: "w{i}" r{i+1} | "x{i}"` for `n` rules (the issue's reproducer at
/// 1000; `T` names make it a chain of terminals).
fn lark_chain(n: usize, name: &str) -> String {
    let mut g = format!("start: {name}1\n");
    for i in 1..n {
        g += &format!("{name}{i}: \"w{i}\" {name}{} | \"x{i}\"\n", i + 1);
    }
    g + &format!("{name}{n}: \"end\"\n")
}

/// `n` definitions, each `{"type": "object", "properties": {"a": next}}` (the issue's
/// reproducer at 600), or a bare `{"$ref": next}` when not `object`.
fn ref_chain(n: usize, object: bool) -> String {
    let defs: Vec<String> = (0..n)
        .map(|i| {
            let next = format!(r##"{{"$ref": "#/$defs/d{}"}}"##, i + 1);
            let d = if i + 1 == n {
                r#"{"type": "integer"}"#.to_string()
            } else if object {
                format!(r#"{{"type": "object", "properties": {{"a": {next}}}}}"#)
            } else {
                next
            };
            format!(r#""d{i}": {d}"#)
        })
        .collect();
    format!(
        r##"{{"$defs": {{{}}}, "$ref": "#/$defs/d0"}}"##,
        defs.join(", ")
    )
}

/// `n` objects nested inline.
fn nested_objects(n: usize) -> String {
    let mut s = r#"{"type": "integer"}"#.to_string();
    for _ in 0..n {
        s = format!(r#"{{"type": "object", "properties": {{"a": {s}}}, "required": ["a"]}}"#);
    }
    s
}

/// The seed corpus: grammars like those clients send, and the inputs that once crashed the
/// daemon (`reproducer_*`).
pub fn seeds() -> Vec<Seed> {
    use GrammarKind::{JsonSchema, Lark, Regex};
    let planner = r#"{"type":"object","properties":{"action":{"enum":["pick","place","move","stop"]},"object":{"type":"string","maxLength":20},"x":{"type":"number"}},"required":["action","object"],"additionalProperties":false}"#;
    let plan = r#"{"type":"object","properties":{"steps":{"type":"array","minItems":1,"maxItems":3,"items":{"type":"object","properties":{"action":{"enum":["pick","place"]},"target":{"type":"string","maxLength":16}},"required":["action","target"]}}},"required":["steps"]}"#;
    let tree = r##"{"$defs":{"node":{"type":"object","properties":{"name":{"type":"string"},"children":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["name"]}},"$ref":"#/$defs/node"}"##;
    let mixed = r#"{"anyOf":[{"type":"integer","minimum":-5,"maximum":5},{"type":"string","pattern":"^[a-z]{2,4}$"},{"const":true},{"type":"null"}]}"#;
    let lark = r#"
start: item (", " item)*
?item: NUMBER -> num
     | WORD
     | "(" start ")"
NUMBER: /[0-9]+/
WORD: /[a-z]+/
%ignore " "
"#;
    let lark_json = r#"start: "Answer: " %json {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}"#;
    let lark_tokens =
        "start: GREETING \" \" NAME \"!\"\nGREETING: \"hi\" | \"hello\"\nNAME: /[A-Z][a-z]{1,8}/\n";
    vec![
        Seed::new("schema_planner", JsonSchema, planner, true),
        Seed::new("schema_plan", JsonSchema, plan, true),
        Seed::new("schema_tree", JsonSchema, tree, true),
        Seed::new("schema_mixed", JsonSchema, mixed, true),
        Seed::new("schema_true", JsonSchema, "true", true),
        Seed::new("schema_self_ref", JsonSchema, r##"{"$ref": "#"}"##, false),
        Seed::new("schema_nested_31", JsonSchema, nested_objects(31), true),
        Seed::new("lark_list", Lark, lark, true),
        Seed::new("lark_json", Lark, lark_json, true),
        Seed::new("lark_tokens", Lark, lark_tokens, true),
        Seed::new("lark_chain_100", Lark, lark_chain(100, "r"), true),
        Seed::new("regex_pick", Regex, "(pick|place) [a-z]{1,8}", true),
        Seed::new(
            "regex_nested_249",
            Regex,
            format!("{}a{}", "(".repeat(249), ")".repeat(249)),
            true,
        ),
        Seed::new(
            "regex_nested_10000",
            Regex,
            format!("{}a{}", "(".repeat(10_000), ")".repeat(10_000)),
            false,
        ),
        Seed::new(
            "reproducer_lark_rules_1000",
            Lark,
            lark_chain(1000, "r"),
            false,
        ),
        Seed::new(
            "reproducer_lark_terminals_1000",
            Lark,
            lark_chain(1000, "T"),
            false,
        ),
        Seed::new(
            "reproducer_schema_ref_chain_600",
            JsonSchema,
            ref_chain(600, true),
            false,
        ),
        Seed::new(
            "reproducer_schema_bare_refs_1000",
            JsonSchema,
            ref_chain(1000, false),
            false,
        ),
        Seed::new(
            "reproducer_schema_nested_600",
            JsonSchema,
            nested_objects(600),
            false,
        ),
        Seed::new(
            "reproducer_lark_json_refs_600",
            Lark,
            format!("start: %json {}\n", ref_chain(600, true)),
            false,
        ),
    ]
}
