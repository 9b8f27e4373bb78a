//! What each token id stands for as raw bytes, for constrained decoding (a grammar matches bytes,
//! the vocabulary stores text in an encoding of its own):
//!
//! - byte-level BPE (the `ByteLevel` decoder; GGUF `gpt2`): every char of a token is one byte
//!   through GPT-2's byte ↔ char table (`Ġ` is a space, `Ċ` a newline);
//! - SentencePiece (GGUF `llama`): `▁` is a space and `<0xNN>` the byte 0xNN (byte fallback);
//! - control tokens (see [`Tokenizer::is_special`]) are not text at all.

use tokenizers::decoders::DecoderWrapper;

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
fn byte_level_table() -> Vec<Option<u8>> {
    let mut table = vec![None; 0x100 + 68];
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

/// The bytes of a byte-level token; a char outside the table (an added token written as plain
/// text) stands for its own UTF-8.
fn byte_level(text: &str, table: &[Option<u8>], out: &mut Vec<u8>) {
    for c in text.chars() {
        match table.get(c as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
}

/// The bytes of a SentencePiece token: `<0xNN>` is one byte, `▁` a space.
fn sentencepiece(text: &str, out: &mut Vec<u8>) {
    let hex = text
        .strip_prefix("<0x")
        .and_then(|t| t.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        .and_then(|h| u8::from_str_radix(h, 16).ok());
    match hex {
        Some(b) => out.push(b),
        None => out.extend_from_slice(text.replace('\u{2581}', " ").as_bytes()),
    }
}

impl Tokenizer {
    /// Every id's bytes, indexed by id ([`Tokenizer::vocab_size`] entries). Computed anew on each
    /// call (a walk over the vocabulary): build what needs it once per model.
    pub fn token_bytes(&self) -> Vec<TokenBytes> {
        let byte_level = matches!(self.inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let table = byte_level_table();
        (0..self.vocab_size as u32)
            .map(|id| {
                let Some(text) = self.inner.id_to_token(id) else {
                    return TokenBytes::Unknown;
                };
                if self.is_special(id) {
                    return TokenBytes::Control(text);
                }
                let mut bytes = Vec::with_capacity(text.len());
                if byte_level {
                    self::byte_level(&text, &table, &mut bytes);
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
        byte_level("Ġthe\u{10a}", &table, &mut out);
        assert_eq!(out, b" the\n");
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
