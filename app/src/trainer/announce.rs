//! What a run says before its first step: the line that names the run
//! (what trains, on what, how), and what the opened engine chose (notes,
//! the host tier's split, held updates). [`Speaker`] prints them, rank 0
//! alone speaking for ranks.

use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use strata::engine::{Engine, EngineConfig, ExchangeParts};
use strata::lm::LmConfig;

use super::engine_choices::gemms_described;
use super::plan::MemoryPlan;
use super::{options, ranks, RunSummary, Source, TrainOptions};

/// Prints a run's lines to standard output. A closed stdout (`strata
/// train | head`) is no reason to lose the run, nor to go on with no one
/// reading: the speaker raises `interrupt`, so the run checkpoints after
/// the step in progress and stops, as on Ctrl-C.
pub(super) struct Speaker<'a> {
    /// This process speaks: one alone, or rank 0 of ranks.
    speaks: bool,
    /// `--quiet`: only the lines that do not start with two spaces.
    quiet: bool,
    stdout_closed: AtomicBool,
    interrupt: &'a AtomicBool,
}

impl<'a> Speaker<'a> {
    pub fn new(speaks: bool, quiet: bool, interrupt: &'a AtomicBool) -> Self {
        Self {
            speaks,
            quiet,
            stdout_closed: AtomicBool::new(false),
            interrupt,
        }
    }

    pub fn speaks(&self) -> bool {
        self.speaks
    }

    pub fn say(&self, line: String) {
        if self.speaks
            && (!self.quiet || !line.starts_with("  "))
            && writeln!(std::io::stdout().lock(), "{line}").is_err()
        {
            self.stdout_closed.store(true, Ordering::SeqCst);
            self.interrupt.store(true, Ordering::SeqCst);
        }
    }

    /// `say`, above the progress bar where one is drawn.
    pub fn say_over(&self, bar: &indicatif::ProgressBar, line: String) {
        if bar.is_hidden() {
            self.say(line);
        } else {
            bar.println(line);
        }
    }

    /// Standard output was found closed.
    pub fn stdout_closed(&self) -> bool {
        self.stdout_closed.load(Ordering::SeqCst)
    }
}

/// A run's first line: what starts (train, finetune, resume), the model,
/// where it runs (ranks, devices, the modeled link), the memory plan's
/// mode, the backend (and why, where `auto` chose it), the GEMMs'
/// types and condensation where it is on.
pub(super) fn first_line(
    o: &TrainOptions,
    source: &Source,
    config: &LmConfig,
    world: Option<&ranks::RankWorld>,
    plan: &MemoryPlan,
    engine_config: &EngineConfig,
) -> String {
    format!(
        "strata {}: {} ({:.1}M params, {} layers × {} experts, top-{}), {}{}, backend {}{}{}{}",
        match (source, o.resume) {
            (_, true) => "resume",
            (Source::Finetune(_), false) => "finetune",
            (Source::Scratch, false) => "train",
        },
        match source {
            Source::Scratch => format!("preset {}", o.preset),
            Source::Finetune(d) => d.display().to_string(),
        },
        config.total_params() as f64 / 1e6,
        config.layers,
        config.experts,
        config.top_k,
        placement(o, world, engine_config.exchange_parts),
        plan.mode.describe(),
        o.backend,
        match &o.backend_chosen {
            Some(found) => format!(" (auto: {found}; --backend cpu or cuda to choose)"),
            None => String::new(),
        },
        gemms_described(o),
        match &engine_config.condense {
            Some(c) => format!("; {}", c.describe()),
            None => String::new(),
        }
    )
}

/// Where the run's devices are: ranks as processes, several devices of
/// this process (over a modeled link, in `parts`), or nothing to say for
/// one.
fn placement(o: &TrainOptions, world: Option<&ranks::RankWorld>, parts: ExchangeParts) -> String {
    let parts = match parts {
        ExchangeParts::Fixed(n) if n > 1 => format!(", each layer's exchange in up to {n} parts"),
        ExchangeParts::Fixed(_) => String::new(),
        ExchangeParts::Auto => {
            ", each layer's exchange in the parts (1-8) measured fastest over the first steps"
                .into()
        }
    };
    match world {
        Some(w) => format!(
            "{} {} ranks as processes ({}{}; rank R's run in {}){parts}, ",
            w.size,
            if o.backend == "cuda" { "GPU" } else { "cpu" },
            w.transport,
            if o.backend == "cuda" {
                ", each on the GPU of its local rank, exchanging through host memory"
            } else {
                ""
            },
            ranks::rank_out(o.out.parent().unwrap_or(Path::new(".")), 0)
                .with_file_name("rank-R")
                .display()
        ),
        None if o.devices > 1 => {
            let over = o.link_gb_per_s.map_or(String::new(), |r| {
                format!(" over a modeled {r} GB/s link ({} µs)", o.link_latency_us)
            });
            format!("{} {} devices{over}{parts}, ", o.devices, o.backend)
        }
        None => String::new(),
    }
}

/// What the opened engine chose that a user should know: the compute
/// threads asked for, the engine's notes, a split of the host tier that
/// does not apply, the records kept resident and the compute cells, and
/// the updates held for the next forward.
pub(super) fn engine_lines(o: &TrainOptions, engine: &Engine) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(n) = o.compute_threads {
        lines.push(format!(
            "  compute: the cpu backend splits over {n} of the {} cores",
            strata::machine_cores()
        ));
    }
    for note in engine.notes() {
        lines.push(format!("note: {note}"));
    }
    for note in unused_split(o, engine.host_cells()) {
        lines.push(format!("note: {note}"));
    }
    if engine.host_kept() > 0 || engine.host_cells() > 0 {
        let cells = match engine.host_cells() {
            0 => String::new(),
            n => format!(", and {n} compute cells"),
        };
        let kept = match engine.host_kept() {
            0 => "none stays resident, all stream from the SSD".to_string(),
            n => format!(
                "{n} stay resident, the others stream from the SSD through {} slots",
                engine.host_slots() - n
            ),
        };
        lines.push(format!(
            "  host memory: {} expert records; {kept}{cells}",
            engine.host_slots()
        ));
    }
    // A layer's experts at most, however many a group could hold.
    let group = engine.expert_group().min(engine.model().experts);
    if group > 1 {
        let how = match o.backend.as_str() {
            "cuda" => "each of their products one grouped GEMM",
            _ if strata::backend::cpu_group_side_by_side(group) => {
                "side by side on the compute threads"
            }
            _ => "each computed alone, its GEMMs split over the compute threads",
        };
        lines.push(format!(
            "  experts: up to {group} of a layer at a time, {how}"
        ));
    }
    if engine.deferred_updates() > 0 {
        lines.push(format!(
            "  {} experts' updates wait for the next step's forward",
            engine.deferred_updates()
        ));
    }
    lines
}

/// Bytes to set up (store records to write, host memory to pin) from
/// which a run says what it is setting up before the engine opens: a
/// first touch of host memory can run at a few hundred MB/s (on a virtual
/// machine, 8.86 GiB for moe-s's records took about half a minute), and
/// the run prints nothing else meanwhile.
const SETTING_UP_SAID_FROM: u64 = 1 << 30;

/// How a run fills its store before the engine opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StoreFill {
    /// A new run writes every expert's initial record.
    Initialize,
    /// A fine-tuned run imports the checkpoint's experts (the import says
    /// its own line and shows its bar).
    Import,
    /// A resumed run reads the store as it is.
    Resume,
}

/// What opening the engine sets up, where that is much: the store's
/// expert records written or imported, and the host memory its expert
/// records take, which the host tier pins whole.
pub(super) fn setting_up_line(fill: StoreFill, plan: &MemoryPlan) -> Option<String> {
    let store = if fill == StoreFill::Resume {
        0
    } else {
        plan.ssd_bytes
    };
    if store.max(plan.expert_host_bytes) < SETTING_UP_SAID_FROM {
        return None;
    }
    let host = format!(
        "pinning {} of host memory for {} expert records",
        options::show_bytes(plan.expert_host_bytes),
        plan.host_slots
    );
    let (count, store) = (plan.expert_count, options::show_bytes(plan.ssd_bytes));
    Some(match fill {
        StoreFill::Initialize => format!(
            "  setting up: writing the store's {count} expert records ({store} store), then {host} …"
        ),
        StoreFill::Import => format!(
            "  setting up: importing {count} experts into the store ({store}), then {host} …"
        ),
        StoreFill::Resume => format!("  setting up: {host} …"),
    })
}

/// The line that says which groups train, where some are frozen.
pub(super) fn frozen_line(o: &TrainOptions, plan: &MemoryPlan) -> String {
    format!(
        "training {} alone; the rest is frozen ({} dense params without moments)",
        o.train.join(", "),
        options::show_count(plan.dense_params - plan.dense_trainable)
    )
}

/// What a run starting at `start_step` says before its loop: nothing to
/// train, or already done; `--timeline-step` outside the steps it will
/// run is refused.
pub(super) fn start_lines(o: &TrainOptions, start_step: u64) -> Result<Vec<String>, String> {
    if let Some(n) = o
        .timeline_step
        .filter(|n| !(start_step + 1..=o.steps).contains(n))
    {
        return Err(format!(
            "--timeline-step {n}: this run goes from step {} to {}; ask for one of those",
            start_step + 1,
            o.steps
        ));
    }
    Ok(if o.steps == 0 {
        vec!["--steps 0: nothing to train".to_string()]
    } else if start_step >= o.steps {
        vec![format!(
            "the run is already at step {start_step} of {}",
            o.steps
        )]
    } else {
        Vec::new()
    })
}

/// The line of a run stopped early, with how to go on.
pub(super) fn interrupted_line(o: &TrainOptions, summary: &RunSummary) -> String {
    format!(
        "interrupted: checkpoint written at step {}; continue with --resume --out {}",
        summary.steps,
        o.out.display()
    )
}

/// The last line of a run that reached its steps.
pub(super) fn done_line(summary: &RunSummary) -> String {
    let loss = |l: Option<f32>| l.map_or("-".into(), |l| format!("{l:.4}"));
    let memory = match (summary.peak_memory_bytes, summary.plan.host_in_all()) {
        (Some(peak), Some(planned)) => format!(
            "  peak memory {} (the plan counted {})",
            options::show_bytes(peak),
            options::show_bytes(planned)
        ),
        (Some(peak), None) => format!("  peak host memory {}", options::show_bytes(peak)),
        _ => String::new(),
    };
    format!(
        "done: step {}  loss {} → {}  eval {}  {:.0} tokens/s (median){memory}",
        summary.steps,
        loss(summary.first_loss),
        loss(summary.last_loss),
        loss(summary.last_eval_loss),
        summary.tokens_per_s
    )
}

/// What of the host tier's split that `o` asks for does not apply: cells
/// are only for records streaming from the SSD through one device's host
/// tier.
fn unused_split(o: &TrainOptions, cells: usize) -> Vec<String> {
    let mut notes = Vec::new();
    let why = "it applies where expert records stream from the SSD, on one device";
    if o.host_cell_slots > 0 && cells == 0 {
        notes.push(format!(
            "--host-cell-slots {} is not used: {why}",
            o.host_cell_slots
        ));
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::TrainFlags;

    /// `model`'s plan at 8 × 64 tokens, `host_mem` and 4 GiB a device.
    fn planned(model: &str, host_mem: u64) -> MemoryPlan {
        let m = LmConfig::preset(model).unwrap();
        let plan = super::super::plan::plan;
        plan(&super::super::plan::test_input(&m, 4 << 30, host_mem)).unwrap()
    }

    /// Said where the store or the host tier is large, not where both
    /// are small; the store's writing where the run writes it.
    #[test]
    fn a_long_set_up_is_said_before_the_engine_opens() {
        let roomy = planned("moe-s", 12 << 30);
        let line = setting_up_line(StoreFill::Initialize, &roomy).expect("18 GiB to write");
        assert!(line.starts_with("  setting up: writing the store's 96 expert records"));
        assert!(line.contains("pinning 8.86 GiB of host memory for 96 expert records"));
        assert_eq!(
            setting_up_line(StoreFill::Resume, &roomy).expect("8.86 GiB to pin"),
            "  setting up: pinning 8.86 GiB of host memory for 96 expert records …"
        );
        // Records streaming through a few host slots: the store alone.
        let streaming = planned("moe-s", 1 << 30);
        assert!(streaming.expert_host_bytes < 1 << 30);
        assert!(setting_up_line(StoreFill::Initialize, &streaming).is_some());
        assert_eq!(setting_up_line(StoreFill::Resume, &streaming), None);
        let tiny = planned("tiny", 1 << 30);
        assert_eq!(setting_up_line(StoreFill::Initialize, &tiny), None);
        let import = setting_up_line(StoreFill::Import, &roomy).expect("18 GiB to import");
        let store = options::show_bytes(roomy.ssd_bytes);
        let head =
            format!("  setting up: importing 96 experts into the store ({store}), then pinning");
        assert!(import.starts_with(&head), "{import}");
    }

    /// The last line sets the run's peak memory beside what the plan
    /// counted on the cpu, and says it alone on a GPU.
    #[test]
    fn the_last_line_sets_the_peak_memory_beside_the_plan() {
        let plan = planned("tiny", 1 << 30);
        let counted = plan.host_in_all().unwrap();
        let mut summary = RunSummary::starting(plan, 0);
        summary.steps = 3;
        assert!(done_line(&summary).ends_with("tokens/s (median)"));
        summary.peak_memory_bytes = Some(48 << 20);
        let line = done_line(&summary);
        let tail = format!(
            "  peak memory 48.00 MiB (the plan counted {})",
            options::show_bytes(counted)
        );
        assert!(line.ends_with(&tail), "{line}");
        summary.plan.cpu_workspace_bytes = None; // a GPU's plan
        assert!(done_line(&summary).ends_with("  peak host memory 48.00 MiB"));
    }

    #[test]
    fn a_split_that_does_not_apply_is_named() {
        let o = TrainFlags::default().resolve().unwrap();
        assert!(unused_split(&o, 0).is_empty());
        let asked = TrainOptions {
            host_cell_slots: 1,
            ..o
        };
        let notes = unused_split(&asked, 0);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].starts_with("--host-cell-slots 1 is not used"));
        assert!(unused_split(&asked, 6).is_empty());
    }
}
