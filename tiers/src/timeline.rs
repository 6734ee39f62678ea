//! [`Timeline`]: when each thread did what during a step — the SSD calls
//! (which records, which parts), the waits on them, each layer's expert
//! loop — kept in a list bounded at construction and written as Chrome
//! trace events (open the file in <https://ui.perfetto.dev> or
//! `chrome://tracing`). Nothing is recorded unless a caller hands one to
//! the host tier (`HostCacheConfig::timeline`) or the engine.
//!
//! It answers what a step's totals cannot: where in the step the disk
//! sat idle while the host computed, and why.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One span of work on one thread.
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineEvent {
    /// The kind of work: `"ssd"` (a batch of reads or writes), `"stall"`
    /// (a thread waiting), `"host"` (a compute part copied between a
    /// record slot and a compute cell), `"experts"` (a layer's expert
    /// loop), `"dense"` (a network's dense kernel: a GEMM, attention, the
    /// head), `"optimizer"` (an expert's update), `"step"`.
    pub category: &'static str,
    pub name: Cow<'static, str>,
    /// The recording thread's name (its id where it has none).
    pub thread: String,
    /// Since the timeline's origin (its construction or last `take`).
    pub start: Duration,
    pub duration: Duration,
    /// Free text: the experts of an SSD batch, the expert waited for.
    pub detail: String,
}

impl TimelineEvent {
    pub fn end(&self) -> Duration {
        self.start + self.duration
    }
}

/// What a timeline held when taken.
#[derive(Clone, Debug, Default)]
pub struct TimelineRecord {
    /// In the order they ended.
    pub events: Vec<TimelineEvent>,
    /// Events that did not fit in the capacity and were not kept.
    pub dropped: u64,
}

/// A bounded, thread-safe list of [`TimelineEvent`]s.
pub struct Timeline {
    capacity: usize,
    inner: Mutex<Recorded>,
}

struct Recorded {
    origin: Instant,
    events: Vec<TimelineEvent>,
    dropped: u64,
}

impl std::fmt::Debug for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("Timeline")
            .field("capacity", &self.capacity)
            .field("events", &inner.events.len())
            .field("dropped", &inner.dropped)
            .finish()
    }
}

impl Timeline {
    /// Keeps at most `capacity` events between two `take`s; later ones are
    /// counted in `TimelineRecord::dropped`.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::new(Recorded {
                origin: Instant::now(),
                events: Vec::with_capacity(capacity.min(1 << 12)),
                dropped: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Recorded> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records work that ran on this thread from `start` to now.
    pub fn record(
        &self,
        category: &'static str,
        name: impl Into<Cow<'static, str>>,
        start: Instant,
        detail: impl FnOnce() -> String,
    ) {
        let end = Instant::now();
        let thread = std::thread::current();
        let thread = match thread.name() {
            Some(name) => name.to_string(),
            None => format!("{:?}", thread.id()),
        };
        self.push(thread, category, name.into(), (start, end), detail);
    }

    /// Records work that ran from `start` to `end` on `thread`, which is
    /// not this one (a GPU's stream, timed by its own events).
    pub fn record_on(
        &self,
        thread: &str,
        category: &'static str,
        name: impl Into<Cow<'static, str>>,
        span: (Instant, Instant),
    ) {
        self.push(thread.to_string(), category, name.into(), span, String::new);
    }

    fn push(
        &self,
        thread: String,
        category: &'static str,
        name: Cow<'static, str>,
        (start, end): (Instant, Instant),
        detail: impl FnOnce() -> String,
    ) {
        let mut inner = self.lock();
        if inner.events.len() >= self.capacity {
            inner.dropped += 1;
            return;
        }
        // Work begun before the origin (a `take` in between) starts at it.
        let start = start.max(inner.origin);
        let event = TimelineEvent {
            category,
            name,
            thread,
            start: start - inner.origin,
            duration: end.saturating_duration_since(start),
            detail: detail(),
        };
        inner.events.push(event);
    }

    /// Everything recorded since the last `take` (or construction), and
    /// starts afresh with its origin at now.
    pub fn take(&self) -> TimelineRecord {
        let mut inner = self.lock();
        inner.origin = Instant::now();
        TimelineRecord {
            events: std::mem::take(&mut inner.events),
            dropped: std::mem::take(&mut inner.dropped),
        }
    }
}

/// Records its span on `timeline` (if any) when dropped.
pub struct TimelineSpan<'a> {
    timeline: Option<&'a Timeline>,
    category: &'static str,
    name: Cow<'static, str>,
    start: Instant,
    detail: String,
}

impl<'a> TimelineSpan<'a> {
    /// A span from now until dropped; a no-op without a timeline.
    pub fn start(
        timeline: Option<&'a Timeline>,
        category: &'static str,
        name: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            timeline,
            category,
            name: name.into(),
            start: Instant::now(),
            detail: String::new(),
        }
    }

    /// Sets the span's detail (computed only where there is a timeline).
    pub fn with_detail(mut self, detail: impl FnOnce() -> String) -> Self {
        if self.timeline.is_some() {
            self.detail = detail();
        }
        self
    }
}

impl Drop for TimelineSpan<'_> {
    fn drop(&mut self) {
        if let Some(timeline) = self.timeline {
            let name = std::mem::take(&mut self.name);
            let detail = std::mem::take(&mut self.detail);
            timeline.record(self.category, name, self.start, || detail);
        }
    }
}

/// The union of `events`' spans clipped to `[from, to)`: how long at least
/// one of them was under way there.
pub fn covered(events: &[&TimelineEvent], from: Duration, to: Duration) -> Duration {
    let mut spans: Vec<(Duration, Duration)> = events
        .iter()
        .map(|e| (e.start.max(from), e.end().min(to)))
        .filter(|(a, b)| a < b)
        .collect();
    spans.sort();
    let mut total = Duration::ZERO;
    let mut open: Option<(Duration, Duration)> = None;
    for (a, b) in spans {
        open = match open {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    if let Some((s, e)) = open {
        total += e - s;
    }
    total
}

/// Writes `events` as a Chrome trace (JSON object format): one complete
/// event (`"ph":"X"`) each, times in microseconds, one track per thread,
/// named by its thread.
pub fn write_chrome_trace(events: &[TimelineEvent], out: &mut impl Write) -> std::io::Result<()> {
    let mut tids: HashMap<&str, usize> = HashMap::new();
    let mut trace = Vec::with_capacity(events.len() + 8);
    for e in events {
        let next = tids.len() + 1;
        let tid = *tids.entry(e.thread.as_str()).or_insert(next);
        trace.push(serde_json::json!({
            "name": e.name,
            "cat": e.category,
            "ph": "X",
            "ts": e.start.as_secs_f64() * 1e6,
            "dur": e.duration.as_secs_f64() * 1e6,
            "pid": 1,
            "tid": tid,
            "args": { "detail": e.detail },
        }));
    }
    let mut named: Vec<_> = tids.into_iter().collect();
    named.sort_by_key(|&(_, tid)| tid);
    for (thread, tid) in named {
        trace.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
            "args": { "name": thread },
        }));
    }
    let doc = serde_json::json!({ "traceEvents": trace, "displayTimeUnit": "ms" });
    serde_json::to_writer(&mut *out, &doc)?;
    out.write_all(b"\n")
}

/// The categories strata records, as `TimelineEvent::category` holds them.
const CATEGORIES: [&str; 7] = [
    "ssd",
    "stall",
    "host",
    "experts",
    "dense",
    "optimizer",
    "step",
];

/// Reads back a Chrome trace [`write_chrome_trace`] wrote: its complete
/// events, each on its named thread (a category strata does not record
/// reads as `"other"`). Errors name what is not such a trace.
pub fn read_chrome_trace(text: &str) -> Result<Vec<TimelineEvent>, String> {
    let doc: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let Some(trace) = doc["traceEvents"].as_array() else {
        return Err("not a Chrome trace: it has no traceEvents".into());
    };
    let names: HashMap<u64, String> = trace
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .filter_map(|e| Some((e["tid"].as_u64()?, e["args"]["name"].as_str()?.to_string())))
        .collect();
    let micros = |v: &serde_json::Value| v.as_f64().filter(|x| x.is_finite() && *x >= 0.0);
    let mut events = Vec::new();
    for e in trace.iter().filter(|e| e["ph"] == "X") {
        let (Some(ts), Some(dur)) = (micros(&e["ts"]), micros(&e["dur"])) else {
            return Err(format!("an event without a time or duration: {e}"));
        };
        let cat = e["cat"].as_str().unwrap_or("");
        let tid = e["tid"].as_u64().unwrap_or(0);
        events.push(TimelineEvent {
            category: CATEGORIES
                .iter()
                .find(|&&c| c == cat)
                .copied()
                .unwrap_or("other"),
            name: e["name"].as_str().unwrap_or("").to_string().into(),
            thread: names
                .get(&tid)
                .cloned()
                .unwrap_or_else(|| format!("thread {tid}")),
            start: Duration::from_secs_f64(ts / 1e6),
            duration: Duration::from_secs_f64(dur / 1e6),
            detail: e["args"]["detail"].as_str().unwrap_or("").to_string(),
        });
    }
    Ok(events)
}

/// [`write_chrome_trace`] into the file `path` (its folder created if
/// missing).
pub fn write_chrome_trace_file(events: &[TimelineEvent], path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    write_chrome_trace(events, &mut out)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(start_ms: u64, end_ms: u64) -> TimelineEvent {
        TimelineEvent {
            category: "ssd",
            name: "read".into(),
            thread: "t".into(),
            start: Duration::from_millis(start_ms),
            duration: Duration::from_millis(end_ms - start_ms),
            detail: String::new(),
        }
    }

    #[test]
    fn work_timed_elsewhere_goes_on_the_thread_it_names() {
        let timeline = Timeline::new(2);
        let at = Instant::now() + Duration::from_millis(5);
        timeline.record_on("gpu", "gpu", "gemm", (at, at + Duration::from_millis(3)));
        timeline.record_on("gpu", "gpu", "rope", (at, at));
        timeline.record_on("gpu", "gpu", "one too many", (at, at));
        let record = timeline.take();
        assert_eq!(record.dropped, 1);
        let [gemm, rope] = &record.events[..] else {
            panic!("{:?}", record.events)
        };
        assert_eq!((gemm.thread.as_str(), gemm.category), ("gpu", "gpu"));
        assert_eq!(gemm.name, "gemm");
        assert_eq!(gemm.duration, Duration::from_millis(3));
        assert!(gemm.start >= Duration::from_millis(5));
        assert_eq!((rope.start, rope.duration), (gemm.start, Duration::ZERO));
    }

    #[test]
    fn a_chrome_trace_reads_back_as_it_was_written() {
        let timeline = Timeline::new(16);
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("reader".into())
                .spawn_scoped(scope, || {
                    let span = TimelineSpan::start(Some(&timeline), "ssd", "read");
                    drop(span.with_detail(|| "0.1".into()));
                })
                .unwrap();
        });
        drop(TimelineSpan::start(Some(&timeline), "dense", "gemm"));
        let events = timeline.take().events;
        let mut out = Vec::new();
        write_chrome_trace(&events, &mut out).unwrap();
        let back = read_chrome_trace(std::str::from_utf8(&out).unwrap()).unwrap();
        assert_eq!(back.len(), 2);
        for (a, b) in events.iter().zip(&back) {
            assert_eq!(
                (a.category, &a.name, &a.thread, &a.detail),
                (b.category, &b.name, &b.thread, &b.detail)
            );
            let ns = |d: Duration| d.as_nanos() as i128;
            assert!(
                (ns(a.start) - ns(b.start)).abs() <= 1
                    && (ns(a.duration) - ns(b.duration)).abs() <= 1
            );
        }
        assert!(read_chrome_trace("{}").unwrap_err().contains("traceEvents"));
    }

    #[test]
    fn covered_is_the_union_of_spans_within_the_window() {
        let events = [event(0, 10), event(5, 20), event(30, 40), event(50, 60)];
        let refs: Vec<&TimelineEvent> = events.iter().collect();
        let ms = Duration::from_millis;
        assert_eq!(covered(&refs, ms(0), ms(100)), ms(40));
        assert_eq!(covered(&refs, ms(15), ms(35)), ms(10));
        assert_eq!(covered(&refs, ms(20), ms(30)), ms(0));
        assert_eq!(covered(&[], ms(0), ms(10)), ms(0));
    }

    #[test]
    fn a_full_timeline_counts_what_it_drops() {
        let timeline = Timeline::new(2);
        for i in 0..5 {
            drop(
                TimelineSpan::start(Some(&timeline), "ssd", format!("read {i}"))
                    .with_detail(|| "0.1".into()),
            );
        }
        let record = timeline.take();
        assert_eq!(record.events.len(), 2);
        assert_eq!(record.dropped, 3);
        assert_eq!(record.events[0].name, "read 0");
        assert_eq!(record.events[0].detail, "0.1");
        assert!(timeline.take().events.is_empty());
        // Without a timeline a span records nothing and computes no detail.
        drop(TimelineSpan::start(None, "ssd", "read").with_detail(|| unreachable!()));
    }

    #[test]
    fn the_chrome_trace_names_every_thread_once() {
        let timeline = Timeline::new(16);
        drop(TimelineSpan::start(Some(&timeline), "experts", "forward 0"));
        let mut events = timeline.take().events;
        events.push(TimelineEvent {
            thread: "strata-prefetch-0".into(),
            ..event(1, 2)
        });
        let mut out = Vec::new();
        write_chrome_trace(&events, &mut out).unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let trace = doc["traceEvents"].as_array().unwrap();
        assert_eq!(trace.len(), 4); // two spans, two thread names
        let names: Vec<_> = trace
            .iter()
            .filter(|e| e["ph"] == "M")
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names.len(), 2);
        assert!(names.contains(&"strata-prefetch-0".to_string()));
        assert_eq!(trace[1]["ts"].as_f64().unwrap(), 1000.0);
        assert_eq!(trace[1]["dur"].as_f64().unwrap(), 1000.0);
    }
}
