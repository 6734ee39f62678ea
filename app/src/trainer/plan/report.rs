//! The plan as people read it (`strata plan`, the trainer's first lines),
//! and the host memory it holds in all on the cpu, which a run is refused
//! for before anything is allocated where the machine has less.

use std::fmt::Write as _;

use strata::engine::AvailableMemory;

use super::MemoryPlan;
use crate::trainer::options::{show_bytes, show_count};

impl MemoryPlan {
    /// The plan as people read it.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        let total = self.dense_params + self.expert_count * self.expert_params;
        let _ = writeln!(
            s,
            "model: {:.1}M params ({:.1}M dense, {} experts of {:.2}M)",
            total as f64 / 1e6,
            self.dense_params as f64 / 1e6,
            self.expert_count,
            self.expert_params as f64 / 1e6
        );
        let each = if self.devices > 1 {
            format!(" (each of {} devices)", self.devices)
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "device: {} dense + {} activations + {} for {} expert slots{each}",
            show_bytes(self.dense_device_bytes),
            show_bytes(self.activation_bytes),
            show_bytes(self.expert_device_bytes),
            self.device_slots
        );
        let record_slots = self.host_slots - self.host_cell_slots;
        let mut split = Vec::new();
        if self.host_kept > 0 {
            split.push(format!("{} kept resident", self.host_kept));
            split.push(format!("{} streaming", record_slots - self.host_kept));
        }
        if self.host_cell_slots > 0 {
            split.push(format!("{} in compute cells", self.host_cell_slots));
        }
        let kept = match split.is_empty() {
            true => String::new(),
            false => format!(" ({})", split.join(", ")),
        };
        let frozen = match self.dense_params - self.dense_trainable {
            0 => String::new(),
            f => format!(
                " ({} dense params frozen: {} less)",
                show_count(f),
                show_bytes(8 * f)
            ),
        };
        let _ = writeln!(
            s,
            "host:   {} dense moments{frozen} + {} for {} of {} expert records{kept}",
            show_bytes(self.dense_host_bytes),
            show_bytes(self.expert_host_bytes),
            self.host_slots,
            self.expert_count
        );
        let free = self
            .ssd_free_bytes
            .map(|f| format!(" ({} free)", show_bytes(f)))
            .unwrap_or_default();
        let frozen = match self.frozen_expert_moment_bytes {
            0 => String::new(),
            b => format!(" (experts frozen: no Adam moments, {} less)", show_bytes(b)),
        };
        let _ = writeln!(
            s,
            "ssd:    {} store{free}{frozen}",
            show_bytes(self.ssd_bytes)
        );
        let _ = writeln!(
            s,
            "grads:  {} for up to {} expert gradients on their way to the optimizer \
             (host memory besides --host-mem)",
            show_bytes(self.gradient_bytes),
            self.gradient_buffers
        );
        if let (Some(all), Some(workspace)) = (self.host_in_all(), self.cpu_workspace_bytes) {
            let process = self
                .process_bytes
                .map(|b| format!(", {} the process and its code", show_bytes(b)))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "in all: {} of host memory counted: the lines above (the cpu's device is host \
                 memory), {} the cpu computes with, {} the data's sequences{process}",
                show_bytes(all),
                show_bytes(self.devices * workspace),
                show_bytes(self.data_bytes)
            );
        }
        let _ = write!(s, "mode:   {}", self.mode.describe());
        s
    }

    /// Refuses, on the cpu backend, a run whose host memory in all
    /// ([`Self::host_in_all`]) is more than `available` (`None`: unknown,
    /// so anything goes), naming the parts and what lowers them.
    pub fn check_host_memory(&self, available: Option<&AvailableMemory>) -> Result<(), String> {
        let (Some(all), Some(devices), Some(available)) =
            (self.host_in_all(), self.cpu_devices_bytes(), available)
        else {
            return Ok(());
        };
        if all <= available.bytes {
            return Ok(());
        }
        Err(format!(
            "does not fit: the run would hold {} of host memory (the cpu devices' share {}, \
             the host tier {}, expert gradients {}, the process and its data {}) but \
             {available}: {} short. Lower --host-mem, --device-mem, --batch or --seq-len; with \
             --micro-batches above 1 or --clip-grad-norm every expert's gradient is held",
            show_bytes(all),
            show_bytes(devices),
            show_bytes(self.dense_host_bytes + self.expert_host_bytes),
            show_bytes(self.gradient_bytes),
            show_bytes(self.process_bytes.unwrap_or(0) + self.data_bytes),
            show_bytes(all - available.bytes),
        ))
    }

    /// On the cpu backend, the devices' share of host memory: each one's
    /// dense params and their gradient, activations, expert slots and
    /// workspace. `None` on a GPU, whose share is its own memory.
    fn cpu_devices_bytes(&self) -> Option<u64> {
        let workspace = self.cpu_workspace_bytes?;
        let device =
            self.dense_device_bytes + self.activation_bytes + self.expert_device_bytes + workspace;
        Some(self.devices * device)
    }

    /// On the cpu backend, the host memory the run holds at most: the
    /// process as it planned with all its code, the data's sequences, the
    /// devices' share, the host tier's, and the expert gradients. `None`
    /// on a GPU.
    pub fn host_in_all(&self) -> Option<u64> {
        Some(
            self.process_bytes.unwrap_or(0)
                + self.data_bytes
                + self.cpu_devices_bytes()?
                + self.dense_host_bytes
                + self.expert_host_bytes
                + self.gradient_bytes,
        )
    }
}
