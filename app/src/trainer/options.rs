//! The trainer's options: command-line flags, mirrored one to one by the
//! keys of a TOML file (`--config run.toml`; a flag given on the command
//! line wins over the file, the file over the default).

use std::path::{Path, PathBuf};

use clap::Args;
use serde::{Deserialize, Serialize};

use strata::engine::{EngineConfig, MIN_HOST_STREAM_SLOTS};

/// Flags of `strata train`, `strata finetune` and `strata plan`. Every
/// field is optional here so a TOML file can fill what the command line
/// leaves out; [`TrainFlags::resolve`] applies the defaults.
#[derive(Args, Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainFlags {
    /// TOML file whose keys mirror these flags (underscores for dashes).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Model shape when training from scratch: tiny, small, moe-s, moe-m,
    /// moe-l (default tiny).
    #[arg(long)]
    pub preset: Option<String>,
    /// Number of experts a MoE layer (overrides the preset).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Training text: .txt or .jsonl files (`text` field). None: the built-in corpus.
    #[arg(long, num_args = 1..)]
    pub data: Option<Vec<PathBuf>>,
    /// A Hugging Face tokenizer.json (default: the model directory's, else bytes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Run directory: store, checkpoints, metrics (default runs/default).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Optimizer steps in all (default 300).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Tokens a sequence (default 64).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Sequences a step (default 16).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Micro-batches a step, for gradient accumulation (default 1).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Device workers (cpu devices), each with --device-mem; every step's
    /// sequences are shared out among them and experts placed per layer
    /// (default 1).
    #[arg(long)]
    pub devices: Option<usize>,
    /// Expert and dense compute: cpu, cuda (a strata built with --features
    /// cuda and an NVIDIA GPU per device), or auto: cuda where this strata
    /// has it and --devices GPUs are there, else cpu; the first line says
    /// which (default auto).
    #[arg(long)]
    pub backend: Option<String>,
    /// Peak learning rate (default 0.003).
    #[arg(long)]
    pub lr: Option<f32>,
    /// Linear warmup steps before the cosine decay (default 20).
    #[arg(long)]
    pub warmup: Option<u64>,
    /// The cosine decays to lr × this at the last step (default 0.1).
    #[arg(long)]
    pub min_lr_ratio: Option<f32>,
    /// Decoupled AdamW weight decay (params −= lr × this × params, as torch's
    /// AdamW), on every parameter, norms and embeddings included (default 0).
    #[arg(long)]
    pub weight_decay: Option<f32>,
    /// Clip the global gradient norm to this, as torch's clip_grad_norm_
    /// (TRL's max_grad_norm). The norm is known when the backward ends, so
    /// every expert's update waits for it (the naive schedule), and every
    /// expert gradient of a step is held in host memory until then. Off
    /// unless given.
    #[arg(long, value_name = "MAX")]
    pub clip_grad_norm: Option<f32>,
    /// What the run updates: a comma-separated list of experts, router,
    /// attention, mlp (dense layers and shared experts), embeddings
    /// (with the LM head) and norms (default: all). The others are frozen:
    /// no update, no Adam moments.
    #[arg(long, value_delimiter = ',', value_name = "GROUPS")]
    pub train: Option<Vec<String>>,
    /// Count how tokens move between consecutive MoE layers' experts and
    /// write the counts, with P(expert at the next layer | expert here),
    /// to this JSON file at every checkpoint (a resumed run continues it).
    #[arg(long, value_name = "FILE")]
    pub trace_routing: Option<PathBuf>,
    /// Where experts stream from the SSD on one device, prefetch each MoE
    /// layer's experts as the token pairs counted between it and the layer
    /// before predict (ExFlow's inter-layer affinity) instead of as its
    /// previous routing did. Off by default: training from scratch, whose
    /// routing drifts, it named twice as many experts for nothing.
    #[arg(long)]
    #[serde(default)]
    pub affinity_prefetch: bool,
    /// With one GPU, step the dense params with the cpu's AdamW, which
    /// uploads them and downloads their gradient every step, instead of
    /// keeping them, their moments and gradient in GPU memory and stepping
    /// them there (the same bits either way).
    #[arg(long)]
    #[serde(default)]
    pub dense_on_host: bool,
    /// What a GPU's dense GEMMs (attention projections, dense MLPs, the
    /// head) take as inputs: bf16 (default; f32 accumulation and master
    /// weights, the tensor cores' rate) or f32 (the cpu's results to f32
    /// rounding, at the GPU's f32 rate). The experts' GEMMs are bf16 on a
    /// GPU either way; on the cpu see `--expert-gemm`.
    #[arg(long, value_name = "bf16|f32")]
    pub dense_gemm: Option<String>,
    /// On one GPU: how many of a layer's experts each pass stages and
    /// computes at once, each of their products one grouped GEMM (many
    /// small experts, as fine-grained MoE models have, then take one
    /// launch a product rather than one each). Default: 16 where cuBLAS
    /// has the grouped GEMM (CUDA 12.5 on), else 1; at most half the GPU's
    /// expert slots, and where records stream from the SSD, half the host
    /// tier's streaming slots. The same results whatever it is.
    #[arg(long, value_name = "N")]
    pub expert_group: Option<usize>,
    /// What the cpu's expert GEMMs take when the compute dtype is bf16:
    /// bf16 (default: the params as stored, activations rounded to bf16,
    /// f32 sums; AMX, `vdpbf16ps` or f32 FMAs, see `--bf16-kernel`) or f32 (the
    /// params widened, f32 activations). A GPU's experts are bf16 either
    /// way.
    #[arg(long, value_name = "bf16|f32")]
    pub expert_gemm: Option<String>,
    /// The cpu's bf16 GEMM kernel: auto (default: the fastest this CPU
    /// runs), amx-bf16 (AMX tiles), avx512-bf16 (`vdpbf16ps`), avx512-fma
    /// or avx2-fma (f32 FMAs on the widened pairs) or portable. AMX's sums
    /// differ from the others' in their last bits; any other gives the
    /// bits of a machine without AMX.
    #[arg(
        long,
        value_name = "auto|amx-bf16|avx512-bf16|avx512-fma|avx2-fma|portable"
    )]
    pub bf16_kernel: Option<String>,
    /// Token condensation (LUFFY): of the tokens sent to one expert, near
    /// duplicates (cosine similarity at or above a threshold) are computed
    /// once, their output copied. `off` (default), `adaptive` (LUFFY's
    /// threshold, falling from its start as the loss does), `adaptive:START`,
    /// or a fixed threshold such as 0.9. It changes results; the cpu
    /// backend only.
    #[arg(long, value_name = "off|adaptive[:START]|THRESHOLD")]
    pub condense: Option<String>,
    /// The most of an expert's rows condensation may fold into others (0
    /// to 1, default 0.5).
    #[arg(long, value_name = "SHARE")]
    pub condense_cap: Option<f32>,
    /// How condensation finds similar rows: `all-pairs` (each row against
    /// every earlier representative, default) or `lsh` (only those sharing
    /// a signature: bounded work where few rows condense, and it may miss
    /// some).
    #[arg(long, value_name = "lsh|all-pairs")]
    pub condense_search: Option<String>,
    /// With several devices: their collectives over a modeled link of
    /// this many GB/s each way (each takes at least the time such a link
    /// would; the same results), to measure a slower interconnect on one
    /// machine. Default: none (the in-process exchange's speed).
    #[arg(long, value_name = "GB_PER_S")]
    pub link_gb_per_s: Option<f64>,
    /// With --link-gb-per-s: each collective's latency in µs (default 10).
    #[arg(long, value_name = "US")]
    pub link_latency_us: Option<f64>,
    /// With several devices or ranks: each MoE layer's token exchange in
    /// up to N parts, each part on the wire while another part's experts
    /// compute (MPMoE's pipelined all-to-all; the same results). `off`
    /// (default), N (a layer has at most as many parts as a device has
    /// experts in it), or `auto`: each layer and pass in the parts (1-8)
    /// measured fastest over the first steps (1 part, then 2, 3, … two
    /// steps each, until a count is slower than the one before).
    #[arg(long, value_name = "off|auto|N")]
    pub pipeline: Option<String>,
    /// Held-out loss every N steps, 0 for never (default 50).
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Checkpoint every N steps, 0 for only at the end and on a signal
    /// (default 100).
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Device memory for the model, e.g. 2GiB (default 1GiB); with
    /// --backend cuda, 90 % of the GPU's free memory.
    #[arg(long)]
    pub device_mem: Option<String>,
    /// Host memory for expert records, e.g. 8GiB (default 4GiB).
    #[arg(long)]
    pub host_mem: Option<String>,
    /// Precision of the experts' compute copy: bf16, f16 or f32 (default bf16).
    #[arg(long)]
    pub compute_dtype: Option<String>,
    /// Threads of the CPU optimizer (default: one a core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Threads the cpu backend's compute (GEMMs, attention, activations)
    /// splits over (default: every core); fewer leave cores to the SSD
    /// tier's I/O and the optimizer. Changes no result.
    #[arg(long, value_name = "N")]
    pub compute_threads: Option<usize>,
    /// Where records stream from the SSD: the host slots they stream
    /// through (at least 3), the others keeping a record resident for the
    /// whole run; `all`: keep none (default 4).
    #[arg(long, value_parser = StreamSlots::parse)]
    pub host_stream_slots: Option<StreamSlots>,
    /// Where records stream from the SSD: host slots split into compute
    /// cells, one record's compute part each, for experts read for their
    /// compute params alone (default 0).
    #[arg(long, value_name = "N")]
    pub host_cell_slots: Option<usize>,
    /// How documents share a sequence: `apart` (each attends only to
    /// itself, its first token no target of the one before: fine-tuning on
    /// instruction data) or `stream` (one stream, as in pretraining).
    /// Defaults: apart for finetune, stream for train.
    #[arg(long, value_enum)]
    pub packing: Option<Packing>,
    /// Seed of the initialization and of the data order (default 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Also write the run's scalars (loss, held-out loss, learning rate,
    /// tokens/s, stalls, gradient norm) to this directory as TensorBoard
    /// event files, as the run goes (`tensorboard --logdir DIR`).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Write the trained model here at the end (safetensors, Hugging Face layout).
    #[arg(long)]
    pub export: Option<PathBuf>,
    /// Continue the run in --out from its last checkpoint.
    #[arg(long)]
    #[serde(skip)]
    pub resume: bool,
    /// No progress bar and no per-step lines: the run's header, its notes
    /// and its summary only (metrics.jsonl still has every step).
    #[arg(long)]
    #[serde(default)]
    pub quiet: bool,
    /// Record step N's timeline (every SSD call, wait, expert loop and
    /// update, on its thread) and write it to --out as
    /// timeline-step-N.json, a Chrome trace (open it in ui.perfetto.dev).
    #[arg(long, value_name = "N")]
    #[serde(skip)]
    pub timeline_step: Option<u64>,
}

/// The resolved options.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainOptions {
    pub preset: String,
    pub experts: Option<usize>,
    pub data: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub out: PathBuf,
    pub steps: u64,
    pub seq_len: usize,
    pub batch: usize,
    pub micro_batches: usize,
    #[serde(default = "one")]
    pub devices: usize,
    #[serde(default = "cpu")]
    pub backend: String,
    /// What `--backend auto` found, where it chose (not recorded: a
    /// resumed run keeps the backend it chose).
    #[serde(skip)]
    pub backend_chosen: Option<String>,
    /// How `--device-mem` was sized from the GPU's free memory, where no
    /// flag or file gave it (not recorded: a resumed run keeps its size).
    #[serde(skip)]
    pub device_mem_sized: Option<String>,
    /// The GPU of device 0 (`EngineConfig::first_gpu`): a rank's local
    /// rank where ranks as processes compute on GPUs (not recorded: each
    /// start takes it from its launcher).
    #[serde(skip)]
    pub first_gpu: usize,
    pub lr: f32,
    pub warmup: u64,
    pub min_lr_ratio: f32,
    pub weight_decay: f32,
    #[serde(default)]
    pub clip_grad_norm: Option<f32>,
    /// `--expert-group` (a run recorded before it took the device's own).
    #[serde(default)]
    pub expert_group: Option<usize>,
    /// `--train`'s groups (a run recorded before it trained all).
    #[serde(default = "all_groups")]
    pub train: Vec<String>,
    #[serde(default)]
    pub trace_routing: Option<PathBuf>,
    #[serde(default)]
    pub affinity_prefetch: bool,
    #[serde(default)]
    pub dense_on_host: bool,
    /// A run recorded before the option existed computed them in f32.
    #[serde(default = "dense_gemm_before_the_option")]
    pub dense_gemm: String,
    /// A run recorded before the option existed computed its experts on
    /// the cpu in f32.
    #[serde(default = "dense_gemm_before_the_option")]
    pub expert_gemm: String,
    /// A run recorded before the option used the fastest kernel.
    #[serde(default = "auto")]
    pub bf16_kernel: String,
    /// A run recorded before the option trained exactly.
    #[serde(default = "off")]
    pub condense: String,
    #[serde(default = "half")]
    pub condense_cap: f32,
    #[serde(default = "all_pairs")]
    pub condense_search: String,
    #[serde(default)]
    pub link_gb_per_s: Option<f64>,
    #[serde(default = "ten")]
    pub link_latency_us: f64,
    #[serde(default = "off")]
    pub pipeline: String,
    pub eval_every: u64,
    pub checkpoint_every: u64,
    pub device_mem: u64,
    pub host_mem: u64,
    pub compute_dtype: String,
    pub threads: usize,
    /// None: every core (`strata::machine_cores`).
    #[serde(default)]
    pub compute_threads: Option<usize>,
    #[serde(default = "default_stream_slots")]
    pub host_stream_slots: StreamSlots,
    #[serde(default)]
    pub host_cell_slots: usize,
    /// Set when a run starts (the mode's default where not given); a run
    /// recorded before the option packed as one stream.
    #[serde(default)]
    pub packing: Option<Packing>,
    pub seed: u64,
    pub export: Option<PathBuf>,
    #[serde(default)]
    pub tensorboard: Option<PathBuf>,
    pub resume: bool,
    pub quiet: bool,
    /// Command line only: the step whose timeline is written.
    #[serde(default, skip_serializing)]
    pub timeline_step: Option<u64>,
}

fn one() -> usize {
    1
}

fn all_groups() -> Vec<String> {
    strata::lm::TensorGroup::ALL
        .iter()
        .map(|g| g.name().to_string())
        .collect()
}

fn ten() -> f64 {
    10.0
}

fn off() -> String {
    "off".into()
}

fn auto() -> String {
    "auto".into()
}

fn half() -> f32 {
    0.5
}

fn all_pairs() -> String {
    "all-pairs".into()
}

fn cpu() -> String {
    "cpu".into()
}

fn default_stream_slots() -> StreamSlots {
    StreamSlots(EngineConfig::default().host_stream_slots)
}

/// `--packing`: how documents share a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Packing {
    /// Each document attends only to itself.
    Apart,
    /// One stream of tokens, across documents.
    Stream,
}

/// `--host-stream-slots`: a slot count, or `all` (`None`: keep no record
/// resident). In a TOML file or `run.json`, a number or `"all"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamSlots(pub Option<usize>);

impl TrainOptions {
    /// The GPUs the run's devices compute on (with `--backend cuda`).
    pub fn gpus(&self) -> std::ops::Range<usize> {
        self.first_gpu..self.first_gpu + self.devices
    }
}

impl StreamSlots {
    pub fn parse(value: &str) -> Result<Self, String> {
        let least = MIN_HOST_STREAM_SLOTS;
        if value == "all" {
            return Ok(Self(None));
        }
        match value.parse::<usize>() {
            Ok(n) if n >= least => Ok(Self(Some(n))),
            _ => Err(format!(
                "`{value}` is neither a slot count ({least} or more) nor `all`"
            )),
        }
    }
}

impl Serialize for StreamSlots {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Some(n) => s.serialize_u64(n as u64),
            None => s.serialize_str("all"),
        }
    }
}

impl<'de> Deserialize<'de> for StreamSlots {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Given {
            Count(u64),
            Word(String),
        }
        let text = match Given::deserialize(d)? {
            Given::Count(n) => n.to_string(),
            Given::Word(w) => w,
        };
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

fn dense_gemm_before_the_option() -> String {
    "f32".into()
}

macro_rules! pick {
    ($cli:ident, $file:ident, $field:ident, $default:expr) => {
        $cli.$field
            .clone()
            .or($file.$field.clone())
            .unwrap_or($default)
    };
}

impl TrainFlags {
    /// Whether the command line or `--config` sets `--device-mem`.
    pub fn gives_device_mem(&self) -> Result<bool, String> {
        Ok(self.device_mem.is_some()
            || match &self.config {
                Some(path) => read_toml(path)?.device_mem.is_some(),
                None => false,
            })
    }

    /// Reads `--config` (if any) and applies the defaults.
    pub fn resolve(&self) -> Result<TrainOptions, String> {
        let file = match &self.config {
            Some(path) => read_toml(path)?,
            None => TrainFlags::default(),
        };
        let cli = self;
        let threads = strata::machine_cores();
        Ok(TrainOptions {
            preset: pick!(cli, file, preset, "tiny".into()),
            experts: cli.experts.or(file.experts),
            data: pick!(cli, file, data, Vec::new()),
            tokenizer: cli.tokenizer.clone().or(file.tokenizer.clone()),
            out: pick!(cli, file, out, PathBuf::from("runs/default")),
            steps: pick!(cli, file, steps, 300),
            seq_len: pick!(cli, file, seq_len, 64),
            batch: pick!(cli, file, batch, 16),
            micro_batches: pick!(cli, file, micro_batches, 1),
            devices: pick!(cli, file, devices, 1),
            backend: pick!(cli, file, backend, "auto".into()),
            backend_chosen: None,
            device_mem_sized: None,
            first_gpu: 0,
            lr: pick!(cli, file, lr, 3e-3),
            warmup: pick!(cli, file, warmup, 20),
            min_lr_ratio: pick!(cli, file, min_lr_ratio, 0.1),
            weight_decay: pick!(cli, file, weight_decay, 0.0),
            clip_grad_norm: cli.clip_grad_norm.or(file.clip_grad_norm),
            expert_group: cli.expert_group.or(file.expert_group),
            train: pick!(cli, file, train, all_groups()),
            trace_routing: cli.trace_routing.clone().or(file.trace_routing.clone()),
            affinity_prefetch: cli.affinity_prefetch || file.affinity_prefetch,
            dense_on_host: cli.dense_on_host || file.dense_on_host,
            dense_gemm: pick!(cli, file, dense_gemm, "bf16".into()),
            expert_gemm: pick!(cli, file, expert_gemm, "bf16".into()),
            bf16_kernel: pick!(cli, file, bf16_kernel, auto()),
            condense: pick!(cli, file, condense, off()),
            condense_cap: pick!(cli, file, condense_cap, half()),
            condense_search: pick!(cli, file, condense_search, all_pairs()),
            link_gb_per_s: cli.link_gb_per_s.or(file.link_gb_per_s),
            pipeline: pick!(cli, file, pipeline, off()),
            link_latency_us: pick!(cli, file, link_latency_us, ten()),
            eval_every: pick!(cli, file, eval_every, 50),
            checkpoint_every: pick!(cli, file, checkpoint_every, 100),
            device_mem: parse_bytes(&pick!(cli, file, device_mem, "1GiB".into()))?,
            host_mem: parse_bytes(&pick!(cli, file, host_mem, "4GiB".into()))?,
            compute_dtype: pick!(cli, file, compute_dtype, "bf16".into()),
            threads: pick!(cli, file, threads, threads),
            compute_threads: cli.compute_threads.or(file.compute_threads),
            host_stream_slots: pick!(cli, file, host_stream_slots, default_stream_slots()),
            host_cell_slots: pick!(cli, file, host_cell_slots, 0),
            packing: cli.packing.or(file.packing),
            seed: pick!(cli, file, seed, 0),
            export: cli.export.clone().or(file.export.clone()),
            tensorboard: cli.tensorboard.clone().or(file.tensorboard.clone()),
            resume: cli.resume,
            quiet: cli.quiet || file.quiet,
            timeline_step: cli.timeline_step,
        })
    }
}

fn read_toml(path: &Path) -> Result<TrainFlags, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the config file {}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// "512MiB", "8GiB", "1.5G", "4096" (bytes) → bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (write e.g. 512MiB or 8GiB)"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use KiB, MiB, GiB, TiB)"
            ))
        }
    };
    Ok((value * scale as f64) as u64)
}

/// Bytes for people: 1.50 GiB.
pub fn show_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// A count of parameters for people: 1.2B, 46.7M, 67.4K, 640.
pub fn show_count(n: u64) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}K", n as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.1}B", n as f64 / 1e9),
    }
}

#[cfg(test)]
mod tests;
