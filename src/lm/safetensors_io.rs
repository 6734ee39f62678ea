//! Import experts from Hugging Face safetensors checkpoints into a store,
//! and export them back, one expert at a time: each tensor is read from its
//! file by position and the store is written record by record, so the model
//! is never held in RAM.
//!
//! An expert's params in a record are its three SwiGLU matrices, each
//! row-major in its Hugging Face shape, concatenated:
//! `w1` (gate, F×D) | `w3` (up, F×D) | `w2` (down, D×F).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::Metadata;
use safetensors::Dtype as StDtype;

use strata_tiers::io::AlignedBuf;
use strata_tiers::{encode_compute, record_mut, Dtype, ExpertId, ExpertStore, TierError};

/// How a checkpoint names its experts' matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertNaming {
    /// `model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`
    Mixtral,
    /// `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`
    /// (Qwen2-MoE, OLMoE).
    QwenOlmoe,
}

impl ExpertNaming {
    /// The names of (gate, up, down) for one expert, where every decoder
    /// layer has experts (its layer is the decoder layer).
    pub fn names(self, e: ExpertId) -> [String; 3] {
        self.names_in(e.layer as usize, e.index as usize)
    }

    /// The names of (gate, up, down) for expert `i` of decoder layer `l`.
    pub fn names_in(self, l: usize, i: usize) -> [String; 3] {
        match self {
            ExpertNaming::Mixtral => ["w1", "w3", "w2"]
                .map(|w| format!("model.layers.{l}.block_sparse_moe.experts.{i}.{w}.weight")),
            ExpertNaming::QwenOlmoe => ["gate_proj", "up_proj", "down_proj"]
                .map(|w| format!("model.layers.{l}.mlp.experts.{i}.{w}.weight")),
        }
    }
}

/// The names of a checkpoint's expert tensors: its family's naming, and
/// the decoder layer of each of the engine's MoE layers where some layers
/// are dense (have no experts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertNames {
    naming: ExpertNaming,
    /// `sparse_layers[l]`: the decoder layer of MoE layer `l`; `None`:
    /// every decoder layer has experts.
    sparse_layers: Option<Vec<usize>>,
}

impl ExpertNames {
    /// `naming` where the engine's MoE layer `l` is decoder layer
    /// `sparse_layers[l]`.
    pub fn new(naming: ExpertNaming, sparse_layers: Vec<usize>) -> Self {
        Self {
            naming,
            sparse_layers: Some(sparse_layers),
        }
    }

    /// The names of (gate, up, down) for one expert.
    pub fn names(&self, e: ExpertId) -> [String; 3] {
        let layer = match &self.sparse_layers {
            Some(layers) => layers[e.layer as usize],
            None => e.layer as usize,
        };
        self.naming.names_in(layer, e.index as usize)
    }
}

impl From<ExpertNaming> for ExpertNames {
    /// Every decoder layer has experts.
    fn from(naming: ExpertNaming) -> Self {
        Self {
            naming,
            sparse_layers: None,
        }
    }
}

/// The expert shape an import expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    pub d_model: usize,
    pub d_ff: usize,
}

impl ExpertShape {
    pub fn params(&self) -> u64 {
        3 * self.d_model as u64 * self.d_ff as u64
    }
}

/// Where one tensor's bytes are.
struct TensorLocation {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Byte range within the file.
    start: u64,
    end: u64,
}

/// The open files of one checkpoint and where each tensor lives.
pub struct Checkpoint {
    files: Vec<(PathBuf, File)>,
    where_is: HashMap<String, TensorLocation>,
}

/// The largest header a safetensors file may have (the format's own limit).
const HEADER_BYTES_MAX: u64 = 100 << 20;

/// Reads a safetensors file's header: where its data starts, and its
/// tensors. The error says what is wrong with the file.
fn read_header(file: &File, file_len: u64) -> Result<(u64, Metadata), String> {
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0)
        .map_err(|_| format!("only {file_len} bytes: not a safetensors file"))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > HEADER_BYTES_MAX || 8 + header_len > file_len {
        return Err(format!(
            "its header claims {header_len} bytes of a {file_len}-byte file: not a safetensors \
             file, or a truncated one"
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact_at(&mut header, 8)
        .map_err(|e| format!("reading its header: {e}"))?;
    let metadata = serde_json::from_slice::<Metadata>(&header)
        .map_err(|e| format!("its header is not a valid safetensors header: {e}"))?;
    Ok((8 + header_len, metadata))
}

fn import_err(message: String) -> TierError {
    TierError::Import(message)
}

impl Checkpoint {
    /// Opens `model.safetensors.index.json` (sharded) or every
    /// `*.safetensors` file of `dir`.
    pub fn open(dir: &Path) -> Result<Self, TierError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| TierError::File {
                path: index_path.clone(),
                source: e,
            })?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                import_err(format!("{}: not valid JSON: {e}", index_path.display()))
            })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    import_err(format!(
                        "{}: no \"weight_map\" object",
                        index_path.display()
                    ))
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| TierError::File {
                    path: dir.to_path_buf(),
                    source: e,
                })?
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            found
        };
        if files.is_empty() {
            return Err(import_err(format!(
                "{}: no *.safetensors files (and no model.safetensors.index.json)",
                dir.display()
            )));
        }
        let mut opened = Vec::with_capacity(files.len());
        let mut where_is = HashMap::new();
        for path in files {
            let file_err = |e| TierError::File {
                path: path.clone(),
                source: e,
            };
            let file = File::open(&path).map_err(file_err)?;
            let file_len = file.metadata().map_err(file_err)?.len();
            let (data_start, metadata) = read_header(&file, file_len)
                .map_err(|why| import_err(format!("{}: {why}", path.display())))?;
            for (name, info) in metadata.tensors() {
                let (start, end) = info.data_offsets;
                if start > end || data_start + end as u64 > file_len {
                    return Err(import_err(format!(
                        "{}: {name} lies past the end of the file ({file_len} bytes; a truncated \
                         download? fetch the file again)",
                        path.display()
                    )));
                }
                where_is.insert(
                    name,
                    TensorLocation {
                        file: opened.len(),
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: data_start + start as u64,
                        end: data_start + end as u64,
                    },
                );
            }
            opened.push((path, file));
        }
        Ok(Self {
            files: opened,
            where_is,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.where_is.contains_key(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.where_is.keys().map(String::as_str)
    }

    /// Guesses the naming from the tensors present.
    pub fn naming(&self) -> Result<ExpertNaming, TierError> {
        let first = ExpertId::new(0, 0);
        for naming in [ExpertNaming::Mixtral, ExpertNaming::QwenOlmoe] {
            if self.contains(&naming.names(first)[0]) {
                return Ok(naming);
            }
        }
        Err(import_err(
            "no expert weights under Mixtral (block_sparse_moe.experts.N.w1) or \
             Qwen2-MoE/OLMoE (mlp.experts.N.gate_proj) names"
                .to_string(),
        ))
    }

    /// Reads a tensor of `shape` as f32 into `out` (bf16/f16 widen exactly).
    pub fn read_f32(&self, name: &str, shape: &[usize], out: &mut [f32]) -> Result<(), TierError> {
        let at = self
            .where_is
            .get(name)
            .ok_or_else(|| import_err(format!("tensor {name} is missing from the checkpoint")))?;
        if at.shape != shape {
            return Err(import_err(format!(
                "{name} has shape {:?}, the config implies {:?}",
                at.shape, shape
            )));
        }
        let n: usize = shape.iter().product();
        assert_eq!(out.len(), n, "output sized for the shape");
        let (path, file) = &self.files[at.file];
        let mut data = vec![0u8; (at.end - at.start) as usize];
        file.read_exact_at(&mut data, at.start)
            .map_err(|e| TierError::File {
                path: path.clone(),
                source: e,
            })?;
        let element_bytes = match at.dtype {
            StDtype::F32 => 4,
            StDtype::BF16 | StDtype::F16 => 2,
            _ => 0,
        };
        if element_bytes != 0 && data.len() != n * element_bytes {
            return Err(import_err(format!(
                "{name}: {} bytes of data for {n} {:?} elements",
                data.len(),
                at.dtype
            )));
        }
        match at.dtype {
            StDtype::F32 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            StDtype::BF16 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            StDtype::F16 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            other => {
                return Err(import_err(format!(
                    "{name} is {other:?}; only F32, BF16 and F16 tensors can be imported"
                )))
            }
        }
        Ok(())
    }
}

/// Imports every expert of the store's layout from `checkpoint`, with zero
/// moments, writes each record at `step`, and commits checkpoint `step`.
/// `progress(done, total)` is called after each expert.
pub fn import_experts(
    checkpoint: &Checkpoint,
    names: impl Into<ExpertNames>,
    shape: ExpertShape,
    store: &ExpertStore,
    step: u64,
    mut progress: impl FnMut(u64, u64),
) -> Result<(), TierError> {
    let names = names.into();
    let layout = store.layout();
    if layout.params_per_expert != shape.params() {
        return Err(import_err(format!(
            "the store holds {} params an expert, but 3 × d_model {} × d_ff {} = {}",
            layout.params_per_expert,
            shape.d_model,
            shape.d_ff,
            shape.params()
        )));
    }
    // Report every missing tensor up front, before anything is written.
    let missing: Vec<String> = (0..layout.expert_count())
        .flat_map(|slot| names.names(layout.expert_at(slot)))
        .filter(|name| !checkpoint.contains(name))
        .collect();
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(3).map(String::as_str).collect();
        return Err(import_err(format!(
            "{} expert tensors are missing from the checkpoint, e.g. {}",
            missing.len(),
            shown.join(", ")
        )));
    }
    let (d, f) = (shape.d_model, shape.d_ff);
    let mut record = AlignedBuf::zeroed(layout.record_bytes() as usize);
    let total = layout.expert_count();
    for slot in 0..total {
        let expert = layout.expert_at(slot);
        let [gate, up, down] = names.names(expert);
        {
            let r = record_mut(&layout, record.as_mut_slice())?;
            let (w1, rest) = r.master.split_at_mut(d * f);
            let (w3, w2) = rest.split_at_mut(d * f);
            checkpoint.read_f32(&gate, &[f, d], w1)?;
            checkpoint.read_f32(&up, &[f, d], w3)?;
            checkpoint.read_f32(&down, &[d, f], w2)?;
            r.m.fill(0.0);
            r.v.fill(0.0);
            encode_compute(layout.compute_dtype, r.master, r.compute);
        }
        store.write(expert, step, record.as_mut_slice())?;
        progress(slot + 1, total);
    }
    store.checkpoint(step)
}

/// One tensor of a safetensors file being written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.bytes()
    }
}

fn st_dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "F32",
        Dtype::Bf16 => "BF16",
        Dtype::F16 => "F16",
    }
}

/// Writes tensors to safetensors files of at most `shard_bytes_max` each
/// (one tensor never splits), streaming each tensor's bytes from
/// `fill(index, out)`. With more than one shard, also writes
/// `model.safetensors.index.json`. Files are written under temporary
/// names and renamed into place at the end, so nothing is left half-way.
pub fn write_safetensors(
    dir: &Path,
    specs: &[TensorSpec],
    shard_bytes_max: u64,
    mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), TierError>,
) -> Result<Vec<PathBuf>, TierError> {
    let shards = shards_of(specs, shard_bytes_max);
    let count = shards.len();
    let name_of = |k: usize| {
        if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", k + 1, count)
        }
    };
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (k, members) in shards.iter().enumerate() {
        for &i in members {
            weight_map.insert(specs[i].name.clone(), name_of(k));
        }
        let final_path = dir.join(name_of(k));
        let tmp_path = dir.join(format!(".{}.partial", name_of(k)));
        write_shard(&tmp_path, specs, members, &mut fill)?;
        written.push((tmp_path, final_path));
    }
    if count > 1 {
        let total: u64 = specs.iter().map(TensorSpec::bytes).sum();
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let final_path = dir.join("model.safetensors.index.json");
        let tmp_path = dir.join(".model.safetensors.index.json.partial");
        std::fs::write(
            &tmp_path,
            serde_json::to_string_pretty(&index).expect("JSON"),
        )
        .map_err(|e| file_error(&tmp_path, e))?;
        written.push((tmp_path, final_path));
    }
    let mut finals = Vec::new();
    for (tmp, fin) in written {
        std::fs::rename(&tmp, &fin).map_err(|e| file_error(&fin, e))?;
        finals.push(fin);
    }
    Ok(finals)
}

/// The tensors of each shard, in order: a shard takes tensors until the
/// next would take it past `shard_bytes_max` (a tensor larger than that
/// has a shard of its own).
fn shards_of(specs: &[TensorSpec], shard_bytes_max: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut shard_bytes = 0u64;
    for (i, spec) in specs.iter().enumerate() {
        if shard_bytes > 0 && shard_bytes + spec.bytes() > shard_bytes_max {
            shards.push(Vec::new());
            shard_bytes = 0;
        }
        shards.last_mut().expect("non-empty").push(i);
        shard_bytes += spec.bytes();
    }
    shards
}

/// One safetensors file at `path` holding the tensors `members` of
/// `specs` (their bytes from `fill`), synced to the disk.
fn write_shard(
    path: &Path,
    specs: &[TensorSpec],
    members: &[usize],
    fill: &mut impl FnMut(usize, &mut [u8]) -> Result<(), TierError>,
) -> Result<(), TierError> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for &i in members {
        let s = &specs[i];
        header.insert(
            s.name.clone(),
            serde_json::json!({
                "dtype": st_dtype_name(s.dtype),
                "shape": s.shape,
                "data_offsets": [offset, offset + s.bytes()],
            }),
        );
        offset += s.bytes();
    }
    header.insert(
        "__metadata__".to_string(),
        serde_json::json!({ "format": "pt" }),
    );
    let mut text = serde_json::to_string(&header).expect("plain JSON");
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let file = File::create(path).map_err(|e| file_error(path, e))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(text.len() as u64).to_le_bytes())
        .and_then(|_| out.write_all(text.as_bytes()))
        .map_err(|e| file_error(path, e))?;
    let mut buf = Vec::new();
    for &i in members {
        buf.resize(specs[i].bytes() as usize, 0);
        fill(i, &mut buf)?;
        out.write_all(&buf).map_err(|e| file_error(path, e))?;
    }
    let file = out
        .into_inner()
        .map_err(|e| file_error(path, e.into_error()))?;
    file.sync_all().map_err(|e| file_error(path, e))
}

fn file_error(path: &Path, e: std::io::Error) -> TierError {
    TierError::File {
        path: path.to_path_buf(),
        source: e,
    }
}

/// The expert tensors of a store, named for `naming`, in `dtype`.
pub fn expert_tensor_specs(
    store: &ExpertStore,
    names: impl Into<ExpertNames>,
    shape: ExpertShape,
    dtype: Dtype,
) -> Vec<TensorSpec> {
    let names = names.into();
    let layout = store.layout();
    let (d, f) = (shape.d_model, shape.d_ff);
    (0..layout.expert_count())
        .flat_map(|slot| {
            let [gate, up, down] = names.names(layout.expert_at(slot));
            [(gate, vec![f, d]), (up, vec![f, d]), (down, vec![d, f])]
        })
        .map(|(name, shape)| TensorSpec { name, dtype, shape })
        .collect()
}

/// Exports every expert's f32 master params (rounded to `dtype`) into
/// safetensors files under `dir`, one expert read at a time.
pub fn export_experts(
    store: &ExpertStore,
    names: impl Into<ExpertNames>,
    shape: ExpertShape,
    dtype: Dtype,
    dir: &Path,
    shard_bytes_max: u64,
    mut progress: impl FnMut(u64, u64),
) -> Result<Vec<PathBuf>, TierError> {
    let layout = store.layout();
    if layout.params_per_expert != shape.params() {
        return Err(import_err(format!(
            "the store holds {} params an expert, not 3 × {} × {}",
            layout.params_per_expert, shape.d_model, shape.d_ff
        )));
    }
    let specs = expert_tensor_specs(store, names, shape, dtype);
    let (d, f) = (shape.d_model, shape.d_ff);
    let mut record = AlignedBuf::zeroed(layout.record_bytes() as usize);
    let mut loaded: Option<u64> = None;
    let total = layout.expert_count();
    write_safetensors(dir, &specs, shard_bytes_max, |i, out| {
        let slot = (i / 3) as u64;
        if loaded != Some(slot) {
            store.read(
                layout.expert_at(slot),
                strata_tiers::Parts::Full,
                record.as_mut_slice(),
            )?;
            loaded = Some(slot);
            progress(slot + 1, total);
        }
        let r = record_mut(&layout, record.as_mut_slice())?;
        let part = &r.master[(i % 3) * d * f..(i % 3 + 1) * d * f];
        encode_compute(dtype, part, out);
        Ok(())
    })
}
