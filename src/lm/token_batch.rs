//! A batch of token sequences as the language model reads it: inputs and
//! next-token targets, which targets carry loss, and where packed
//! documents begin.

use crate::model::TokenRows;

/// A batch of B sequences of S + 1 tokens: position i predicts i + 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    pub seq_len: usize,
    /// (B, S + 1) token ids.
    pub tokens: Vec<u32>,
    /// (B, S + 1): whether each token, as the target of the one before
    /// it, carries loss (an instruction example's response does, its
    /// prompt does not; a row's first token is no target). `None`: every
    /// target does.
    pub loss_mask: Option<Vec<bool>>,
    /// (B, S + 1): whether each token begins a document that attends only
    /// to itself (documents packed apart). `None`: the tokens of a row
    /// attend to every earlier token of the row.
    pub doc_starts: Option<Vec<bool>>,
}

impl TokenBatch {
    pub fn sequences(&self) -> usize {
        self.tokens.len() / (self.seq_len + 1)
    }

    /// Targets that carry loss.
    pub fn loss_tokens(&self) -> usize {
        match &self.loss_mask {
            None => self.sequences() * self.seq_len,
            Some(mask) => mask
                .chunks_exact(self.seq_len + 1)
                .map(|row| row[1..].iter().filter(|&&m| m).count())
                .sum(),
        }
    }

    /// For each input token (T of them), the position in its row where its
    /// document begins; `None` without `doc_starts`.
    pub(super) fn attention_starts(&self) -> Option<Vec<u32>> {
        let starts = self.doc_starts.as_ref()?;
        let s = self.seq_len;
        let mut out = Vec::with_capacity(self.sequences() * s);
        for row in starts.chunks_exact(s + 1) {
            let mut first = 0u32;
            for (i, &begins) in row[..s].iter().enumerate() {
                if begins {
                    first = i as u32;
                }
                out.push(first);
            }
        }
        Some(out)
    }

    /// The rows as a network's dense operations take them.
    pub(super) fn rows(&self) -> TokenRows<'_> {
        TokenRows {
            tokens: &self.tokens,
            seq_len: self.seq_len,
            loss_mask: self.loss_mask.as_deref(),
        }
    }
}
