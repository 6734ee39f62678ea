//! The access schedule: the order in which compute will ask for experts,
//! repeated every training step (forward layers 0..L-1, backward L-1..0).
//! It tells the prefetcher what to load next and the eviction policy how
//! far in the future each resident expert is needed.

use std::collections::HashMap;

use crate::record::Parts;
use crate::ExpertId;

/// A cyclic list of accesses and a cursor at the next expected one.
#[derive(Debug, Default)]
pub struct Schedule {
    order: Vec<(ExpertId, Parts)>,
    /// Positions of each expert in `order`, ascending.
    positions: HashMap<ExpertId, Vec<usize>>,
    cursor: usize,
}

impl Schedule {
    pub fn new(order: Vec<(ExpertId, Parts)>) -> Self {
        let mut positions: HashMap<ExpertId, Vec<usize>> = HashMap::new();
        for (i, (e, _)) in order.iter().enumerate() {
            positions.entry(*e).or_default().push(i);
        }
        Self {
            order,
            positions,
            cursor: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// The access `ahead` places after the cursor (wrapping), if any.
    pub fn upcoming(&self, ahead: usize) -> Option<(ExpertId, Parts)> {
        if self.order.is_empty() {
            return None;
        }
        Some(self.order[(self.cursor + ahead) % self.order.len()])
    }

    /// Accesses from the cursor until `expert` is next used: 0 if it is the
    /// next access, `None` if the schedule never uses it.
    pub fn distance(&self, expert: ExpertId) -> Option<usize> {
        let positions = self.positions.get(&expert)?;
        let len = self.order.len();
        let i = positions.partition_point(|&p| p < self.cursor);
        Some(match positions.get(i) {
            Some(&p) => p - self.cursor,
            None => positions[0] + len - self.cursor,
        })
    }

    /// Accesses from the cursor until `expert`'s full record is next asked
    /// for (`Full` or `State`), if the schedule ever does.
    pub fn full_distance(&self, expert: ExpertId) -> Option<usize> {
        let positions = self.positions.get(&expert)?;
        let len = self.order.len();
        let i = positions.partition_point(|&p| p < self.cursor);
        positions[i..]
            .iter()
            .chain(&positions[..i])
            .find(|&&p| self.order[p].1 != Parts::Compute)
            .map(|&p| (p + len - self.cursor) % len)
    }

    /// Records that `expert` was just accessed: if it is one of the next
    /// `window` scheduled accesses, the cursor moves past it. An access
    /// the schedule did not foresee leaves the cursor where it is.
    pub fn advance(&mut self, expert: ExpertId, window: usize) {
        if self.order.is_empty() {
            return;
        }
        for ahead in 0..window.min(self.order.len()) {
            let at = (self.cursor + ahead) % self.order.len();
            if self.order[at].0 == expert {
                self.cursor = (at + 1) % self.order.len();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(i: u32) -> ExpertId {
        ExpertId::new(0, i)
    }

    #[test]
    fn distance_wraps_around_the_step() {
        // forward 0 1 2, backward 2 1 0
        let order = [0, 1, 2, 2, 1, 0].map(|i| (e(i), Parts::Compute)).to_vec();
        let mut s = Schedule::new(order);
        assert_eq!(s.distance(e(0)), Some(0));
        assert_eq!(s.distance(e(2)), Some(2));
        s.advance(e(0), 4);
        s.advance(e(1), 4);
        assert_eq!(s.distance(e(0)), Some(3));
        assert_eq!(s.distance(e(1)), Some(2));
        assert_eq!(s.distance(e(9)), None);
        assert_eq!(s.full_distance(e(0)), None);
        // An unforeseen access does not move the cursor.
        s.advance(e(7), 4);
        assert_eq!(s.upcoming(0), Some((e(2), Parts::Compute)));
        for x in [2, 2, 1, 0] {
            s.advance(e(x), 4);
        }
        assert_eq!(s.upcoming(0), Some((e(0), Parts::Compute)));
    }

    #[test]
    fn full_distance_finds_the_next_full_access_past_compute_reads() {
        // forward 0 1, backward 1 (full) 0 (compute, then full)
        let (c, f) = (Parts::Compute, Parts::Full);
        let order = vec![(e(0), c), (e(1), c), (e(1), f), (e(0), c), (e(0), f)];
        let mut s = Schedule::new(order);
        assert_eq!(s.full_distance(e(0)), Some(4));
        assert_eq!(s.full_distance(e(1)), Some(2));
        for x in [0, 1, 1, 0, 0] {
            s.advance(e(x), 5);
        }
        // Wrapped to the next step: the same distances again.
        assert_eq!(s.full_distance(e(0)), Some(4));
        s.advance(e(0), 5);
        s.advance(e(1), 5);
        s.advance(e(1), 5);
        assert_eq!(s.full_distance(e(1)), Some(4));
        assert_eq!(s.full_distance(e(9)), None);
    }
}
