//! `strata bench overlap` through the binary: its JSON lines and its
//! refusal of a directory that is not there.

use std::process::Command;

fn strata_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

#[test]
fn bench_overlap_prints_three_arms_and_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = strata_bin()
        .args(["bench", "overlap", "--json", "--record-mib", "1"])
        .args(["--records", "4", "--rounds", "1", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let arms: Vec<&str> = lines.iter().map(|l| l["arm"].as_str().unwrap()).collect();
    assert_eq!(arms, ["io", "compute", "both", "summary"]);
    assert!(lines[3]["both_over_bound"].as_f64().unwrap() > 0.0);
    assert!(lines[2]["io_s"].as_f64().unwrap() > 0.0);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn bench_overlap_names_a_missing_directory() {
    let out = strata_bin()
        .args(["bench", "overlap", "--dir", "/no/such/strata/dir"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--dir /no/such/strata/dir"), "{err}");
}
