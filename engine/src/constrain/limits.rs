//! Bounds on grammar input, checked before llguidance builds anything from it.
//!
//! llguidance compiles a Lark rule, a terminal, a `$ref` target and a nested schema by recursing
//! into it, 2 to 4 KiB of stack a level, and checks no depth of its own: a deep enough grammar
//! overflows the thread's stack and aborts the process (a hostile client could take the daemon
//! down with a 27 KB grammar). So the text is measured first, without recursing, and refused
//! past these limits with an [`Error::InvalidGrammar`](crate::Error::InvalidGrammar) naming the
//! limit.
//!
//! Measured on a thread of the given stack (llguidance 1.9.1, a byte-level vocabulary): the
//! smallest input whose compilation overflowed, built at opt-level 3 as the tests are / as the
//! release build is (thin LTO). Masking the grammars that compiled never went deeper.
//!
//! | input                                               | 2 MiB stack        | 8 MiB stack          |
//! |-----------------------------------------------------|--------------------|----------------------|
//! | Lark rules in a chain (`r1: "w1" r2 \| "x1"`, ...)   | 608 / 653 rules    | 2 471 / 2 649 rules  |
//! | Lark rules in one cycle                             | 608 rules          | 2 471 rules          |
//! | Lark terminals in a chain                           | 671 / 932          | 2 730 / –            |
//! | `$ref` chain, each target `{properties: {a: $ref}}` | 225 / 221 links    | 913 / 893 links      |
//! | `$ref` chain, each target a bare `{$ref}`           | 611 / 545 links    | 2 484 / 2 211 links  |
//!
//! A link of the first `$ref` chain is 3 deep in this module's measure of a schema
//! ([`schema::depth`]: nested objects and arrays, through `$ref`s), of the second 1 deep, so
//! 545 is the least depth that overflowed 2 MiB; for Lark, 608 rules. The limits below are
//! under a quarter of that (a thread spawned with Rust's default stack has 2 MiB), and well
//! above real grammars: a few hundred rules, schemas a few dozen objects deep.
//!
//! Not limited here: a regex (and a Lark `/regex/` or a schema `pattern`) nests at most 250
//! groups (regex-syntax refuses deeper ones; 249 compiles and masks on a 2 MiB stack), and
//! llguidance's own Lark parser nests at most 30 parentheses.

mod graph;
mod lark;
mod schema;

use serde_json::Value;

use graph::Graph;

/// Most rules and terminals a Lark grammar may define.
pub const MAX_LARK_RULES: usize = 1000;

/// Longest chain of rule and terminal references a Lark grammar may have, counting the rules
/// of a cycle once each, plus the depth of a `%json` schema ([`MAX_SCHEMA_DEPTH`]'s measure)
/// where the chain ends in one.
pub const MAX_LARK_DEPTH: usize = 128;

/// Most objects and arrays a JSON Schema may nest in each other (the schema document itself,
/// not following `$ref`s).
pub const MAX_SCHEMA_NESTING: usize = 64;

/// Most distinct `$ref` strings, `$id`s and anchors a JSON Schema may hold, together.
pub const MAX_SCHEMA_REFS: usize = 1000;

/// Deepest a JSON Schema may nest objects and arrays through its `$ref`s, each `$ref` counting
/// the nesting of its target from where it sits.
pub const MAX_SCHEMA_DEPTH: usize = 128;

/// Checks a Lark grammar: how deep its rules (and its `%json` schemas) nest, and how many
/// rules it defines. The error is a one-line reason.
pub(super) fn check_lark(text: &str) -> Result<(), String> {
    let outline = lark::outline(text);
    let mut graph = Graph::default();
    for item in &outline.items {
        // A rule is one level; compiling one of its schemas goes that schema's depth further
        // and comes back before the rule's next reference is compiled.
        let mut height = 1;
        for schema in &item.schemas {
            let depth = check_schema(schema).map_err(|e| format!("a %json schema: {e}"))?;
            height = height.max(1 + depth);
        }
        graph.add_vertex(height, 1);
    }
    for (from, item) in outline.items.iter().enumerate() {
        for name in &item.refs {
            if let Some(&to) = outline.defined.get(name) {
                graph.add_edge(from, to, 1);
            }
        }
    }
    let depth = graph.depths().into_iter().max().unwrap_or(0);
    if depth > MAX_LARK_DEPTH {
        return Err(format!(
            "the grammar nests rules {depth} deep; at most {MAX_LARK_DEPTH}"
        ));
    }
    let rules = outline.defined.len();
    if rules > MAX_LARK_RULES {
        return Err(format!(
            "the grammar defines {rules} rules and terminals; at most {MAX_LARK_RULES}"
        ));
    }
    Ok(())
}

/// Checks a JSON Schema's text before it is parsed, so that deep nesting is refused with the
/// limit in the message (rather than by the JSON parser's own limit of 128, in its words).
pub(super) fn check_schema_text(text: &str) -> Result<(), String> {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for b in text.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    nesting_ok(deepest)
}

fn nesting_ok(nesting: usize) -> Result<(), String> {
    if nesting > MAX_SCHEMA_NESTING {
        return Err(format!(
            "the schema nests {nesting} deep; at most {MAX_SCHEMA_NESTING}"
        ));
    }
    Ok(())
}

/// Checks a parsed JSON Schema: its nesting, its `$ref`s, and how deep they lead. Returns that
/// depth (for a Lark grammar that embeds the schema); the error is a one-line reason.
pub(super) fn check_schema(schema: &Value) -> Result<usize, String> {
    let shape = schema::measure(schema);
    nesting_ok(shape.nesting)?;
    if shape.refs > MAX_SCHEMA_REFS {
        return Err(format!(
            "the schema has {} distinct $refs, $ids and anchors; at most {MAX_SCHEMA_REFS}",
            shape.refs
        ));
    }
    let depth = schema::depth(schema);
    if depth > MAX_SCHEMA_DEPTH {
        return Err(format!(
            "the schema nests {depth} deep through its $refs; at most {MAX_SCHEMA_DEPTH}"
        ));
    }
    Ok(depth)
}

#[cfg(test)]
mod tests;
