//! What `strata bench step` prints: one record per run and a summary of
//! their ratios.

use serde::Serialize;

use super::phases::StepPhases;
use super::Balance;

#[derive(Clone, Debug, Serialize)]
pub struct StepBenchRecord {
    pub bench: &'static str,
    pub run: &'static str,
    pub layers: usize,
    pub experts: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub top_k: usize,
    pub tokens: usize,
    pub devices: usize,
    pub backend: &'static str,
    /// `computed` on `backend`, `skipped` (the I/O-only run) or `modeled`
    /// (see the summary's `modeled_device_gflop_per_s`).
    pub expert_compute: &'static str,
    /// Host slots holding a whole record each.
    pub host_slots: usize,
    /// Of `host_slots`, those keeping a record resident for the whole run.
    pub host_kept: usize,
    /// Host compute cells (each one record's compute part), from the slots
    /// split into them (`--host-cell-slots`).
    pub host_cells: usize,
    /// Records a step moved from a record slot to a compute cell (mean).
    pub host_demotions: f64,
    /// Experts whose updates wait for the next step's forward.
    pub deferred_updates: usize,
    pub device_slots: usize,
    pub steps: usize,
    pub step_s: f64,
    pub min_step_s: f64,
    pub tokens_per_s: f64,
    pub compute_s: f64,
    pub stall_upload_s: f64,
    pub stall_ssd_s: f64,
    pub stall_optimizer_s: f64,
    /// Mean time a step had SSD I/O in flight (see `StepMetrics`); set
    /// against the I/O-only run's, it shows how much slower the same
    /// traffic runs beside compute.
    pub ssd_busy_s: f64,
    pub bytes_ssd_to_host: u64,
    pub bytes_host_to_ssd: u64,
    /// The least the steps' routing needed moved, both ways (see
    /// `StepMetrics::bytes_ssd_min`), summed like the two above.
    pub bytes_ssd_min: u64,
    pub host_hit_rate: f64,
    /// Device hits over device uses (pinning raises it).
    pub device_hit_rate: f64,
    /// max/min − 1 of the expert assignments each device computed (mean
    /// over steps; 0 with one device).
    pub device_load_gap: f64,
    /// CPU seconds the hypervisor took from this virtual machine during a
    /// timed step (mean; all cores; /proc/stat's steal, null where not
    /// reported): other tenants' work, or the host serving this machine's
    /// own disk I/O on the cores behind its own. The second shows only in
    /// the runs that overlap SSD I/O with compute on every core (measured
    /// alone by `strata bench overlap`).
    pub steal_s: Option<f64>,
    /// CPU seconds the whole process used during a timed step (mean; all
    /// threads, user + system; null where the OS does not report it). Set
    /// against `step_s` × cores it shows how much of the machine a run
    /// kept busy: the expert-wise run's checksums, write-backs and uploads
    /// are what it uses beyond the compute-only run.
    pub cpu_s: Option<f64>,
    /// Page faults the whole process took during a timed step (mean; minor
    /// faults: first touches of new memory, served without I/O; null where
    /// the OS does not report them). Each costs a trap and a page clear, on
    /// whichever thread touched the page: a run that allocates its buffers
    /// afresh every step shows here.
    pub page_faults: Option<f64>,
    /// Timed steps that lost at most `arm::QUIET_STEAL_SHARE` (5 %) of the machine's
    /// CPU time to steal, and their median step time.
    pub quiet_steps: usize,
    pub quiet_step_s: Option<f64>,
    /// Mean over the timed steps of their phases (forward, the turn to the
    /// backward, backward) and the SSD's idle time in each (see
    /// `phases.rs`); null where the steps ran no backward expert loop.
    pub phases: Option<StepPhases>,
}

impl StepBenchRecord {
    /// The share of this machine's CPU time (`cores` × `step_s`) the
    /// hypervisor took during a timed step, where steal is reported.
    pub fn steal_share(&self, cores: f64) -> Option<f64> {
        self.steal_s.map(|s| s / (cores * self.step_s).max(1e-9))
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct StepBenchSummary {
    pub bench: &'static str,
    pub run: &'static str,
    pub rounds: usize,
    /// Tokens per step of every run.
    pub tokens: usize,
    /// Where the runs' expert compute was modeled, not computed: the
    /// modeled device's rate (`StepBenchConfig::modeled_device_flops`).
    pub modeled_device_gflop_per_s: Option<f64>,
    /// Threads the cpu backend's compute split over
    /// ([`strata::set_compute_threads`]), of `machine_cores`.
    pub compute_threads: usize,
    pub machine_cores: usize,
    /// How `tokens` was found, where it was balanced (`balance_tokens`).
    pub balance: Option<Balance>,
    /// naive ÷ expert-wise median step time (over every round)
    pub expert_wise_over_naive: f64,
    /// expert-wise step time ÷ max(compute only, I/O only)
    pub expert_wise_over_bound: f64,
    /// The same two ratios from each round's steps alone.
    pub expert_wise_over_naive_by_round: Vec<f64>,
    pub expert_wise_over_bound_by_round: Vec<f64>,
    /// The two ratios over quiet steps only (see `quiet_steps`); null
    /// where a run had none.
    pub quiet_expert_wise_over_naive: Option<f64>,
    pub quiet_expert_wise_over_bound: Option<f64>,
}
