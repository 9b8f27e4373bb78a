//! What each token id stands for as raw bytes, for constrained decoding (a grammar matches bytes,
//! the vocabulary stores text in an encoding of its own):
//!
//! - byte-level BPE (the `ByteLevel` decoder; GGUF `gpt2`): every char of a token is one byte
//!   through GPT-2's byte ↔ char table (`Ġ` is a space, `Ċ` a newline);
//! - SentencePiece (GGUF `llama`): `▁` is a space and `<0xNN>` the byte 0xNN (byte fallback);
//! - control tokens (see [`Tokenizer::is_special`]) are not text at all.

use super::Tokenizer;

/// One id of the vocabulary, as [`Tokenizer::token_bytes`] describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenBytes {
    /// A text token: the bytes it appends to the output.
    Text(Vec<u8>),
    /// A control token (`<|im_end|>`, `<end_of_turn>`, bos/eos): its name, not text.
    Control(String),
    /// An id the tokenizer does not know (a hole in the id range).
    Unknown,
}

/// Whether GPT-2's byte ↔ char table prints byte `b` as itself.
pub(super) fn printable(b: u8) -> bool {
    (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE
}

/// GPT-2's char → byte table: a printable byte is its own char; the n-th non-printable byte is
/// char U+0100 + n. Indexed by the char's code point (0..0x144).
fn byte_level_table() -> [Option<u8>; 0x144] {
    let mut table = [None; 0x144];
    let mut n = 0;
    for b in 0..=255u8 {
        if printable(b) {
            table[usize::from(b)] = Some(b);
        } else {
            table[0x100 + n] = Some(b);
            n += 1;
        }
    }
    table
}

/// The bytes of a byte-level token: each char through GPT-2's table, or, when a char is outside
/// it (an added token written as plain text), the token's own UTF-8 (the `ByteLevel` decoder's
/// rule).
pub(super) fn byte_level_token(text: &str, out: &mut Vec<u8>) {
    static TABLE: std::sync::LazyLock<[Option<u8>; 0x144]> =
        std::sync::LazyLock::new(byte_level_table);
    let start = out.len();
    for c in text.chars() {
        match TABLE.get(c as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => {
                out.truncate(start);
                out.extend_from_slice(text.as_bytes());
                return;
            }
        }
    }
}

/// The byte of a SentencePiece byte-fallback token `<0xNN>`, if `text` is one.
pub(super) fn byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// The bytes of a SentencePiece token: `<0xNN>` is one byte, `▁` a space.
fn sentencepiece(text: &str, out: &mut Vec<u8>) {
    match byte_token(text) {
        Some(b) => out.push(b),
        None => out.extend_from_slice(text.replace('\u{2581}', " ").as_bytes()),
    }
}

impl Tokenizer {
    /// Every id's bytes, indexed by id ([`Tokenizer::vocab_size`] entries). Computed anew on each
    /// call (a walk over the vocabulary): build what needs it once per model.
    pub fn token_bytes(&self) -> Vec<TokenBytes> {
        let byte_level = self.is_byte_level();
        (0..self.vocab_size as u32)
            .map(|id| {
                let Some(text) = self.id_to_token(id) else {
                    return TokenBytes::Unknown;
                };
                if self.is_special(id) {
                    return TokenBytes::Control(text);
                }
                let mut bytes = Vec::with_capacity(text.len());
                if byte_level {
                    byte_level_token(&text, &mut bytes);
                } else {
                    sentencepiece(&text, &mut bytes);
                }
                TokenBytes::Text(bytes)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_table_inverts_gpt2s_map() {
        let table = byte_level_table();
        let mut seen = [false; 256];
        for b in table.iter().flatten() {
            assert!(!seen[usize::from(*b)], "byte {b} appears twice");
            seen[usize::from(*b)] = true;
        }
        assert!(seen.iter().all(|&s| s), "every byte has a char");
        let mut out = Vec::new();
        byte_level_token("Ġthe\u{10a}", &mut out);
        assert_eq!(out, b" the\n");
        // A char outside the table: the whole token is its own UTF-8.
        byte_level_token("é\u{2581}", &mut out);
        assert_eq!(out, " the\né\u{2581}".as_bytes());
    }

    #[test]
    fn sentencepiece_spaces_and_byte_fallback_become_bytes() {
        let mut out = Vec::new();
        sentencepiece("\u{2581}cup", &mut out);
        sentencepiece("<0x0A>", &mut out);
        sentencepiece("<0xZZ>", &mut out);
        assert_eq!(out, b" cup\n<0xZZ>");
    }
}
