//! `metrics.jsonl`, the run's record of every step: one JSON object a
//! line, each line written whole or not at all. On resume it is cut back
//! to the checkpoint the run goes on from, so every step appears once,
//! however the previous process ended.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

pub(super) struct MetricsLog {
    path: PathBuf,
    file: File,
    /// Bytes of whole lines in the file.
    len: u64,
}

impl MetricsLog {
    /// Opens `path` for lines after step `from`. Lines of later steps
    /// (written after the last checkpoint by a process that then died) and
    /// a torn last line (a full disk, a crash mid-write) are dropped first.
    pub fn open(path: &Path, from: u64) -> Result<Self, String> {
        let cannot = |e: std::io::Error| format!("cannot write {}: {e}", path.display());
        if let Ok(text) = std::fs::read_to_string(path) {
            let kept: String = text
                .split_inclusive('\n')
                .filter(|line| line.ends_with('\n') && step_of(line).is_some_and(|s| s <= from))
                .collect();
            if kept.len() != text.len() {
                let partial = path.with_extension("jsonl.partial");
                std::fs::write(&partial, &kept).map_err(cannot)?;
                std::fs::rename(&partial, path).map_err(cannot)?;
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let len = file.metadata().map_err(cannot)?.len();
        Ok(Self {
            path: path.to_path_buf(),
            file,
            len,
        })
    }

    /// Appends `line` (no newline) whole, or leaves the file as it was.
    pub fn append(&mut self, line: &str) -> Result<(), String> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        match self.file.write_all(&bytes) {
            Ok(()) => {
                self.len += bytes.len() as u64;
                Ok(())
            }
            Err(e) => {
                // Cut a partly written line off again.
                let _ = self.file.set_len(self.len);
                Err(format!("cannot write {}: {e}", self.path.display()))
            }
        }
    }
}

/// The `"loss"` of the first step in `path` and of step `last` (a run's
/// record up to a checkpoint): what an adaptive condensation threshold
/// follows. `None` for what the file does not hold.
pub(super) fn first_and_last_loss(path: &Path, last: u64) -> (Option<f32>, Option<f32>) {
    let Ok(text) = std::fs::read_to_string(path) else {
        return (None, None);
    };
    let mut steps = text.lines().filter_map(|line| {
        let value: serde_json::Value = serde_json::from_str(line).ok()?;
        let step = value.get("step")?.as_u64()?;
        Some((step, value.get("loss")?.as_f64()? as f32))
    });
    let first = steps.next();
    let at_last = first
        .into_iter()
        .chain(steps)
        .find(|&(s, _)| s == last)
        .map(|(_, l)| l);
    (first.map(|(_, l)| l), at_last)
}

/// The `"step"` of one line, if it is a JSON object that has one.
fn step_of(line: &str) -> Option<u64> {
    let value: serde_json::Value = serde_json::from_str(line).ok()?;
    value.get("step")?.as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_steps_and_a_torn_line_are_cut_on_resume() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let lines = [
            r#"{"step":1,"loss":2.0}"#,
            r#"{"step":2,"loss":1.9}"#,
            r#"{"step":2,"checkpoint":true}"#,
            r#"{"step":3,"loss":1.8}"#,
        ];
        std::fs::write(&path, lines.join("\n") + "\n" + r#"{"step":4,"lo"#).unwrap();
        let mut log = MetricsLog::open(&path, 2).unwrap();
        log.append(r#"{"step":3,"loss":1.7}"#).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let want = [lines[0], lines[1], lines[2], r#"{"step":3,"loss":1.7}"#].join("\n") + "\n";
        assert_eq!(text, want);
    }

    #[test]
    fn a_new_run_starts_an_empty_log() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, 0).unwrap();
        log.append(r#"{"step":1}"#).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"step\":1}\n");
    }
}
