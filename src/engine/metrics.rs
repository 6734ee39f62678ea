//! What one training step cost and moved: the engine's main performance
//! signal (DESIGN.md, "Every wait is measured").

use serde::Serialize;

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub tokens: usize,
    pub loss: f32,
    pub wall_s: f64,
    /// Time in expert and dense compute.
    pub compute_s: f64,
    /// Time waiting for host → device copies.
    pub stall_upload_s: f64,
    /// Time waiting for expert records to arrive from the SSD tier.
    pub stall_ssd_s: f64,
    /// Time waiting for an expert's optimizer update before its forward.
    pub stall_optimizer_s: f64,
    pub bytes_ssd_to_host: u64,
    pub bytes_host_to_ssd: u64,
    pub bytes_host_to_device: u64,
    pub bytes_device_to_host: u64,
    /// Host-tier acquires served without waiting.
    pub host_hit_rate: f64,
    /// Expert uses served by an expert already on the device.
    pub device_hit_rate: f64,
    /// [layer][expert] assignments this step.
    pub tokens_per_expert: Vec<Vec<u32>>,
}

impl StepMetrics {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("metrics serialize")
    }
}
