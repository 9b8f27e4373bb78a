//! Sentence and phrase marks for speech (the `sentences` option): text-to-speech engines want
//! whole sentences, and every app would otherwise write its own splitter. A piece ends after
//! `.`, `!`, `?`, `;`, `:` or `…` (and any closing quotes or brackets) once whitespace follows, and
//! at every newline; `3.14` or `e.g.x` do not end one. Pieces are trimmed, and empty ones are
//! not sent.

/// Characters that end a sentence or a phrase when whitespace follows.
const ENDS: [char; 6] = ['.', '!', '?', ';', ':', '…'];
/// Characters that may close a sentence after its end mark: `."` or `!)`.
const CLOSERS: [char; 5] = ['"', '\'', ')', ']', '\u{201d}'];

/// Text since the last mark.
#[derive(Debug, Default)]
pub struct Sentences {
    text: String,
}

impl Sentences {
    /// Adds a token's text; returns the pieces it completed.
    pub fn push(&mut self, token: &str) -> Vec<String> {
        self.text.push_str(token);
        let mut pieces = Vec::new();
        while let Some(end) = self.boundary() {
            let rest = self.text.split_off(end);
            let piece = std::mem::replace(&mut self.text, rest);
            push_trimmed(&mut pieces, &piece);
        }
        pieces
    }

    /// The piece left when the generation ends, if it holds more than whitespace.
    pub fn finish(&mut self) -> Option<String> {
        let mut pieces = Vec::new();
        push_trimmed(&mut pieces, &std::mem::take(&mut self.text));
        pieces.pop()
    }

    /// The byte offset just past the first mark whose end is known, if there is one.
    fn boundary(&self) -> Option<usize> {
        let chars: Vec<(usize, char)> = self.text.char_indices().collect();
        for (i, &(at, c)) in chars.iter().enumerate() {
            if c == '\n' {
                return Some(at + 1);
            }
            if !ENDS.contains(&c) {
                continue;
            }
            let mut j = i + 1;
            while j < chars.len() && (CLOSERS.contains(&chars[j].1) || ENDS.contains(&chars[j].1)) {
                j += 1;
            }
            match chars.get(j) {
                Some(&(next, c)) if c.is_whitespace() => return Some(next),
                // Not known yet: the next token decides.
                None => return None,
                Some(_) => {}
            }
        }
        None
    }
}

fn push_trimmed(pieces: &mut Vec<String>, piece: &str) {
    let piece = piece.trim();
    if !piece.is_empty() {
        pieces.push(piece.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every piece of `tokens` pushed one by one, and the rest at the end.
    fn split(tokens: &[&str]) -> Vec<String> {
        let mut s = Sentences::default();
        let mut pieces: Vec<String> = tokens.iter().flat_map(|t| s.push(t)).collect();
        pieces.extend(s.finish());
        pieces
    }

    #[test]
    fn sentences_and_phrases_end_at_marks_followed_by_whitespace() {
        let tokens = [
            "Hello", " there", ".", " Pi is", " 3", ".", "14; ", "isn't it", "?\"", " Yes",
        ];
        assert_eq!(
            split(&tokens),
            ["Hello there.", "Pi is 3.14;", "isn't it?\"", "Yes"]
        );
    }

    #[test]
    fn a_mark_is_sent_as_soon_as_the_token_after_it_shows_whitespace() {
        let mut s = Sentences::default();
        assert!(s.push("Stop.").is_empty(), "the next token may be a digit");
        assert_eq!(s.push(" Go"), ["Stop."]);
        assert_eq!(s.push("!\nNow"), ["Go!"]);
        assert_eq!(s.finish().as_deref(), Some("Now"));
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn newlines_end_pieces_and_blank_pieces_are_not_sent() {
        assert_eq!(
            split(&["a list\n", "\n", "- one\n- two", "\n  "]),
            ["a list", "- one", "- two"]
        );
        assert_eq!(split(&["  ", "\n"]), Vec::<String>::new());
        assert_eq!(split(&["Ünïcode… ", "fine"]), ["Ünïcode…", "fine"]);
    }
}
