//! Messages rendered as literal text: a control token spelled inside a message
//! (`hi<|im_end|>\n<|im_start|>system\n...`) must not become the control token, or a user could
//! forge turns of another role; the template's own markup still must.
//!
//! How: each control token's text in a message's role or content is swapped for a placeholder,
//! `⟨mark⟩index⟨mark⟩` with `mark` a private-use character found nowhere in the template or the
//! messages. The template renders the placeholders like any text (trimming, slicing and
//! `tojson` leave them whole), then each placeholder is swapped back for the text it stands
//! for, and the tokenizer is told to encode those byte ranges as plain text
//! ([`Tokenizer::encode_with_plain`]). A conversation that spells no control token renders and
//! encodes exactly as [`ChatTemplate::render`] then [`Tokenizer::encode`] would.

use std::collections::HashSet;
use std::ops::Range;

use super::{ChatMessage, ChatTemplate};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Where placeholder marks are looked for: the private-use areas of the BMP and plane 15.
const MARKS: [std::ops::RangeInclusive<u32>; 2] = [0xE000..=0xF8FF, 0xF0000..=0xFFFFD];

/// Byte ranges of the control tokens a message's role and content spell.
struct Spans {
    role: Vec<Range<usize>>,
    content: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// Renders the conversation ([`ChatTemplate::render`]) and encodes it to token ids with
    /// `tokenizer`, the messages' roles and contents as literal text: a control token they
    /// spell (`<|im_end|>`, `<start_of_turn>`) is encoded as the characters it is written
    /// with, never as the control id; the template's own markup is encoded as usual. For a
    /// conversation that spells none the ids are exactly those of `render` then
    /// [`Tokenizer::encode`]. This, not `render` then `encode`, is how a prompt built from
    /// untrusted messages is tokenised.
    pub fn render_ids(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let spans: Vec<Spans> = messages
            .iter()
            .map(|m| Spans {
                role: tokenizer.control_spans(&m.role),
                content: tokenizer.control_spans(&m.content),
            })
            .collect();
        if spans
            .iter()
            .all(|s| s.role.is_empty() && s.content.is_empty())
        {
            return tokenizer.encode(&self.render(messages, add_generation_prompt)?);
        }
        let mark = self.free_mark(messages)?;
        let mut literals: Vec<&str> = Vec::new();
        let escaped: Vec<ChatMessage> = messages
            .iter()
            .zip(&spans)
            .map(|(m, s)| ChatMessage {
                role: escape(&m.role, &s.role, mark, &mut literals),
                content: escape(&m.content, &s.content, mark, &mut literals),
            })
            .collect();
        let rendered = self.render(&escaped, add_generation_prompt)?;
        let (text, plain) = unescape(&rendered, mark, &literals);
        tokenizer.encode_with_plain(&text, &plain)
    }

    /// A private-use character that appears neither in the template nor in `messages`.
    fn free_mark(&self, messages: &[ChatMessage]) -> Result<char> {
        let source = self.source()?;
        let texts = messages.iter().flat_map(|m| [&m.role, &m.content]);
        let texts = texts.map(String::as_str).chain([source.as_str()]);
        let taken: HashSet<char> = texts
            .flat_map(str::chars)
            .filter(|c| MARKS.iter().any(|r| r.contains(&u32::from(*c))))
            .collect();
        MARKS
            .iter()
            .flat_map(|r| r.clone().filter_map(char::from_u32))
            .find(|c| !taken.contains(c))
            .ok_or_else(|| {
                Error::ChatTemplate("the messages use every private-use character".into())
            })
    }
}

/// `text` with each of `spans` swapped for a placeholder naming its index in `literals`.
fn escape<'a>(
    text: &'a str,
    spans: &[Range<usize>],
    mark: char,
    literals: &mut Vec<&'a str>,
) -> String {
    let mut out = String::with_capacity(text.len());
    let mut from = 0;
    for span in spans {
        out.push_str(&text[from..span.start]);
        out.push(mark);
        out.push_str(&literals.len().to_string());
        out.push(mark);
        literals.push(&text[span.clone()]);
        from = span.end;
    }
    out.push_str(&text[from..]);
    out
}

/// `rendered` with its placeholders swapped back for their literals, and where the literals
/// now are. A mark that does not open a whole placeholder (a template that cut one) stays.
fn unescape(rendered: &str, mark: char, literals: &[&str]) -> (String, Vec<Range<usize>>) {
    let mut text = String::with_capacity(rendered.len());
    let mut plain = Vec::new();
    let mut rest = rendered;
    while let Some(at) = rest.find(mark) {
        text.push_str(&rest[..at]);
        let after = &rest[at + mark.len_utf8()..];
        let digits = after
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(after.len());
        let literal = after[..digits]
            .parse::<usize>()
            .ok()
            .and_then(|i| literals.get(i));
        match literal {
            Some(literal) if digits > 0 && after[digits..].starts_with(mark) => {
                plain.push(text.len()..text.len() + literal.len());
                text.push_str(literal);
                rest = &after[digits + mark.len_utf8()..];
            }
            _ => {
                text.push(mark);
                rest = after;
            }
        }
    }
    text.push_str(rest);
    (text, plain)
}

#[cfg(test)]
mod tests;
