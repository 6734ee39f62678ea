//! What the exchange in parts needs of the engine: the link's fit, on
//! request (`Engine::calibrate_exchange`), and under `--pipeline auto` the
//! search for each layer's part count (`part_search.rs`), advanced after
//! every step from times every device and rank agree on.

use super::exchange::{calibrate, local_cost, ExchangeTuning, LinkFit};
use super::{Engine, StepMetrics};
use crate::comm::{Comm, InProcessComm, ModeledLink};
use crate::EngineError;

impl Engine {
    /// Fits the cost of a collective on this engine's link (its devices'
    /// endpoints, or its rank's, over `EngineConfig::link` where one is
    /// modeled): a few all-to-alls timed, a line through them, averaged
    /// over the devices or ranks. From then on each step's metrics carry
    /// what the exchange's cost model predicted for the parts each layer
    /// went in (`exchange_model_s`, beside the measured `exchange_s`).
    /// Ranks as processes must all call it at the same point. `None` on
    /// one device, which exchanges nothing.
    pub fn calibrate_exchange(&mut self) -> Result<Option<LinkFit>, EngineError> {
        let link = self.config.link;
        let fit = if let Some(ranks) = self.ranks.as_mut() {
            let mut comm = ModeledLink::new(&mut *ranks.comm as &mut dyn Comm, link);
            calibrate(&mut comm)?
        } else if self.devices.len() > 1 {
            let fits = std::thread::scope(|s| {
                let handles: Vec<_> = InProcessComm::endpoints(self.devices.len())
                    .into_iter()
                    .map(|c| s.spawn(move || calibrate(&mut ModeledLink::new(c, link))))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a calibration thread panicked"))
                    .collect::<Result<Vec<_>, _>>()
            })?;
            fits[0]
        } else {
            return Ok(None);
        };
        self.link_fit = Some(fit);
        Ok(Some(fit))
    }

    /// How this step's exchange runners split and price the exchange.
    pub(super) fn exchange_tuning(&self) -> ExchangeTuning {
        ExchangeTuning {
            parts: self.config.exchange_parts,
            link_fit: self.link_fit,
            auto_counts: self.auto_counts(),
            local_s_per_expert: self.exchange_local,
        }
    }

    /// `ExchangeParts::Auto`: [layer][forward, backward] the part counts
    /// the next step runs (empty otherwise).
    pub(super) fn auto_counts(&self) -> Vec<[usize; 2]> {
        self.part_search
            .as_ref()
            .map_or_else(Vec::new, |search| search.counts())
    }

    /// Ranks as processes with a fitted link: the placement's cost per row
    /// (summed over the ranks) and the slowest rank's own work in the
    /// exchange per expert, from the step just measured (a collective
    /// every rank makes here, as every rank fitted the link), so that every
    /// rank predicts with the same one. (Devices of one process share it
    /// already: the engine measures them together.)
    pub(super) fn share_cost_over_ranks(&mut self, m: &StepMetrics) -> Result<(), EngineError> {
        let Some(ranks) = self.ranks.as_mut().filter(|_| self.link_fit.is_some()) else {
            return Ok(());
        };
        let secs: f64 = m.expert_compute_s_per_device.iter().sum();
        let passes: u64 = m.assignments_per_device.iter().sum();
        let mut sums = [secs as f32, passes as f32];
        ranks.comm.all_reduce_sum(&mut sums)?;
        if sums[0] > 0.0 && sums[1] > 0.0 {
            // Each assignment is computed twice (forward, backward).
            self.cost.per_token_s = 2.0 * f64::from(sums[0]) / f64::from(sums[1]);
        }
        // The slowest rank's own work per expert, from each rank's bits.
        let local = m
            .exchange_local_s_per_device
            .first()
            .copied()
            .unwrap_or_default();
        let experts = m
            .exchange_experts_per_device
            .first()
            .copied()
            .unwrap_or_default();
        let mine = local_cost(local, experts).map(|s| (s as f32).to_bits());
        let all = ranks.comm.all_gather_u32(mine.to_vec())?;
        self.exchange_local = all.iter().fold([0.0f64; 2], |most, rank| {
            [0, 1].map(|p| most[p].max(f64::from(f32::from_bits(rank[p]))))
        });
        Ok(())
    }

    /// `ExchangeParts::Auto`: [layer][forward, backward] the part counts
    /// the search settled on, once every layer and pass has (`None` while
    /// it still measures, and without `Auto`).
    pub fn auto_parts(&self) -> Option<Vec<[usize; 2]>> {
        self.part_search
            .as_ref()
            .filter(|search| search.settled())
            .map(|search| search.counts())
    }

    /// `ExchangeParts::Auto`, several devices or ranks: gives the search
    /// what each layer's exchange took this step. Ranks as processes
    /// first average their times (a collective every rank makes here), so
    /// that every rank's search moves alike.
    pub(super) fn advance_part_search(&mut self, m: &StepMetrics) -> Result<(), EngineError> {
        let asked = self.auto_counts();
        let Some(search) = self.part_search.as_mut() else {
            return Ok(());
        };
        if m.exchange_layer_s.is_empty() || search.settled() {
            return Ok(());
        }
        let mut secs = m.exchange_layer_s.clone();
        if let Some(ranks) = self.ranks.as_mut() {
            average_over_ranks(&mut *ranks.comm, &mut secs)?;
        }
        search.record(&asked, &m.exchange_layer_parts, &secs);
        Ok(())
    }
}

/// Each [forward, backward] pair of times replaced by its mean over the
/// ranks of `comm` (a collective every rank makes).
fn average_over_ranks(comm: &mut dyn Comm, secs: &mut [[f64; 2]]) -> Result<(), EngineError> {
    let mut flat: Vec<f32> = secs.iter().flatten().map(|&s| s as f32).collect();
    comm.all_reduce_sum(&mut flat)?;
    let n = comm.size() as f64;
    for (pair, sums) in secs.iter_mut().zip(flat.chunks(2)) {
        *pair = [sums[0] as f64 / n, sums[1] as f64 / n];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_average_each_layer_s_times() {
        let mine = |rank: usize| vec![[1.5 + rank as f64, 0.25], [3.0, 2.0 * rank as f64]];
        let averaged: Vec<Vec<[f64; 2]>> = std::thread::scope(|s| {
            let handles: Vec<_> = InProcessComm::endpoints(2)
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    s.spawn(move || {
                        let mut secs = mine(rank);
                        average_over_ranks(&mut comm, &mut secs).unwrap();
                        secs
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for secs in averaged {
            assert_eq!(secs, vec![[2.0, 0.25], [3.0, 1.0]]);
        }
    }
}
