use super::*;

/// A new run's dense GEMMs are bf16 unless told; a run recorded
/// before the option existed computed them in f32 and resumes so.
#[test]
fn dense_gemms_default_to_bf16_and_old_records_to_f32() {
    let o = TrainFlags::default().resolve().unwrap();
    assert_eq!(o.dense_gemm, "bf16");
    let told = TrainFlags {
        dense_gemm: Some("f32".into()),
        ..TrainFlags::default()
    };
    assert_eq!(told.resolve().unwrap().dense_gemm, "f32");
    let mut recorded = serde_json::to_value(&o).unwrap();
    recorded
        .as_object_mut()
        .unwrap()
        .remove("dense_gemm")
        .unwrap();
    let old: TrainOptions = serde_json::from_value(recorded).unwrap();
    assert_eq!(old.dense_gemm, "f32");
}

/// Likewise the cpu's expert GEMMs.
#[test]
fn expert_gemms_default_to_bf16_and_old_records_to_f32() {
    let o = TrainFlags::default().resolve().unwrap();
    assert_eq!(o.expert_gemm, "bf16");
    let told = TrainFlags {
        expert_gemm: Some("f32".into()),
        ..TrainFlags::default()
    };
    assert_eq!(told.resolve().unwrap().expert_gemm, "f32");
    let mut recorded = serde_json::to_value(&o).unwrap();
    let fields = recorded.as_object_mut().unwrap();
    fields.remove("expert_gemm").unwrap();
    let old: TrainOptions = serde_json::from_value(recorded).unwrap();
    assert_eq!(old.expert_gemm, "f32");
}

#[test]
fn counts_read_in_their_unit() {
    let shown = [640, 67_400, 46_700_000, 1_200_000_000].map(show_count);
    assert_eq!(shown, ["640", "67.4K", "46.7M", "1.2B"]);
}

#[test]
fn sizes_parse() {
    assert_eq!(parse_bytes("4096").unwrap(), 4096);
    assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
    assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
    assert!(parse_bytes("lots").is_err());
    assert!(parse_bytes("3 parsecs").is_err());
    assert_eq!(show_bytes(3 << 29), "1.50 GiB");
}

#[test]
fn flags_win_over_the_file_and_the_file_over_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.toml");
    std::fs::write(&path, "steps = 7\nlr = 0.01\nhost_mem = \"1GiB\"\n").unwrap();
    let flags = TrainFlags {
        config: Some(path.clone()),
        lr: Some(0.5),
        ..TrainFlags::default()
    };
    let o = flags.resolve().unwrap();
    assert_eq!((o.steps, o.lr, o.host_mem), (7, 0.5, 1 << 30));
    assert_eq!(o.seq_len, 64);
    std::fs::write(&path, "stepz = 7\n").unwrap();
    let err = flags.resolve().unwrap_err();
    assert!(err.contains("stepz"), "{err}");
    // `quiet` is a key like any other flag.
    std::fs::write(&path, "quiet = true\n").unwrap();
    assert!(flags.resolve().unwrap().quiet);
}

#[test]
fn host_stream_slots_are_a_count_or_all_in_flags_files_and_records() {
    assert_eq!(StreamSlots::parse("5"), Ok(StreamSlots(Some(5))));
    assert_eq!(StreamSlots::parse("all"), Ok(StreamSlots(None)));
    let err = StreamSlots::parse("2").unwrap_err();
    assert!(err.contains("3 or more"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.toml");
    let from_file = |text: &str| {
        std::fs::write(&path, text).unwrap();
        TrainFlags {
            config: Some(path.clone()),
            ..TrainFlags::default()
        }
        .resolve()
    };
    let o = from_file("host_stream_slots = 6\nhost_cell_slots = 1\ncompute_threads = 1\n");
    let o = o.unwrap();
    assert_eq!(o.host_stream_slots, StreamSlots(Some(6)));
    assert_eq!(o.compute_threads, Some(1));
    assert_eq!(o.host_cell_slots, 1);
    let o = from_file("host_stream_slots = \"all\"\n").unwrap();
    assert_eq!(o.host_stream_slots, StreamSlots(None));
    let err = from_file("host_stream_slots = 1\n").unwrap_err();
    assert!(err.contains("3 or more"), "{err}");
    // The engine's split by default; a run record keeps what was
    // chosen, and one written before these options reads as the default.
    let o = TrainFlags::default().resolve().unwrap();
    assert_eq!(
        (o.host_stream_slots.0, o.host_cell_slots),
        (EngineConfig::default().host_stream_slots, 0)
    );
    let chosen = TrainOptions {
        host_stream_slots: StreamSlots(None),
        host_cell_slots: 2,
        ..o.clone()
    };
    let text = serde_json::to_string(&chosen).unwrap();
    assert!(text.contains("\"host_stream_slots\":\"all\""), "{text}");
    let back: TrainOptions = serde_json::from_str(&text).unwrap();
    assert_eq!(back, chosen);
    let mut old: serde_json::Value = serde_json::to_value(&o).unwrap();
    for key in ["host_stream_slots", "host_cell_slots", "compute_threads"] {
        old.as_object_mut().unwrap().remove(key);
    }
    let back: TrainOptions = serde_json::from_value(old).unwrap();
    assert_eq!(back, o);
}

/// Every "(default X)" in the flags' help is the default: giving X
/// resolves to the same options as giving nothing.
#[test]
fn the_defaults_the_help_states_are_the_defaults() {
    use clap::{CommandFactory, FromArgMatches};
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        flags: TrainFlags,
    }
    let none = TrainFlags::default().resolve().unwrap();
    let mut checked = 0;
    for arg in Wrap::command().get_arguments() {
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let Some(stated) = help
            .split("(default ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
        else {
            continue;
        };
        let flag = format!("--{}", arg.get_long().unwrap());
        let matches = Wrap::command()
            .try_get_matches_from(["strata", flag.as_str(), stated])
            .unwrap_or_else(|e| panic!("{flag} {stated}: {e}"));
        let given = Wrap::from_arg_matches(&matches).unwrap().flags.resolve();
        assert_eq!(
            given.unwrap(),
            none,
            "{flag}'s help says (default {stated})"
        );
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} flags state a default");
}
