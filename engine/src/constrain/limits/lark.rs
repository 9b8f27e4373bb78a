//! What the depth check needs from a Lark grammar, read without parsing it: its definitions
//! (rules and terminals), the names each one mentions, and the JSON Schemas it embeds with
//! `%json`.
//!
//! The scan follows llguidance's Lark lexer where it matters: `#` and `//` comments, JSON
//! strings, `/regex/` literals, `<special>` tokens, `%json`/`%regex`/`%llguidance` followed by
//! a JSON value, names as its two name patterns read them, and a newline that ends an item
//! unless the next line starts with `|`. A name followed by `:`
//! (after optional `{params}` and `.priority`) starts a definition wherever it appears; any
//! other name is a reference from the item it is in. Whatever it cannot make sense of, it
//! over-counts (a reference too many is a longer path, never a shorter one) or leaves to
//! llguidance, which refuses the grammar before compiling anything.

use std::collections::HashMap;

use serde_json::Value;

/// One item of a grammar: a definition, or a statement such as `%ignore`.
#[derive(Debug, Default)]
pub(super) struct Item<'a> {
    /// The names it mentions (defined or not).
    pub refs: Vec<&'a str>,
    /// The schemas of its `%json` values.
    pub schemas: Vec<Value>,
}

/// A grammar's items and which of them each name defines.
#[derive(Debug, Default)]
pub(super) struct Outline<'a> {
    pub items: Vec<Item<'a>>,
    /// Item index by defined name; a name defined twice is one item.
    pub defined: HashMap<&'a str, usize>,
}

/// Reads the outline of `text`.
pub(super) fn outline(text: &str) -> Outline<'_> {
    let mut out = Outline::default();
    let mut s = Scanner { text, pos: 0 };
    let mut current: Option<usize> = None;
    let mut line_start = true;
    while let Some(tok) = s.next_token() {
        if tok == Tok::Newline {
            line_start = true;
            continue;
        }
        if std::mem::take(&mut line_start) && tok != Tok::Bar {
            current = None;
        }
        match tok {
            Tok::Name(name) if s.definition_follows() => {
                let next = out.items.len();
                let item = *out.defined.entry(name).or_insert(next);
                if item == next {
                    out.items.push(Item::default());
                }
                current = Some(item);
            }
            Tok::Name(name) => out.item(&mut current).refs.push(name),
            Tok::Json(schema) => out.item(&mut current).schemas.push(schema),
            Tok::Newline | Tok::Bar | Tok::Other => {}
        }
    }
    out
}

impl<'a> Outline<'a> {
    /// The item being read, or a new one for a statement.
    fn item(&mut self, current: &mut Option<usize>) -> &mut Item<'a> {
        let index = *current.get_or_insert_with(|| {
            self.items.push(Item::default());
            self.items.len() - 1
        });
        &mut self.items[index]
    }
}

#[derive(Debug, PartialEq)]
enum Tok<'a> {
    Name(&'a str),
    Newline,
    Bar,
    /// The value after `%json`.
    Json(Value),
    Other,
}

struct Scanner<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Scanner<'a> {
    /// The text from the current byte (empty if that is not a character boundary, which a
    /// backslash before a multi-byte character in a broken literal can cause).
    fn rest(&self) -> &'a str {
        self.text.get(self.pos..).unwrap_or("")
    }

    fn peek(&self, ahead: usize) -> Option<u8> {
        self.text.as_bytes().get(self.pos + ahead).copied()
    }

    /// Moves past bytes while `keep` holds.
    fn skip_while(&mut self, keep: impl Fn(u8) -> bool) {
        while self.peek(0).is_some_and(&keep) {
            self.pos += 1;
        }
    }

    /// The next token; `None` at the end, or where llguidance's lexer would fail too.
    fn next_token(&mut self) -> Option<Tok<'a>> {
        loop {
            let b = self.peek(0)?;
            match b {
                b' ' | b'\t' | b'\r' => self.pos += 1,
                b'#' => self.skip_while(|b| b != b'\n'),
                b'/' if self.peek(1) == Some(b'/') => self.skip_while(|b| b != b'\n'),
                b'\n' => {
                    self.pos += 1;
                    return Some(Tok::Newline);
                }
                b'|' => {
                    self.pos += 1;
                    return Some(Tok::Bar);
                }
                b'"' => {
                    self.skip_quoted(b'"');
                    if self.peek(0) == Some(b'i') {
                        self.pos += 1;
                    }
                    return Some(Tok::Other);
                }
                b'/' => {
                    self.skip_quoted(b'/');
                    self.skip_while(|b| b"imslux".contains(&b));
                    return Some(Tok::Other);
                }
                b'%' => return self.keyword(),
                b'<' => {
                    self.skip_special_token();
                    return Some(Tok::Other);
                }
                _ => {
                    if let Some(name) = self.name() {
                        return Some(Tok::Name(name));
                    }
                    let len = self.rest().chars().next().map_or(1, char::len_utf8);
                    self.pos += len;
                    return Some(Tok::Other);
                }
            }
        }
    }

    /// A rule name (`!?[_?]?[a-z][_a-z0-9-]*`) or a terminal's (`_?[A-Z][_A-Z0-9-]*`), as
    /// llguidance's lexer reads them (`aB` is two names), without the `!` and `?` flags, which
    /// are not part of the name; `None` if none starts here.
    fn name(&mut self) -> Option<&'a str> {
        let at = |i: usize| self.peek(i).unwrap_or(0);
        let rule = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-';
        let token = |b: u8| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_' || b == b'-';
        let bang = usize::from(at(0) == b'!');
        let flag = usize::from(at(bang) == b'?');
        let underscore = usize::from(at(bang + flag) == b'_');
        let first = at(bang + flag + underscore);
        let is_rule = first.is_ascii_lowercase();
        let is_token = first.is_ascii_uppercase() && bang + flag == 0;
        if !is_rule && !is_token {
            return None;
        }
        self.pos += bang + flag;
        let start = self.pos;
        self.pos += underscore + 1;
        self.skip_while(if is_rule { rule } else { token });
        self.text.get(start..self.pos)
    }

    /// Moves past `<...>` (a special token, `<[^<>\s]+>`) or, if none starts here, the `<`.
    fn skip_special_token(&mut self) {
        let after = self.rest().get(1..).unwrap_or_default();
        let body = after.find(|c: char| c == '<' || c == '>' || c.is_whitespace());
        match body {
            Some(n) if n > 0 && after[n..].starts_with('>') => self.pos += n + 2,
            _ => self.pos += 1,
        }
    }

    /// Moves past a literal opened by `close` at the current byte: to its closing byte (a
    /// backslash escapes the next byte) or the end of the line for a string.
    fn skip_quoted(&mut self, close: u8) {
        self.pos += 1;
        while let Some(b) = self.peek(0) {
            match b {
                b'\\' => self.pos += 2,
                b'\n' if close == b'"' => return,
                _ if b == close => {
                    self.pos += 1;
                    return;
                }
                _ => self.pos += 1,
            }
        }
        self.pos = self.pos.min(self.text.len());
    }

    /// A `%` keyword; `%json`, `%regex` and `%llguidance` take a JSON value.
    fn keyword(&mut self) -> Option<Tok<'a>> {
        let rest = self.rest();
        let with_value = ["%json", "%regex", "%llguidance"];
        let Some(kw) = with_value.iter().find(|kw| rest.starts_with(**kw)) else {
            self.pos += 1;
            self.skip_while(|b| b.is_ascii_alphanumeric() || b == b'_');
            return Some(Tok::Other);
        };
        self.pos += kw.len();
        let mut values = serde_json::Deserializer::from_str(self.rest()).into_iter::<Value>();
        // A value that does not parse fails llguidance's lexer too: nothing gets compiled.
        let value = values.next()?.ok()?;
        self.pos += values.byte_offset();
        Some(if *kw == "%json" {
            Tok::Json(value)
        } else {
            Tok::Other
        })
    }

    /// Whether the name just read is being defined: `name{params}.priority:` with the
    /// parameters and the priority optional (`::_` too, for parametric rules). Moves past the
    /// colon if so.
    fn definition_follows(&mut self) -> bool {
        let start = self.pos;
        let blank = |b: u8| b == b' ' || b == b'\t';
        self.skip_while(blank);
        if self.rest().starts_with("::") {
            self.pos += 2;
            self.skip_while(blank);
            if self.peek(0) == Some(b'_') {
                self.pos += 1;
            }
            self.skip_while(blank);
        }
        if self.peek(0) == Some(b'{') {
            self.skip_while(|b| b != b'}' && b != b'\n');
            if self.peek(0) == Some(b'}') {
                self.pos += 1;
            }
            self.skip_while(blank);
        }
        if self.peek(0) == Some(b'.') {
            self.pos += 1;
            self.skip_while(|b| blank(b) || b == b'-' || b == b'+' || b.is_ascii_digit());
        }
        if self.peek(0) == Some(b':') && self.peek(1) != Some(b':') {
            self.pos += 1;
            return true;
        }
        self.pos = start;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(name, refs)` of the defined items, sorted by name.
    fn defs(text: &str) -> Vec<(&str, Vec<&str>)> {
        let o = outline(text);
        let mut out: Vec<(&str, Vec<&str>)> = o
            .defined
            .iter()
            .map(|(&name, &i)| (name, o.items[i].refs.clone()))
            .collect();
        out.sort();
        out
    }

    #[test]
    fn rules_terminals_and_their_references_are_found() {
        let g = "start: greeting NAME\n?greeting.2: \"hi\" | hello\nhello: \"hello\"i\nNAME: /[a-z]+/\n";
        assert_eq!(
            defs(g),
            [
                ("NAME", vec![]),
                ("greeting", vec!["hello"]),
                ("hello", vec![]),
                ("start", vec!["greeting", "NAME"]),
            ]
        );
    }

    #[test]
    fn a_line_starting_with_a_bar_continues_the_rule() {
        let g = "a: b\n  | c\n\n  | d\nb: \"x\"\n";
        assert_eq!(defs(g)[0], ("a", vec!["b", "c", "d"]));
    }

    #[test]
    fn names_inside_strings_regexes_and_comments_are_not_references() {
        let g = "a: \"b: c\" /d|e\\/f/ // g h\n# i: j\nb: \"\\\"k\"\n";
        assert_eq!(defs(g), [("a", vec![]), ("b", vec![])]);
    }

    #[test]
    fn json_values_are_skipped_and_schemas_kept() {
        let g = "start: %json {\"properties\": {\"x: y\": {}}} tail\n%llguidance {\"a\": 1}\ntail: \"t\"\n";
        let o = outline(g);
        let start = &o.items[o.defined["start"]];
        assert_eq!(start.refs, ["tail"]);
        assert_eq!(start.schemas.len(), 1);
        assert_eq!(o.defined.len(), 2);
    }

    #[test]
    fn statements_are_items_of_their_own() {
        let o = outline("start: WS\n%ignore WS\nWS: \" \"\n");
        assert_eq!((o.items.len(), o.defined.len()), (3, 2));
        let ignore = (0..3).find(|i| !o.defined.values().any(|d| d == i));
        assert_eq!(ignore.map(|i| o.items[i].refs.clone()), Some(vec!["WS"]));
    }

    #[test]
    fn templates_and_parametric_rules_are_definitions() {
        let g = "_sep{x, s}: x (s x)*\nr::_: \"a\"\nstart: _sep{r, \",\"}\n";
        let names: Vec<&str> = defs(g).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["_sep", "r", "start"]);
    }

    #[test]
    fn names_are_read_as_llguidance_reads_them() {
        // `aB` is the rule `a` then the terminal `B`; flags are not part of a name; what
        // follows a special token is not a comment.
        let g = "x: aB <#y> c_D !e ?f\n";
        assert_eq!(defs(g), [("x", vec!["a", "B", "c_", "D", "e", "f"])]);
    }

    #[test]
    fn broken_input_ends_the_scan_without_panicking() {
        for g in [
            "a: \"unterminated",
            "a: /unterminated",
            "a: %json {",
            "a: \\",
            "é: ü\n",
            "a: \"\\é",
            "a: /\\é",
            "a: <",
            "a: <é",
            "!",
            "_",
        ] {
            let _ = outline(g);
        }
    }
}
