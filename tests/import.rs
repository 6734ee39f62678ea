//! Safetensors import and export: sharded checkpoints in, the same layout
//! out, and clear errors for missing experts, wrong shapes and dtypes.

use std::path::Path;

use half::bf16;
use strata::lm::safetensors_io::{
    export_experts, import_experts, write_safetensors, Checkpoint, ExpertNaming, ExpertShape,
    TensorSpec,
};
use strata_tiers::io::{AlignedBuf, MemFile};
use strata_tiers::{record_mut, Dtype, ExpertId, ExpertStore, Layout, Parts, TierError};

const SHAPE: ExpertShape = ExpertShape {
    d_model: 8,
    d_ff: 12,
};

fn layout() -> Layout {
    Layout {
        layers: 2,
        experts_per_layer: 3,
        params_per_expert: SHAPE.params(),
        compute_dtype: Dtype::Bf16,
        moments: true,
    }
}

/// The value of element k of matrix `which` (0 gate, 1 up, 2 down) of `e`.
fn value(e: ExpertId, which: usize, k: usize) -> f32 {
    let x = (e.layer * 100 + e.index * 10) as f32 + which as f32 + k as f32 * 0.01;
    bf16::from_f32(x.sin()).to_f32()
}

/// Writes a checkpoint of bf16 tensors (plus one dense tensor) into `dir`.
fn write_checkpoint(dir: &Path, naming: ExpertNaming, shard_bytes_max: u64, skip: Option<&str>) {
    let (d, f) = (SHAPE.d_model, SHAPE.d_ff);
    let mut specs = vec![TensorSpec {
        name: "model.embed_tokens.weight".to_string(),
        dtype: Dtype::Bf16,
        shape: vec![16, d],
    }];
    let mut owners = vec![None];
    for l in 0..2 {
        for i in 0..3 {
            let e = ExpertId::new(l, i);
            for (which, name) in naming.names(e).into_iter().enumerate() {
                if Some(name.as_str()) == skip {
                    continue;
                }
                let shape = if which == 2 { vec![d, f] } else { vec![f, d] };
                specs.push(TensorSpec {
                    name,
                    dtype: Dtype::Bf16,
                    shape,
                });
                owners.push(Some((e, which)));
            }
        }
    }
    write_safetensors(dir, &specs, shard_bytes_max, |i, out| {
        for (k, c) in out.chunks_exact_mut(2).enumerate() {
            let v = match owners[i] {
                Some((e, which)) => value(e, which, k),
                None => 0.5,
            };
            c.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
        }
        Ok(())
    })
    .unwrap();
}

fn new_store() -> ExpertStore {
    ExpertStore::create_on(Box::new(MemFile::new()), layout()).unwrap()
}

fn check_store(store: &ExpertStore) {
    let l = layout();
    let mut buf = AlignedBuf::zeroed(l.record_bytes() as usize);
    let per = SHAPE.d_model * SHAPE.d_ff;
    for slot in 0..l.expert_count() {
        let e = l.expert_at(slot);
        store.read(e, Parts::Full, buf.as_mut_slice()).unwrap();
        let r = record_mut(&l, buf.as_mut_slice()).unwrap();
        for (k, &x) in r.master.iter().enumerate() {
            assert_eq!(x, value(e, k / per, k % per), "expert {e} param {k}");
        }
        assert!(r.m.iter().chain(r.v.iter()).all(|&x| x == 0.0));
        for (k, c) in r.compute.chunks_exact(2).enumerate() {
            assert_eq!(bf16::from_le_bytes([c[0], c[1]]).to_f32(), r.master[k]);
        }
    }
}

#[test]
fn a_sharded_mixtral_checkpoint_imports_exports_and_reimports_exactly() {
    let dir = tempfile::tempdir().unwrap();
    // ~1.2 KB shards: the 18 expert tensors spread over many files.
    write_checkpoint(dir.path(), ExpertNaming::Mixtral, 1200, None);
    assert!(dir.path().join("model.safetensors.index.json").exists());
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(checkpoint.naming().unwrap(), ExpertNaming::Mixtral);
    let store = new_store();
    let mut calls = 0;
    import_experts(
        &checkpoint,
        ExpertNaming::Mixtral,
        SHAPE,
        &store,
        0,
        |done, total| {
            calls += 1;
            assert_eq!(total, 6);
            assert!(done <= total);
        },
    )
    .unwrap();
    assert_eq!(calls, 6);
    check_store(&store);

    let out = tempfile::tempdir().unwrap();
    let files = export_experts(
        &store,
        ExpertNaming::Mixtral,
        SHAPE,
        Dtype::Bf16,
        out.path(),
        1 << 30,
        |_, _| {},
    )
    .unwrap();
    assert_eq!(files, vec![out.path().join("model.safetensors")]);
    // The export parses with the reference safetensors reader.
    let bytes = std::fs::read(&files[0]).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(parsed.len(), 18);
    let again = new_store();
    let reopened = Checkpoint::open(out.path()).unwrap();
    import_experts(
        &reopened,
        ExpertNaming::Mixtral,
        SHAPE,
        &again,
        0,
        |_, _| {},
    )
    .unwrap();
    check_store(&again);
    // No partial files are left behind.
    let leftovers = std::fs::read_dir(out.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("partial")
        })
        .count();
    assert_eq!(leftovers, 0);
}

#[test]
fn qwen_and_olmoe_names_are_detected() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), ExpertNaming::QwenOlmoe, 1 << 30, None);
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(checkpoint.naming().unwrap(), ExpertNaming::QwenOlmoe);
    let store = new_store();
    import_experts(
        &checkpoint,
        ExpertNaming::QwenOlmoe,
        SHAPE,
        &store,
        3,
        |_, _| {},
    )
    .unwrap();
    assert_eq!(store.committed_step(), 3);
    check_store(&store);
}

#[test]
fn missing_experts_are_listed_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let gone = "model.layers.1.block_sparse_moe.experts.2.w2.weight";
    write_checkpoint(dir.path(), ExpertNaming::Mixtral, 1 << 30, Some(gone));
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let store = new_store();
    let err = import_experts(
        &checkpoint,
        ExpertNaming::Mixtral,
        SHAPE,
        &store,
        0,
        |_, _| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains(gone), "{err}");
    assert!(matches!(
        store.read(
            ExpertId::new(0, 0),
            Parts::Full,
            AlignedBuf::zeroed(1 << 16).as_mut_slice()
        ),
        Err(TierError::NeverWritten { .. })
    ));
}

#[test]
fn wrong_shapes_and_dtypes_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), ExpertNaming::Mixtral, 1 << 30, None);
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let wide = ExpertShape {
        d_model: 8,
        d_ff: 24,
    };
    let store = ExpertStore::create_on(
        Box::new(MemFile::new()),
        Layout {
            params_per_expert: wide.params(),
            ..layout()
        },
    )
    .unwrap();
    let err = import_experts(
        &checkpoint,
        ExpertNaming::Mixtral,
        wide,
        &store,
        0,
        |_, _| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("has shape [12, 8]"), "{err}");
    let err = import_experts(
        &checkpoint,
        ExpertNaming::Mixtral,
        wide,
        &new_store(),
        0,
        |_, _| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("params an expert"), "{err}");

    // An integer tensor where a weight should be.
    let bad = tempfile::tempdir().unwrap();
    let name = "model.layers.0.block_sparse_moe.experts.0.w1.weight";
    let data = vec![0u8; 12 * 8 * 8];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![12, 8], &data).unwrap();
    safetensors::serialize_to_file([(name, view)], &None, &bad.path().join("model.safetensors"))
        .unwrap();
    let checkpoint = Checkpoint::open(bad.path()).unwrap();
    let mut out = vec![0f32; 96];
    let err = checkpoint.read_f32(name, &[12, 8], &mut out).unwrap_err();
    assert!(err.to_string().contains("only F32, BF16 and F16"), "{err}");

    let empty = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(empty.path()).err().unwrap();
    assert!(err.to_string().contains("no *.safetensors"), "{err}");
}

/// A shard cut short (an interrupted download) or one that is not a
/// safetensors file at all is refused when the checkpoint is opened, naming
/// the file and what is wrong, before any expert is imported.
#[test]
fn truncated_and_foreign_shards_are_named() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), ExpertNaming::Mixtral, 1 << 30, None);
    let shard = dir.path().join("model.safetensors");
    let full = std::fs::metadata(&shard).unwrap().len();

    // Cut inside the tensor data: the tensors past the cut are named.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(full - 10)
        .unwrap();
    let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("lies past the end of the file"), "{err}");
    assert!(err.contains("truncated download"), "{err}");

    // Cut inside the header.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(20)
        .unwrap();
    let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
    assert!(err.contains("its header claims"), "{err}");

    // Something else under the name.
    std::fs::write(&shard, b"<html>rate limited</html>").unwrap();
    let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("not a safetensors file"), "{err}");
    std::fs::write(&shard, b"tiny").unwrap();
    let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
    assert!(err.contains("only 4 bytes"), "{err}");
}
