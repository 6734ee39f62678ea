//! A batch's token ids as a network's dense operations read them: rows of
//! S + 1 ids ([`TokenRows`]), from which the inputs and their next-token
//! targets come ([`TokenIds`]), on the host and, where the operations keep
//! activations on a device, there as well: a GPU takes the rows up once
//! and splits them itself, so neither the inputs nor the targets cross
//! PCIe apart.

use crate::math::IGNORED_TARGET;

/// B rows of S + 1 token ids: position i of a row is the input whose
/// next-token target is position i + 1.
#[derive(Clone, Copy, Debug)]
pub struct TokenRows<'a> {
    /// (B, S + 1) token ids.
    pub tokens: &'a [u32],
    pub seq_len: usize,
    /// (B, S + 1): whether each token, as the target of the one before
    /// it, carries loss. `None`: every target does.
    pub loss_mask: Option<&'a [bool]>,
}

impl TokenRows<'_> {
    /// The rows' T = B·S inputs, and their targets with [`IGNORED_TARGET`]
    /// where the mask says no loss.
    pub fn inputs_targets(&self) -> (Vec<u32>, Vec<u32>) {
        let s = self.seq_len;
        let rows = self.tokens.len() / (s + 1);
        let mut inputs = Vec::with_capacity(rows * s);
        let mut targets = Vec::with_capacity(rows * s);
        for (r, row) in self.tokens.chunks_exact(s + 1).enumerate() {
            inputs.extend_from_slice(&row[..s]);
            match self.loss_mask {
                None => targets.extend_from_slice(&row[1..]),
                Some(mask) => {
                    let counts = &mask[r * (s + 1) + 1..(r + 1) * (s + 1)];
                    targets.extend(row[1..].iter().zip(counts).map(|(&t, &c)| match c {
                        true => t,
                        false => IGNORED_TARGET,
                    }));
                }
            }
        }
        (inputs, targets)
    }

    /// The loss mask as bits, position p of the rows at bit p % 32 of word
    /// p / 32 (a 32nd of the ids' bytes, for a device to apply itself);
    /// `None` without a mask.
    pub fn mask_words(&self) -> Option<Vec<u32>> {
        let mask = self.loss_mask?;
        let mut words = vec![0u32; mask.len().div_ceil(32)];
        for (p, _) in mask.iter().enumerate().filter(|(_, &m)| m) {
            words[p / 32] |= 1 << (p % 32);
        }
        Some(words)
    }
}

/// A batch's inputs and targets on the host ([`TokenRows::inputs_targets`]),
/// and `device`, the same where the dense operations keep them: a GPU's
/// copies, `()` for operations on the host.
pub struct TokenIds<D> {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub device: D,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_split_into_inputs_and_next_token_targets() {
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        let mut mask = [true; 8];
        mask[2] = false; // row 0's second target
        mask[4] = false; // row 1's first token: no target, so no effect
        let rows = TokenRows {
            tokens: &tokens,
            seq_len: 3,
            loss_mask: None,
        };
        assert_eq!(
            rows.inputs_targets(),
            (vec![1, 2, 3, 5, 6, 7], vec![2, 3, 4, 6, 7, 8])
        );
        assert_eq!(rows.mask_words(), None);
        let masked = TokenRows {
            loss_mask: Some(&mask),
            ..rows
        };
        let (_, targets) = masked.inputs_targets();
        assert_eq!(targets, vec![2, IGNORED_TARGET, 4, 6, 7, 8]);
        assert_eq!(masked.mask_words(), Some(vec![0b1110_1011]));
    }

    #[test]
    fn mask_words_cover_every_position() {
        let mask: Vec<bool> = (0..70).map(|p| p % 3 == 0).collect();
        let rows = TokenRows {
            tokens: &[0; 70],
            seq_len: 6,
            loss_mask: Some(&mask),
        };
        let words = rows.mask_words().unwrap();
        assert_eq!(words.len(), 3);
        for (p, &m) in mask.iter().enumerate() {
            assert_eq!(words[p / 32] >> (p % 32) & 1 == 1, m, "position {p}");
        }
    }
}
