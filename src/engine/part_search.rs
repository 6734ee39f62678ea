//! `--pipeline auto`: each layer's part count, for its forward and its
//! backward, found by MPMoE's adaptive search (`../shared/papers/002`,
//! Algorithm 1) over the run's first steps.
//!
//! MPMoE profiles the candidate counts on the layer's real work and keeps
//! the fastest, on the observation that the time is parabola-shaped in n:
//! it falls while each part's wire time still hides compute, and rises
//! once the parts' own costs (a collective's fixed time, a thread's
//! hand-off, parts uneven between the devices) outweigh what they hide.
//! Here every layer and pass runs 1 part, then 2, 3, … for
//! [`SAMPLES`] steps each, and settles on the fastest as soon as a count
//! is slower than the one before it (the parabola's rise), when a count
//! reaches [`MAX_PARTS`], or when the layer could not split as far as
//! asked. A step's first sample of a layer (the first step: the expert
//! cost still unmeasured, buffers still growing) is not counted.
//!
//! The steps are what the layer's exchange took (`exchange_layer_s`, the
//! experts' compute inside), the most of any device, or on ranks as
//! processes their mean over the ranks (an all-reduce): every device and
//! rank holds the same times, so every one settles on the same counts.
//! Whatever the counts, the results are the same bits; the search decides
//! only how fast the steps go. MPMoE caches counts by ranges of the
//! layer's token count; a layer's count here is constant for a run (the
//! batch's tokens times top-k), so one search a layer and pass suffices.

/// The most parts the search tries (MPMoE's range, 2 … 8, and 1).
pub const MAX_PARTS: usize = 8;

/// Steps each count is measured for; the least is kept.
pub const SAMPLES: usize = 2;

/// The search for every layer, [forward, backward].
#[derive(Clone, Debug)]
pub(crate) struct PartSearch {
    probes: Vec<[Probe; 2]>,
}

#[derive(Clone, Debug, Default)]
struct Probe {
    /// Whether the uncounted first sample has been seen.
    warm: bool,
    /// (count, least seconds, samples) in the order tried.
    tried: Vec<(usize, f64, usize)>,
    settled: Option<usize>,
}

impl Probe {
    fn next(&self) -> usize {
        if let Some(n) = self.settled {
            return n;
        }
        match self.tried.last() {
            None => 1,
            Some(&(n, _, samples)) if samples < SAMPLES => n,
            Some(&(n, _, _)) => n + 1,
        }
    }

    fn record(&mut self, asked: usize, ran: usize, secs: f64) {
        if self.settled.is_some() {
            return;
        }
        if !self.warm {
            self.warm = true;
            return;
        }
        if ran < asked {
            // The layer has fewer experts with rows on a device than asked:
            // no further count exists.
            self.settle();
            return;
        }
        match self.tried.last_mut() {
            Some((n, least, samples)) if *n == ran => {
                *least = least.min(secs);
                *samples += 1;
            }
            _ => self.tried.push((ran, secs, 1)),
        }
        let k = self.tried.len();
        let &(n, t, samples) = &self.tried[k - 1];
        if samples < SAMPLES {
            return;
        }
        let rising = k >= 2 && t > self.tried[k - 2].1;
        if rising || n >= MAX_PARTS {
            self.settle();
        }
    }

    fn settle(&mut self) {
        let best = self
            .tried
            .iter()
            .filter(|t| t.2 >= SAMPLES)
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(1, |t| t.0);
        self.settled = Some(best);
    }
}

impl PartSearch {
    pub fn new(layers: usize) -> Self {
        Self {
            probes: vec![Default::default(); layers],
        }
    }

    /// [layer][forward, backward] the counts the next step runs.
    pub fn counts(&self) -> Vec<[usize; 2]> {
        self.probes
            .iter()
            .map(|[f, b]| [f.next(), b.next()])
            .collect()
    }

    /// What a step measured: [layer][pass] the counts asked (from
    /// [`PartSearch::counts`]), those run, and their seconds.
    pub fn record(&mut self, asked: &[[usize; 2]], ran: &[[usize; 2]], secs: &[[f64; 2]]) {
        for (l, probes) in self.probes.iter_mut().enumerate() {
            for (p, probe) in probes.iter_mut().enumerate() {
                probe.record(asked[l][p], ran[l][p], secs[l][p]);
            }
        }
    }

    /// Whether every layer and pass has settled.
    pub fn settled(&self) -> bool {
        self.probes.iter().flatten().all(|p| p.settled.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs one probe's search against `time(n)`, with `most` the parts
    /// the layer can take; returns the counts each step ran.
    fn search(time: impl Fn(usize) -> f64, most: usize) -> (Vec<usize>, usize) {
        let mut s = PartSearch::new(1);
        let mut ran = Vec::new();
        for _ in 0..100 {
            if s.settled() {
                break;
            }
            let [asked, back] = s.counts()[0];
            let n = asked.min(most);
            ran.push(n);
            // The backward can take one part alone: it settles on it.
            s.record(&[[asked, back]], &[[n, 1]], &[[time(n), 1.0]]);
        }
        (ran, s.counts()[0][0])
    }

    #[test]
    fn the_search_stops_where_the_parabola_rises_and_keeps_the_fastest() {
        // Fastest at 3 parts.
        let (ran, chosen) = search(|n| (n as f64 - 3.0).powi(2) + 1.0, 8);
        // One uncounted step, then two steps of each count up to the first
        // that is slower (4).
        assert_eq!(ran, vec![1, 1, 1, 2, 2, 3, 3, 4, 4]);
        assert_eq!(chosen, 3);
    }

    #[test]
    fn a_count_as_fast_as_the_one_before_does_not_end_the_search() {
        // A flat stretch, then faster: the search goes on past the tie.
        let (ran, chosen) = search(|n| [5.0, 5.0, 3.0, 4.0][n.min(4) - 1], 8);
        assert_eq!(ran, vec![1, 1, 1, 2, 2, 3, 3, 4, 4]);
        assert_eq!(chosen, 3);
    }

    #[test]
    fn one_part_is_kept_when_two_are_slower() {
        let (ran, chosen) = search(|n| n as f64, 8);
        assert_eq!(ran, vec![1, 1, 1, 2, 2]);
        assert_eq!(chosen, 1);
    }

    #[test]
    fn the_search_ends_at_the_most_parts_it_tries_or_the_layer_allows() {
        let (ran, chosen) = search(|n| 1.0 / n as f64, 100);
        assert_eq!(ran.len(), 1 + 2 * MAX_PARTS);
        assert_eq!(chosen, MAX_PARTS);
        // A layer with 3 experts on its busiest device: asking for 4 runs
        // 3, and the search keeps the fastest it could measure.
        let (ran, chosen) = search(|n| 1.0 / n as f64, 3);
        assert_eq!(ran, vec![1, 1, 1, 2, 2, 3, 3, 3]);
        assert_eq!(chosen, 3);
    }

    #[test]
    fn the_least_of_a_count_s_samples_counts_and_the_first_step_does_not() {
        let mut s = PartSearch::new(1);
        // The first step is slow and not counted; 1 part's samples are 5
        // and 2 (least 2); 2 parts' 2.5 and 3 (least 2.5): slower, so 1.
        for (n, t) in [(1, 100.0), (1, 5.0), (1, 2.0), (2, 2.5), (2, 3.0)] {
            assert_eq!(s.counts()[0][0], n);
            s.record(&[[n, n]], &[[n, n]], &[[t, t]]);
        }
        assert!(s.settled());
        assert_eq!(s.counts(), vec![[1, 1]]);
    }

    #[test]
    fn each_layer_and_pass_searches_alone() {
        let mut s = PartSearch::new(2);
        // Layer 0's forward gains from parts, everything else loses.
        for _ in 0..40 {
            let asked = s.counts();
            let secs: Vec<[f64; 2]> = asked
                .iter()
                .enumerate()
                .map(|(l, c)| {
                    let f = if l == 0 {
                        1.0 / c[0] as f64
                    } else {
                        c[0] as f64
                    };
                    [f, c[1] as f64]
                })
                .collect();
            s.record(&asked, &asked, &secs);
        }
        assert!(s.settled());
        assert_eq!(s.counts(), vec![[MAX_PARTS, 1], [1, 1]]);
    }
}
