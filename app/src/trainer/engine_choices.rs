//! What the trainer's options ask of the engine: the [`EngineConfig`] a
//! run opens its engine with, and each option's choice read and checked
//! (the GEMMs' inputs, token condensation, a modeled link).

use std::sync::Arc;

use strata::backend::{BackendKind, DenseGemm, ExpertGemm};
use strata::condense::{CondenseConfig, Search, Threshold};
use strata::engine::{EngineConfig, ExchangeParts, ScheduleKind};
use strata_optim::AdamWHyper;
use strata_tiers::Timeline;

use super::plan::MemoryPlan;
use super::{lr_at, parse_dtype, run_dir::store_path, trains_experts, TrainOptions};

/// The engine's configuration for a run of `o` planned as `plan`.
pub(super) fn engine_config(
    o: &TrainOptions,
    plan: &MemoryPlan,
    timeline: Option<Arc<Timeline>>,
) -> Result<EngineConfig, String> {
    Ok(EngineConfig {
        timeline,
        store_path: Some(store_path(&o.out)),
        device_budget_bytes: plan.expert_device_bytes,
        host_budget_bytes: plan.expert_host_bytes,
        optimizer_threads: o.threads,
        hyper: AdamWHyper {
            lr: lr_at(o, 1),
            weight_decay: o.weight_decay,
            ..AdamWHyper::default()
        },
        compute_dtype: parse_dtype(&o.compute_dtype)?,
        micro_batches: o.micro_batches,
        devices: o.devices,
        first_gpu: o.first_gpu,
        backend: BackendKind::parse(&o.backend)?,
        host_stream_slots: o.host_stream_slots.0,
        host_cell_slots: o.host_cell_slots,
        trace_routing: o.trace_routing.is_some(),
        affinity_prefetch: o.affinity_prefetch,
        dense_on_device: !o.dense_on_host,
        dense_gemm: dense_gemm(o)?,
        expert_gemm: expert_gemm(o)?,
        condense: condense_config(o)?,
        link: link(o)?,
        exchange_parts: exchange_parts(o)?,
        expert_group: match (o.expert_group, plan.expert_group) {
            (Some(0), _) => return Err("--expert-group 0: give 1 or more experts".into()),
            // On a GPU, the group the plan counted memory for.
            (_, planned) if o.backend == "cuda" => Some(planned),
            (asked, _) => asked,
        },
        // The global norm is known when the backward ends.
        clip_grad_norm: o.clip_grad_norm,
        train_experts: trains_experts(o)?,
        schedule: match o.clip_grad_norm {
            Some(_) => ScheduleKind::Naive,
            None => ScheduleKind::ExpertWise,
        },
        ..EngineConfig::default()
    })
}

/// `--dense-gemm`'s choice.
pub(super) fn dense_gemm(o: &TrainOptions) -> Result<DenseGemm, String> {
    DenseGemm::parse(&o.dense_gemm).map_err(|e| format!("--dense-gemm: {e}"))
}

/// `--expert-gemm`'s choice.
pub(super) fn expert_gemm(o: &TrainOptions) -> Result<ExpertGemm, String> {
    ExpertGemm::parse(&o.expert_gemm).map_err(|e| format!("--expert-gemm: {e}"))
}

/// `--link-gb-per-s` and `--link-latency-us`'s link, if any.
pub(super) fn link(o: &TrainOptions) -> Result<Option<strata::comm::Link>, String> {
    let Some(rate) = o.link_gb_per_s else {
        return Ok(None);
    };
    if o.devices < 2 {
        return Err(format!(
            "--link-gb-per-s {rate}: the link is between devices; give --devices 2 or more"
        ));
    }
    strata::comm::Link::new(rate, o.link_latency_us)
        .map(Some)
        .map_err(|e| format!("--link-gb-per-s / --link-latency-us: {e}"))
}

/// `--pipeline`'s split of each layer's exchange: `off` (one exchange),
/// `auto`, or up to N parts.
pub(super) fn exchange_parts(o: &TrainOptions) -> Result<ExchangeParts, String> {
    match o.pipeline.as_str() {
        "off" => Ok(ExchangeParts::Fixed(1)),
        "auto" => Ok(ExchangeParts::Auto),
        n => match n.parse::<usize>() {
            Ok(parts) if parts >= 1 => Ok(ExchangeParts::Fixed(parts)),
            _ => Err(format!(
                "--pipeline {n:?}: give off, auto, or the parts of each layer's exchange \
                 (2, 4, 8, …)"
            )),
        },
    }
}

/// `--condense`, `--condense-cap` and `--condense-search`'s choice.
pub(super) fn condense_config(o: &TrainOptions) -> Result<Option<CondenseConfig>, String> {
    let threshold = match o.condense.as_str() {
        "off" => return Ok(None),
        "adaptive" => Threshold::Adaptive {
            start: strata::condense::ADAPTIVE_START,
        },
        other => match other.strip_prefix("adaptive:") {
            Some(start) => Threshold::Adaptive {
                start: start.parse().map_err(|_| bad_condense(other))?,
            },
            None => Threshold::Fixed(other.parse().map_err(|_| bad_condense(other))?),
        },
    };
    let search = match o.condense_search.as_str() {
        "lsh" => Search::LSH,
        "all-pairs" => Search::AllPairs,
        other => {
            return Err(format!(
                "--condense-search {other:?}: give lsh or all-pairs"
            ))
        }
    };
    let config = CondenseConfig {
        threshold,
        max_share: o.condense_cap,
        search,
    };
    config.check().map_err(|e| format!("--condense: {e}"))?;
    let pairs = (o.trace_routing.is_some().then_some("--trace-routing"))
        .or(o.affinity_prefetch.then_some("--affinity-prefetch"));
    if let Some(flag) = pairs {
        return Err(format!(
            "--condense with {flag}: {flag} pairs each token's experts across layers, and a \
             condensed layer computes fewer tokens; leave one out"
        ));
    }
    if o.backend == "cuda" {
        return Err(
            "--condense runs on the cpu backend (its rows in host memory): add --backend cpu"
                .into(),
        );
    }
    Ok(Some(config))
}

pub(super) fn bad_condense(given: &str) -> String {
    format!("--condense {given:?}: give off, adaptive, adaptive:START or a threshold such as 0.9")
}

/// Fixes `--bf16-kernel`'s kernel for the process (`auto`: the fastest).
pub(crate) fn choose_bf16_kernel(given: &str) -> Result<(), String> {
    if given == "auto" {
        return Ok(());
    }
    let kernel = strata::backend::Bf16Kernel::from_name(given).ok_or_else(|| {
        format!("--bf16-kernel {given:?}: give auto, amx-bf16, avx512-bf16, avx512-fma, avx2-fma or portable")
    })?;
    kernel
        .choose()
        .map_err(|e| format!("--bf16-kernel {given}: {e}"))
}

/// How the run's GEMMs compute, for its first line.
pub(super) fn gemms_described(o: &TrainOptions) -> String {
    match o.backend.as_str() {
        "cuda" => format!(", dense GEMMs in {}", o.dense_gemm),
        _ if o.compute_dtype == "bf16" && o.expert_gemm == "bf16" => format!(
            ", expert GEMMs in bf16 ({})",
            strata::backend::Bf16Kernel::in_use().name()
        ),
        _ => String::new(),
    }
}
