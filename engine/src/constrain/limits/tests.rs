//! The limits against the issue's reproducers, and the deepest grammars they allow compiled and
//! masked on a 2 MiB stack (what a thread spawned with Rust's default stack has).

use std::sync::Arc;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::Error;
use crate::constrain::{ConstraintVocab, Grammar, GrammarKind};
use crate::tokenizer::Tokenizer;
use crate::tokenizer::fixtures::byte_level_vocab;

const TWO_MIB: usize = 2 << 20;

fn vocab() -> Arc<ConstraintVocab> {
    let tok = Tokenizer::from_gguf(&byte_level_vocab("gpt2", &[("w", "1")]))
        .expect("the synthetic byte-level vocabulary builds");
    ConstraintVocab::new(&tok).expect("vocab")
}

/// `start: r1`, then `r{i}: "w{i}" r{i+1} | "x{i}"` for `n` rules: the issue's reproducer at 1000.
fn lark_chain(n: usize) -> String {
    let mut g = String::from("start: r1\n");
    for i in 1..n {
        g += &format!("r{i}: \"w{i}\" r{} | \"x{i}\"\n", i + 1);
    }
    g + &format!("r{n}: \"end\"\n")
}

/// `n` rules in one cycle, entered from `start`.
fn lark_cycle(n: usize) -> String {
    let mut g = String::from("start: r1\n");
    for i in 1..n {
        g += &format!("r{i}: \"w\" r{} | \"x\"\n", i + 1);
    }
    g + &format!("r{n}: \"w\" r1 | \"end\"\n")
}

/// `n` terminals in a chain (one regex nested `n` deep).
fn terminal_chain(n: usize) -> String {
    let mut g = String::from("start: T1\n");
    for i in 1..n {
        g += &format!("T{i}: \"w\" T{} | \"x\"\n", i + 1);
    }
    g + &format!("T{n}: \"end\"\n")
}

/// `n` definitions, each made by `link` from the `$ref` to the next: the issue's reproducer is
/// `{"type": "object", "properties": {"a": next}}` at 600.
fn ref_chain(n: usize, link: impl Fn(Value) -> Value) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        let next = json!({"$ref": format!("#/$defs/d{}", i + 1)});
        let d = if i + 1 < n {
            link(next)
        } else {
            json!({"type": "integer"})
        };
        defs.insert(format!("d{i}"), d);
    }
    json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

fn object_link(next: Value) -> Value {
    json!({"type": "object", "properties": {"a": next}})
}

fn bare_link(next: Value) -> Value {
    next
}

fn any_of_link(next: Value) -> Value {
    json!({"anyOf": [next.clone(), {"type": "array", "items": next}]})
}

/// `n` objects nested inline, each the only property of the one around it.
fn nested_objects(n: usize) -> String {
    let mut s = json!({"type": "integer"});
    for _ in 0..n {
        s = json!({"type": "object", "properties": {"a": s}, "required": ["a"]});
    }
    s.to_string()
}

/// The largest `n` for which `grammar(n)` passes `check`.
fn largest_allowed<T>(grammar: impl Fn(usize) -> T, check: impl Fn(&T) -> bool) -> usize {
    let mut n = 1;
    while check(&grammar(n + 1)) {
        n += 1;
    }
    assert!(check(&grammar(n)), "even the smallest grammar is refused");
    n
}

fn reason(r: crate::Result<Grammar>) -> String {
    match r {
        Err(Error::InvalidGrammar { reason, .. }) => reason,
        other => panic!("expected InvalidGrammar, got {other:?}"),
    }
}

/// Compiles `text` on a thread with a 2 MiB stack and walks the grammar for `steps` tokens,
/// taking the allowed token with the lowest id that is not eos (in these grammars the way
/// deeper: `w` before `x`, `"` before `}`); a stack overflow aborts the test binary.
fn compile_and_walk_on_2_mib(kind: GrammarKind, text: String, steps: usize) {
    let vocab = vocab();
    let walk = move || {
        let grammar = Grammar::new(&vocab, kind, &text)
            .unwrap_or_else(|e| panic!("{kind} of {} bytes: {e}", text.len()));
        let mut c = grammar.start();
        let mut logits = vec![0.0f32; vocab.vocab_size()];
        for _ in 0..steps {
            logits.fill(0.0);
            c.mask(&mut logits).expect("mask");
            let allowed = (0..logits.len() as u32).filter(|&i| logits[i as usize].is_finite());
            let Some(next) = allowed.filter(|id| !vocab.eos().contains(id)).min() else {
                break;
            };
            c.advance(next).expect("advance");
        }
    };
    let thread = std::thread::Builder::new()
        .stack_size(TWO_MIB)
        .spawn(walk)
        .expect("spawn");
    if let Err(panic) = thread.join() {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn the_issues_thousand_rule_lark_chain_is_refused() {
    let text = lark_chain(1000);
    assert!(text.len() > 25_000);
    let why = reason(Grammar::lark(&vocab(), &text));
    assert_eq!(why, "the grammar nests rules 1001 deep; at most 128");
}

#[test]
fn the_issues_600_deep_ref_chain_is_refused() {
    let text = ref_chain(600, object_link).to_string();
    let why = reason(Grammar::json_schema(&vocab(), &text));
    assert!(why.starts_with("the schema nests 18"), "{why}");
    assert!(
        why.ends_with(" deep through its $refs; at most 128"),
        "{why}"
    );
}

#[test]
fn a_schema_nested_600_deep_inline_is_refused_with_the_limit() {
    let why = reason(Grammar::json_schema(&vocab(), &nested_objects(600)));
    assert_eq!(why, "the schema nests 1201 deep; at most 64");
}

#[test]
fn a_deep_ref_chain_inside_a_lark_grammar_is_refused() {
    let schema = ref_chain(600, object_link);
    let why = reason(Grammar::lark(&vocab(), &format!("start: %json {schema}\n")));
    assert!(
        why.starts_with("a %json schema: the schema nests 18"),
        "{why}"
    );
}

#[test]
fn a_chain_of_rules_that_each_embed_a_schema_counts_one_schema() {
    // A schema is compiled and done with before the next rule is: 100 rules with a schema
    // 19 deep each nest 119 deep, not 2000.
    let schema = nested_objects(9);
    let depth = check_schema(&serde_json::from_str(&schema).expect("JSON")).expect("fits");
    assert_eq!(depth, 19);
    let chain = lark_chain(100).replace("| \"x", &format!("| %json {schema} | \"x"));
    check_lark(&chain).expect("fits");
    compile_and_walk_on_2_mib(GrammarKind::Lark, chain.clone(), 50);
    let longer = lark_chain(111).replace("| \"x", &format!("| %json {schema} | \"x"));
    assert_eq!(
        check_lark(&longer),
        Err("the grammar nests rules 130 deep; at most 128".into())
    );
}

#[test]
fn a_shallow_grammar_with_too_many_rules_is_refused() {
    let mut g = String::from("start: r0");
    for i in 1..1001 {
        g += &format!(" | r{i}");
    }
    g += "\n";
    for i in 0..1001 {
        g += &format!("r{i}: \"w{i}\"\n");
    }
    let why = reason(Grammar::lark(&vocab(), &g));
    assert_eq!(
        why,
        "the grammar defines 1002 rules and terminals; at most 1000"
    );
}

#[test]
fn a_schema_with_too_many_distinct_refs_is_refused() {
    let props: serde_json::Map<String, Value> = (0..1001)
        .map(|i| (format!("p{i}"), json!({"$ref": format!("#/$defs/d{i}")})))
        .collect();
    let defs: serde_json::Map<String, Value> = (0..1001)
        .map(|i| (format!("d{i}"), json!({"type": "integer"})))
        .collect();
    let s = json!({"type": "object", "properties": props, "$defs": defs});
    let why = reason(Grammar::json_schema(&vocab(), &s.to_string()));
    assert_eq!(
        why,
        "the schema has 1001 distinct $refs, $ids and anchors; at most 1000"
    );
}

#[test]
fn the_deepest_allowed_lark_grammars_compile_and_mask_on_a_2_mib_stack() {
    let allowed = |g: &String| check_lark(g).is_ok();
    for (name, grammar) in [
        ("rule chain", lark_chain as fn(usize) -> String),
        ("rule cycle", lark_cycle),
        ("terminal chain", terminal_chain),
    ] {
        let n = largest_allowed(grammar, allowed);
        assert!(n >= MAX_LARK_DEPTH - 2, "{name}: only {n} allowed");
        assert!(check_lark(&grammar(n + 1)).is_err());
        compile_and_walk_on_2_mib(GrammarKind::Lark, grammar(n), 4 * n);
    }
}

#[test]
fn the_deepest_allowed_schemas_compile_and_mask_on_a_2_mib_stack() {
    let allowed = |s: &Value| check_schema(s).is_ok();
    for link in [object_link as fn(Value) -> Value, bare_link, any_of_link] {
        let n = largest_allowed(|n| ref_chain(n, link), allowed);
        let text = ref_chain(n, link).to_string();
        compile_and_walk_on_2_mib(GrammarKind::JsonSchema, text, 300);
        // Embedded in a Lark grammar.
        let lark = |n: usize| format!("start: %json {}\n", ref_chain(n, link));
        let n = largest_allowed(lark, |g| check_lark(g).is_ok());
        compile_and_walk_on_2_mib(GrammarKind::Lark, lark(n), 300);
    }
    let n = largest_allowed(nested_objects, |s| {
        check_schema_text(s).is_ok() && serde_json::from_str(s).is_ok_and(|v| allowed(&v))
    });
    compile_and_walk_on_2_mib(GrammarKind::JsonSchema, nested_objects(n), 300);
}

#[test]
fn a_regex_nested_past_what_regex_syntax_allows_is_a_one_line_error() {
    let deep = |n: usize| format!("{}a{}", "(".repeat(n), ")".repeat(n));
    let why = reason(Grammar::regex(&vocab(), &deep(10_000)));
    assert!(!why.contains('\n') && why.chars().count() <= 301, "{why}");
    // The deepest it allows compiles on a 2 MiB stack, as a regex and as a Lark terminal.
    compile_and_walk_on_2_mib(GrammarKind::Regex, deep(249), 4);
    compile_and_walk_on_2_mib(GrammarKind::Lark, format!("start: /{}/\n", deep(249)), 4);
}

#[test]
fn real_grammars_are_well_inside_the_limits() {
    let tree = json!({
        "$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["name"]}},
        "$ref": "#/$defs/node"
    });
    let depth = check_schema(&tree).expect("a recursive tree schema passes");
    assert!(depth <= 16, "{depth}");
    let lark = r#"
start: item (", " item)* | %json {"type": "object", "properties": {"x": {"type": "number"}}}
?item: NUMBER -> num
     | WORD
     | "(" start ")"
NUMBER: /[0-9]+/
WORD: /[a-z]+/
%ignore " "
"#;
    check_lark(lark).expect("a small recursive Lark grammar passes");
    let vocab = vocab();
    Grammar::lark(&vocab, lark).expect("and compiles");
    Grammar::json_schema(&vocab, &tree.to_string()).expect("and compiles");
}

/// What the limits prevent: the issue's reproducers, compiled without them on a 2 MiB stack,
/// overflow it. Each runs in a child process (this test binary again), since an overflow aborts
/// the process; the child's part is the `LEANSTREAM_UNCHECKED_GRAMMAR` branch.
#[test]
fn without_the_limits_the_reproducers_overflow_a_2_mib_stack() {
    if let Ok(which) = std::env::var("LEANSTREAM_UNCHECKED_GRAMMAR") {
        let (kind, text) = match which.as_str() {
            "lark" => (GrammarKind::Lark, lark_chain(1000)),
            _ => (
                GrammarKind::JsonSchema,
                ref_chain(600, object_link).to_string(),
            ),
        };
        let vocab = vocab();
        let compile = move || Grammar::without_limits(&vocab, kind, &text).is_ok();
        let thread = std::thread::Builder::new()
            .stack_size(TWO_MIB)
            .spawn(compile);
        let compiled = thread.expect("spawn").join().unwrap_or(false);
        println!("compiled without overflowing: {compiled}");
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let test =
        "constrain::limits::tests::without_the_limits_the_reproducers_overflow_a_2_mib_stack";
    for which in ["lark", "json"] {
        let out = std::process::Command::new(&exe)
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env("LEANSTREAM_UNCHECKED_GRAMMAR", which)
            .output()
            .expect("run the child");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{which}: the child did not fail");
        assert!(
            stderr.contains("has overflowed its stack"),
            "{which}: {stderr}"
        );
    }
}

proptest! {
    /// The checks read any text without panicking (the fuzz target covers compilation too).
    #[test]
    fn the_checks_read_any_text(text in "[a-zA-Z_!?<>#/\"\\\\%:|{}()\\[\\]\n .0-9é$-]{0,120}") {
        let _ = check_lark(&text);
        let _ = check_schema_text(&text);
        if let Ok(value) = serde_json::from_str::<Value>(&text) {
            let _ = check_schema(&value);
        }
    }
}
