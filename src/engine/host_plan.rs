//! The host memory an engine will hold, checked against what the machine
//! has before anything is allocated: a budget beyond the machine's memory
//! would otherwise end in swapping or an out-of-memory kill minutes in.

use strata_tiers::Layout;

use super::slot_table::group_size;
use super::updates::updates_in_flight_max;
use crate::backend::{cpu_group_limit, BackendKind, GRADIENT_DOWNLOAD_BUFFERS};
use crate::engine::{EngineConfig, ScheduleKind};
use crate::EngineError;

const GIB: f64 = (1u64 << 30) as f64;

/// Host memory an engine holds, by what holds it. Each tier holds at most
/// one slot per expert, so a budget beyond that costs nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMemoryPlan {
    /// The host tier's slots (records: compute params, master weights,
    /// optimizer moments).
    pub host_tier: u64,
    /// The SSD tier kept in memory (`store_path: None`).
    pub store_in_memory: u64,
    /// cpu devices' slots (their "device memory" is host memory).
    pub cpu_device_tiers: u64,
    /// Expert gradients (f32) alive at once ([`gradient_buffers`]), kept
    /// for reuse between steps, so held for the whole run.
    pub gradients: u64,
}

impl HostMemoryPlan {
    pub fn of(layout: &Layout, config: &EngineConfig) -> Self {
        let experts = layout.expert_count();
        let record = layout.record_bytes();
        let slot = layout.compute_payload_bytes().max(1);
        let host_tier = (config.host_budget_bytes / record).min(experts) * record;
        let store_in_memory = match config.store_path {
            Some(_) => 0,
            None => experts * record,
        };
        let cpu_device_tiers = match config.backend {
            BackendKind::Cpu => {
                config.devices as u64 * (config.device_budget_bytes / slot).min(experts) * slot
            }
            BackendKind::Cuda => 0, // GPU memory
        };
        let gradients = gradient_buffers(layout, config) as u64 * layout.params_per_expert * 4;
        Self {
            host_tier,
            store_in_memory,
            cpu_device_tiers,
            gradients,
        }
    }

    pub fn total(&self) -> u64 {
        self.host_tier + self.store_in_memory + self.cpu_device_tiers + self.gradients
    }

    /// The parts that hold anything, as "host tier 1.50 GiB, …".
    pub fn describe(&self) -> String {
        [
            ("host tier", self.host_tier),
            (
                "SSD tier kept in memory (no store path)",
                self.store_in_memory,
            ),
            ("cpu device tiers", self.cpu_device_tiers),
            ("expert gradients", self.gradients),
        ]
        .iter()
        .filter(|(_, bytes)| *bytes > 0)
        .map(|(what, bytes)| format!("{what} {:.2} GiB", *bytes as f64 / GIB))
        .collect::<Vec<_>>()
        .join(", ")
    }

    /// Refuses a plan of more than `available` bytes (`None`: unknown, so
    /// anything goes), naming its parts and what lowers them.
    pub fn check(&self, available: Option<u64>) -> Result<(), EngineError> {
        match available {
            Some(available) if self.total() > available => Err(EngineError::Config(format!(
                "the engine would hold {:.2} GiB of host memory ({}) but this machine has \
                 {:.2} GiB available: lower the host budget (--host-mem), the device budget \
                 of cpu devices (--device-mem) or --devices, give the store a file, or \
                 (for the gradients) use fewer micro-batches or the expert-wise schedule",
                self.total() as f64 / GIB,
                self.describe(),
                available as f64 / GIB,
            ))),
            _ => Ok(()),
        }
    }
}

/// The expert gradients an engine has alive at once, at most:
/// - one per expert where the naive schedule holds them to the end of the
///   backward or several micro-batches sum them;
/// - else one per update in flight (each holds a host slot, and each
///   device keeps at most a layer's experts' worth, at least 2, in
///   flight) and one per update deferred to the next step's forward;
/// - besides, what each device is computing: on the cpu, a group of
///   experts' gradients at once (a layer's at most, and
///   [`cpu_group_limit`], on one device of one process); on a GPU, one
///   taken down at a time and its page-locked buffers for gradients coming
///   down ([`GRADIENT_DOWNLOAD_BUFFERS`]).
///
/// (`Engine::gradients`, which returns every expert's gradient, holds one
/// per expert whatever the schedule.)
pub fn gradient_buffers(layout: &Layout, config: &EngineConfig) -> usize {
    let experts = layout.expert_count() as usize;
    let per_layer = layout.experts_per_layer as usize;
    let held = if config.schedule == ScheduleKind::Naive || config.micro_batches > 1 {
        experts
    } else {
        let slots = ((config.host_budget_bytes / layout.record_bytes()) as usize).min(experts);
        let in_flight = slots.min(config.devices * updates_in_flight_max(per_layer));
        // Held across the step boundary (as if the pipeline overlapped:
        // the most it defers).
        let deferred = super::build::deferred_experts(
            layout.layers as usize,
            per_layer,
            config,
            config.schedule == ScheduleKind::ExpertWise,
            slots,
        );
        in_flight + deferred.len()
    };
    let computing = match config.backend {
        BackendKind::Cpu => cpu_expert_group_bound(layout, config),
        BackendKind::Cuda => 1 + GRADIENT_DOWNLOAD_BUFFERS,
    };
    held + config.devices * computing
}

/// The most experts a cpu device computes at once: on one device of one
/// process, the group `build::expert_group` takes (`group_size` over the
/// device's slots, with the cpu's limit), a layer's at most, since a group
/// is of one layer's experts; else 1.
pub fn cpu_expert_group_bound(layout: &Layout, config: &EngineConfig) -> usize {
    if config.workers() != 1 {
        return 1;
    }
    let slot = layout.compute_payload_bytes().max(1);
    let slots = (config.device_budget_bytes / slot).min(layout.expert_count()) as usize;
    let group = group_size(config.expert_group, cpu_group_limit(), slots);
    group.min((layout.experts_per_layer as usize).max(1))
}

/// Memory the kernel says can be had without swapping (`MemAvailable` in
/// /proc/meminfo); `None` where that is not known.
pub fn available_host_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&meminfo)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => Some(value * 1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_tiers::Dtype;

    fn layout() -> Layout {
        Layout {
            layers: 2,
            experts_per_layer: 4,
            params_per_expert: 1000,
            compute_dtype: Dtype::Bf16,
            moments: true,
        }
    }

    #[test]
    fn tiers_hold_at_most_a_slot_per_expert() {
        let layout = layout();
        let record = layout.record_bytes();
        let slot = layout.compute_payload_bytes();
        let config = EngineConfig {
            host_budget_bytes: 3 * record + 1,
            device_budget_bytes: 1 << 40, // capped at the 8 experts
            devices: 2,
            ..EngineConfig::default()
        };
        let plan = HostMemoryPlan::of(&layout, &config);
        assert_eq!(plan.host_tier, 3 * record);
        assert_eq!(plan.store_in_memory, 8 * record);
        assert_eq!(plan.cpu_device_tiers, 2 * 8 * slot);
        // Expert-wise, one micro-batch: an update in flight per host slot,
        // one expert computing per device.
        assert_eq!(plan.gradients, (3 + 2) * 1000 * 4);
        for holds_all in [
            EngineConfig {
                schedule: ScheduleKind::Naive,
                ..config.clone()
            },
            EngineConfig {
                micro_batches: 4,
                ..config.clone()
            },
        ] {
            assert_eq!(
                HostMemoryPlan::of(&layout, &holds_all).gradients,
                (8 + 2) * 1000 * 4
            );
        }
        // One device with 6 host slots keeps 2 records (layer 1's experts
        // 0 and 1, 4 slots streaming) and holds the last layer's other two
        // updates across the step boundary: a gradient each besides the
        // 4 updates a device keeps in flight (a layer's experts) and the
        // one it computes. With 3 slots no record is kept, and the last
        // layer holds none.
        let deferring = EngineConfig {
            devices: 1,
            host_budget_bytes: 6 * record + 1,
            expert_group: Some(1),
            ..config.clone()
        };
        assert_eq!(
            HostMemoryPlan::of(&layout, &deferring).gradients,
            (4 + 2 + 1) * 1000 * 4
        );
        let streaming = EngineConfig {
            devices: 1,
            expert_group: Some(1),
            ..config.clone()
        };
        assert_eq!(
            HostMemoryPlan::of(&layout, &streaming).gradients,
            (3 + 1) * 1000 * 4
        );
        // Every record in host memory: the device's 4 updates in flight
        // bound them, not the 8 slots; a group's gradients are taken
        // together, a layer's at most.
        for (group, computing) in [(1, 1), (3, 3), (64, 4)] {
            let in_memory = EngineConfig {
                devices: 1,
                host_budget_bytes: 8 * record,
                expert_group: Some(group),
                ..config.clone()
            };
            assert_eq!(
                HostMemoryPlan::of(&layout, &in_memory).gradients,
                (4 + computing) * 1000 * 4
            );
        }
        // Each GPU keeps three page-locked buffers its gradients come
        // down to, and has no slots in host memory.
        let gpus = EngineConfig {
            backend: BackendKind::Cuda,
            ..config.clone()
        };
        let plan = HostMemoryPlan::of(&layout, &gpus);
        assert_eq!(plan.gradients, (3 + 2 + 2 * 3) * 1000 * 4);
        assert_eq!(plan.cpu_device_tiers, 0);
        let on_file = EngineConfig {
            store_path: Some("x.store".into()),
            ..config
        };
        assert_eq!(HostMemoryPlan::of(&layout, &on_file).store_in_memory, 0);
    }

    #[test]
    fn a_plan_beyond_the_available_memory_is_refused_naming_its_parts() {
        let plan = HostMemoryPlan {
            host_tier: 3 << 30,
            store_in_memory: 0,
            cpu_device_tiers: 1 << 30,
            gradients: 1 << 29,
        };
        assert!(plan.check(None).is_ok());
        assert!(plan.check(Some(9 << 29)).is_ok());
        let err = plan.check(Some(2 << 30)).unwrap_err().to_string();
        assert!(err.contains("4.50 GiB of host memory"), "{err}");
        assert!(
            err.contains(
                "host tier 3.00 GiB, cpu device tiers 1.00 GiB, expert gradients 0.50 GiB"
            ),
            "{err}"
        );
        assert!(
            err.contains("2.00 GiB available") && err.contains("--host-mem"),
            "{err}"
        );
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   16000000 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(16_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        if cfg!(target_os = "linux") {
            assert!(available_host_memory().is_some_and(|b| b > 0));
        }
    }
}
