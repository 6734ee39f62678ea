//! The host memory an engine will hold, checked against what the machine
//! has before anything is allocated: a budget beyond the machine's memory
//! would otherwise end in swapping or an out-of-memory kill minutes in.

use strata_tiers::Layout;

use super::available_memory::AvailableMemory;
use super::build::{group_within_streaming, host_cell_slot_count, host_kept_count};
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

    /// Refuses a plan of more than `available` host memory (`None`:
    /// unknown, so anything goes), naming its parts and what lowers them.
    pub fn check(&self, available: Option<&AvailableMemory>) -> Result<(), EngineError> {
        match available {
            Some(available) if self.total() > available.bytes => Err(EngineError::Config(format!(
                "the engine would hold {:.2} GiB of host memory ({}) but {available}: lower \
                 the host budget (--host-mem), the device budget of cpu devices \
                 (--device-mem) or --devices, give the store a file, or (for the \
                 gradients) use fewer micro-batches or the expert-wise schedule",
                self.total() as f64 / GIB,
                self.describe(),
            ))),
            _ => Ok(()),
        }
    }
}

/// The expert gradients an engine has alive at once, at most:
/// - one per expert where the naive schedule holds them to the end of the
///   backward or several micro-batches sum them;
/// - else one per update in flight (each device keeps at most a layer's
///   experts' worth, at least 2, in flight, and at most one more than the
///   host slots its unfinished ones hold; with several devices one more
///   each that another device's wait has claimed) and one per update
///   deferred to the next step's forward;
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
        // A device's list of updates in flight: a layer's experts at most,
        // and one more than the host slots at most (finished updates are
        // taken back before each submission, and those left hold the
        // slots, but an update hands its slot back a moment before it can
        // be taken back, so the one submitted may take it). A wait that
        // claims another device's update takes it off that device's list
        // before its gradient is given back: one more alive a device
        // waiting, each waiting for one.
        let per_device = updates_in_flight_max(per_layer).min(slots + 1);
        let claimed = config.devices.saturating_sub(1);
        let in_flight = (config.devices * per_device + claimed).min(experts);
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
/// device's slots, with the cpu's limit, and within half the host tier's
/// streaming slots where records stream), a layer's at most, since a
/// group is of one layer's experts; else 1.
pub fn cpu_expert_group_bound(layout: &Layout, config: &EngineConfig) -> usize {
    if config.workers() != 1 {
        return 1;
    }
    let slot = layout.compute_payload_bytes().max(1);
    let slots = (config.device_budget_bytes / slot).min(layout.expert_count()) as usize;
    let group = group_size(config.expert_group, cpu_group_limit(), slots);
    // The host tier's record slots, as the engine splits them.
    let records = layout.expert_count() as usize;
    let budget_slots = (config.host_budget_bytes / layout.record_bytes()) as usize;
    let cells = host_cell_slot_count(config, budget_slots, records);
    let record_slots = budget_slots.saturating_sub(cells).min(records);
    let kept = host_kept_count(config, record_slots, records);
    let group = group_within_streaming(group, record_slots, kept, records);
    group.min((layout.experts_per_layer as usize).max(1))
}

#[cfg(test)]
mod tests {
    use super::super::available_memory::MemoryBound;
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
        // Expert-wise, one micro-batch: each device's updates in flight,
        // at most one more than the host slots (4 of the 4 a layer has),
        // one more a wait claims from another device, within the 8
        // experts; and one expert computing per device.
        assert_eq!(plan.gradients, (8 + 2) * 1000 * 4);
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
        // The 3 slots' unfinished updates and one submitted, waiting for a
        // finished one's slot; a group within half the streaming slots
        // (1 here, whatever is asked).
        for group in [Some(1), None, Some(64)] {
            let streaming = EngineConfig {
                devices: 1,
                expert_group: group,
                ..config.clone()
            };
            assert_eq!(
                HostMemoryPlan::of(&layout, &streaming).gradients,
                (4 + 1) * 1000 * 4
            );
        }
        let five_slots = EngineConfig {
            devices: 1,
            host_budget_bytes: 5 * record,
            expert_group: None,
            ..config.clone()
        };
        let group = cpu_expert_group_bound(&layout, &five_slots);
        assert_eq!(group, 2.min(cpu_group_limit()));
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
        assert_eq!(plan.gradients, (8 + 2 + 2 * 3) * 1000 * 4);
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
        let machine = |bytes| AvailableMemory {
            bytes,
            bound: MemoryBound::Machine,
        };
        assert!(plan.check(Some(&machine(9 << 29))).is_ok());
        let err = plan.check(Some(&machine(2 << 30))).unwrap_err().to_string();
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
}
