//! Incremental decoding for the generation loop.

use super::Tokenizer;
use crate::Result;

/// Most ids held back waiting for a character to complete. A UTF-8 character is at most 4 bytes
/// and every id carries at least one byte, so 4 suffice for real text; past this the pending
/// ids are flushed lossily (U+FFFD) so that a model emitting invalid bytes cannot grow the
/// window.
const MAX_PENDING: usize = 8;

/// Turns a stream of ids into text, one id at a time. It does not hold the tokenizer (each call
/// takes it), so it can live in a scheduler's table next to the model it decodes for.
///
/// It keeps a small window: the ids of the last emitted piece (their context, so that decoders
/// that depend on neighbours — SentencePiece's leading space — give the same text as decoding
/// everything at once) and the ids not yet emitted. Text is emitted only when it does not end in
/// an incomplete UTF-8 sequence, so a multi-byte character split across ids comes out whole.
/// The concatenation of everything returned by [`TextStream::push`] and
/// [`TextStream::finish`] equals [`Tokenizer::decode`] of all the ids (for valid UTF-8 output).
/// Special tokens are included, as in [`Tokenizer::decode`].
#[derive(Debug, Default)]
pub struct TextStream {
    /// Context ids (`..context`) then pending ids (`context..`); at most 2 × MAX_PENDING long.
    ids: Vec<u32>,
    /// Number of context ids at the start of `ids`.
    context: usize,
    /// `decode(ids[..context])`.
    prefix: String,
}

impl TextStream {
    /// Adds one id; returns the text it completes, if any. An id outside the vocabulary is an
    /// error and leaves the stream as it was. Every call of one stream must pass the same
    /// tokenizer.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        if id as usize >= tok.vocab_size() {
            // Let `decode` produce the error message.
            tok.decode(&[id])?;
        }
        self.ids.push(id);
        let text = match tok.decode(&self.ids) {
            Ok(t) => t,
            Err(e) => {
                self.ids.pop();
                return Err(e);
            }
        };
        let pending = self.ids.len() - self.context;
        let complete = !text.ends_with('\u{FFFD}');
        if text.len() > self.prefix.len() && complete || pending >= MAX_PENDING {
            let new = self.take_new(tok, text)?;
            Ok(if new.is_empty() { None } else { Some(new) })
        } else {
            Ok(None)
        }
    }

    /// Flushes whatever is pending (incomplete characters come out as U+FFFD) and resets the
    /// stream for reuse.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        let new = if self.ids.len() > self.context {
            let text = tok.decode(&self.ids)?;
            self.take_new(tok, text)?
        } else {
            String::new()
        };
        self.ids.clear();
        self.context = 0;
        self.prefix.clear();
        Ok(if new.is_empty() { None } else { Some(new) })
    }

    /// Ids held in the window (context and pending).
    #[cfg(test)]
    pub(super) fn window_len(&self) -> usize {
        self.ids.len()
    }

    /// Returns the part of `text` (the decoding of the whole window) after the context, and makes
    /// the pending ids the new context.
    fn take_new(&mut self, tok: &Tokenizer, text: String) -> Result<String> {
        let new = match text.strip_prefix(self.prefix.as_str()) {
            Some(rest) => rest.to_string(),
            // A decoder whose output for a longer window does not extend the shorter one: fall
            // back to decoding the pending ids on their own.
            None => tok.decode(&self.ids[self.context..])?,
        };
        self.ids.drain(..self.context);
        self.context = self.ids.len();
        self.prefix = tok.decode(&self.ids)?;
        Ok(new)
    }
}
