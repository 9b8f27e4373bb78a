//! Added tokens found in text: the control tokens a prompt spells out (`<|im_end|>`), and the
//! user-defined ones. One pass of [`super::bpe`]'s steps 1 and 2, and the control-token finder
//! for chat prompts ([`super::Tokenizer::control_spans`]).

use std::collections::HashMap;
use std::ops::Range;

/// Added tokens of one pass: their match texts, looked up by length, longest first.
pub(super) struct AddedSet {
    by_text: HashMap<Box<str>, u32>,
    /// Distinct lengths of the texts in bytes, longest first.
    lengths: Vec<usize>,
}

impl AddedSet {
    pub(super) fn new(entries: impl Iterator<Item = (String, u32)>) -> AddedSet {
        let mut by_text = HashMap::new();
        // An empty text would match everywhere without moving on.
        for (text, id) in entries.filter(|(text, _)| !text.is_empty()) {
            // Two tokens with one match text: the later one wins, as in the crate's automaton.
            by_text.insert(text.into_boxed_str(), id);
        }
        let mut lengths: Vec<usize> = by_text.keys().map(|t| t.len()).collect();
        lengths.sort_unstable_by(|a, b| b.cmp(a));
        lengths.dedup();
        by_text.shrink_to_fit();
        lengths.shrink_to_fit();
        AddedSet { by_text, lengths }
    }

    pub(super) fn heap_bytes(&self) -> u64 {
        // Each entry: its boxed text (a malloc block), the key and value, a control byte.
        let entries: usize = self
            .by_text
            .keys()
            .map(|t| super::Tokenizer::malloc_block(t.len()))
            .sum();
        // hashbrown holds a power of two of buckets, 8/7 of its capacity, plus a group of control
        // bytes.
        let buckets = (self.by_text.capacity() * 8 / 7).next_power_of_two() + 16;
        (entries + buckets * 25 + self.lengths.capacity() * 8) as u64
    }

    /// Splits `text` into pieces: `(None, piece)` for plain text, `(Some(id), _)` for an added
    /// token, leftmost-longest matches first. A match that would overlap a byte range of
    /// `plain` (sorted, not overlapping) is not taken: text there is plain whatever it spells.
    /// Appends to `out`.
    pub(super) fn split<'a>(
        &self,
        text: &'a str,
        plain: &[Range<usize>],
        out: &mut Vec<(Option<u32>, &'a str)>,
    ) {
        if self.by_text.is_empty() {
            out.push((None, text));
            return;
        }
        let mut from = 0;
        for (span, id) in self.matches(text, plain) {
            if from < span.start {
                out.push((None, &text[from..span.start]));
            }
            out.push((Some(id), &text[span.clone()]));
            from = span.end;
        }
        if from < text.len() {
            out.push((None, &text[from..]));
        }
    }

    /// Byte ranges of the added tokens [`AddedSet::split`] cuts out of `text`.
    pub(super) fn spans(&self, text: &str) -> Vec<Range<usize>> {
        self.matches(text, &[])
            .into_iter()
            .map(|(s, _)| s)
            .collect()
    }

    /// The leftmost-longest matches in `text` that overlap no range of `plain`.
    fn matches(&self, text: &str, plain: &[Range<usize>]) -> Vec<(Range<usize>, u32)> {
        let mut out = Vec::new();
        if self.by_text.is_empty() {
            return out;
        }
        let mut at = 0;
        while at < text.len() {
            let hit = self.lengths.iter().find_map(|&n| {
                let span = at..at + n;
                let id = *self.by_text.get(text.get(span.clone())?)?;
                (!overlaps(plain, &span)).then_some((span, id))
            });
            match hit {
                Some((span, id)) => {
                    at = span.end;
                    out.push((span, id));
                }
                None => at += text[at..].chars().next().map_or(1, char::len_utf8),
            }
        }
        out
    }
}

/// Whether `span` overlaps a range of `ranges` (sorted, not overlapping).
fn overlaps(ranges: &[Range<usize>], span: &Range<usize>) -> bool {
    let first_after = ranges.partition_point(|r| r.end <= span.start);
    ranges
        .get(first_after)
        .is_some_and(|r| r.start < span.end && span.start < span.end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> AddedSet {
        let tokens = [("<a>", 1), ("<a><b>", 2), ("<b>", 3)];
        AddedSet::new(tokens.into_iter().map(|(t, id)| (t.to_string(), id)))
    }

    #[test]
    fn matches_are_leftmost_longest() {
        let mut out = Vec::new();
        set().split("x<a><b><b>y", &[], &mut out);
        assert_eq!(
            out,
            [
                (None, "x"),
                (Some(2), "<a><b>"),
                (Some(3), "<b>"),
                (None, "y")
            ]
        );
        assert_eq!(set().spans("x<a><b><b>y"), [1..7, 7..10]);
    }

    #[test]
    fn no_match_overlaps_a_plain_range_and_a_shorter_one_may_be_taken() {
        let mut out = Vec::new();
        // `<b>` at 3..6 is plain: the longer `<a><b>` would overlap it, `<a>` does not.
        set().split("<a><b><b>", std::slice::from_ref(&(3..6)), &mut out);
        assert_eq!(out, [(Some(1), "<a>"), (None, "<b>"), (Some(3), "<b>")]);
        out.clear();
        set().split("<a>", std::slice::from_ref(&(0..1)), &mut out);
        assert_eq!(out, [(None, "<a>")]);
    }

    #[test]
    fn an_empty_set_matches_nothing_and_keeps_the_text_whole() {
        let empty = AddedSet::new([(String::new(), 9)].into_iter());
        assert!(empty.spans("<a>").is_empty());
        let mut out = Vec::new();
        empty.split("", &[], &mut out);
        assert_eq!(out, [(None, "")]);
        out.clear();
        set().split("", &[], &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn overlap_is_half_open() {
        assert!(!overlaps(&[0..3, 6..9], &(3..6)));
        assert!(overlaps(&[0..3, 6..9], &(2..4)));
        assert!(overlaps(&[0..3, 6..9], &(5..7)));
        assert!(!overlaps(&[], &(0..1)));
    }
}
