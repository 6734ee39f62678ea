//! A step's timeline as a figure: one panel a run, one lane a thread,
//! each span of work a bar coloured by its kind (SSD calls, waits, expert
//! loops, optimizer updates, host copies) against milliseconds into the
//! step, so overlap and stalls can be seen rather than read. The same
//! events `--timeline` writes as a Chrome trace.

use std::collections::BTreeSet;
use std::path::Path;

use plotters::prelude::*;
use strata_tiers::TimelineEvent;

use super::draw::{self, Format, FAMILY};

/// The kinds drawn, in the legend's order, with their colours. "step"
/// spans only set the panel's length.
const KINDS: [(&str, &str, RGBColor); 6] = [
    (
        "experts",
        "expert loop (layer, pass)",
        RGBColor(31, 119, 180),
    ),
    (
        "dense",
        "dense kernel (GEMM, attention, head)",
        RGBColor(23, 190, 207),
    ),
    ("ssd", "SSD reads and writes", RGBColor(255, 127, 14)),
    (
        "stall",
        "waiting (upload, record, update)",
        RGBColor(214, 39, 40),
    ),
    ("optimizer", "expert update", RGBColor(148, 103, 189)),
    ("host", "host copy", RGBColor(44, 160, 44)),
];

/// The time axis runs this far past the longest step, leaving the legend
/// a margin of its own on the right.
const LEGEND_ROOM: f64 = 1.3;

/// Draws each run's step (name, events) as a panel of one figure.
pub fn plot_timelines(
    runs: &[(&str, &[TimelineEvent])],
    title: &str,
    out: &Path,
    size: (u32, u32),
) -> Result<(), String> {
    let format = Format::of(out)?;
    if runs.iter().all(|(_, events)| events.is_empty()) {
        return Err("no timeline events to draw: the runs recorded no step".into());
    }
    draw::register_font()?;
    let failed = |e: Box<dyn std::error::Error>| format!("drawing {}: {e}", out.display());
    match format {
        Format::Png => draw_runs(
            BitMapBackend::new(out, size).into_drawing_area(),
            runs,
            title,
        ),
        Format::Svg => draw_runs(SVGBackend::new(out, size).into_drawing_area(), runs, title),
    }
    .map_err(failed)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn draw_runs<B: DrawingBackend>(
    root: DrawingArea<B, plotters::coord::Shift>,
    runs: &[(&str, &[TimelineEvent])],
    title: &str,
) -> Result<(), Box<dyn std::error::Error>>
where
    B::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let (w, _) = root.dim_in_pixel();
    let scale = (w as f64 / 1600.0).max(0.5);
    let px = |x: f64| (x * scale).round() as u32;
    let root = root
        .margin(px(10.0), 0, 0, 0)
        .titled(title, (FAMILY, px(26.0)))?;
    // One time axis for every panel, so their lengths compare.
    let end = runs
        .iter()
        .flat_map(|(_, events)| events.iter().map(|e| ms(e.end())))
        .fold(1e-3, f64::max);
    let panels = root.split_evenly((runs.len(), 1));
    for ((name, events), area) in runs.iter().zip(&panels) {
        let threads: Vec<&str> = events
            .iter()
            .filter(|e| e.category != "step")
            .map(|e| e.thread.as_str())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let lanes = threads.len().max(1) as f64;
        let lane_of = |t: &str| threads.iter().position(|&x| x == t).unwrap_or(0) as f64;
        let step = events
            .iter()
            .filter(|e| e.category == "step")
            .map(|e| ms(e.duration))
            .fold(0.0, f64::max);
        let caption = format!("{name}: step {step:.1} ms");
        let mut chart = ChartBuilder::on(area)
            .caption(caption, (FAMILY, px(20.0)))
            .margin(px(10.0))
            .x_label_area_size(px(36.0))
            .y_label_area_size(px(170.0))
            .build_cartesian_2d(0.0..end * LEGEND_ROOM, 0.0..lanes)?;
        let lane_name = |y: &f64| {
            let i = y.floor() as usize;
            let centred = (y - y.floor() - 0.5).abs() < 1e-6;
            match threads.get(i) {
                Some(t) if centred => t.to_string(),
                _ => String::new(),
            }
        };
        chart
            .configure_mesh()
            .x_desc("ms into the step")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_labels(2 * threads.len() + 1)
            .y_label_formatter(&lane_name)
            .disable_y_mesh()
            .label_style((FAMILY, px(14.0)))
            .axis_desc_style((FAMILY, px(15.0)))
            .draw()?;
        for (kind, label, color) in KINDS {
            let bars: Vec<_> = events
                .iter()
                .filter(|e| e.category == kind)
                .map(|e| {
                    let y = lane_of(&e.thread);
                    let x1 = ms(e.end()).max(ms(e.start) + end * 5e-4); // visible
                    Rectangle::new([(ms(e.start), y + 0.15), (x1, y + 0.85)], color.filled())
                })
                .collect();
            if bars.is_empty() {
                continue;
            }
            chart.draw_series(bars)?.label(label).legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 16, y + 5)], color.filled())
            });
        }
        chart
            .configure_series_labels()
            .label_font((FAMILY, px(14.0)))
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.3))
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn event(category: &'static str, thread: &str, start_ms: u64, ms: u64) -> TimelineEvent {
        TimelineEvent {
            category,
            name: category.into(),
            thread: thread.into(),
            start: Duration::from_millis(start_ms),
            duration: Duration::from_millis(ms),
            detail: String::new(),
        }
    }

    #[test]
    fn each_kind_of_span_is_drawn_in_its_colour_on_its_thread() {
        let events = [
            event("step", "main", 0, 100),
            event("experts", "main", 5, 40),
            event("dense", "main", 0, 5),
            event("stall", "main", 45, 10),
            event("experts", "main", 55, 40),
            event("ssd", "prefetch", 0, 60),
            event("optimizer", "optimizer-0", 60, 30),
        ];
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("t.png");
        let runs = [("expert_wise", &events[..]), ("naive", &events[..3])];
        plot_timelines(&runs, "a step", &out, (800, 600)).unwrap();
        let image = image_pixels(&out);
        for (kind, _, color) in KINDS.iter().filter(|k| k.0 != "host") {
            let n = image
                .iter()
                .filter(|p| **p == [color.0, color.1, color.2])
                .count();
            assert!(n > 200, "{kind}: {n} pixels");
        }
        let host = KINDS[5].2;
        assert!(!image.contains(&[host.0, host.1, host.2]), "no host copies");
        let svg = dir.path().join("t.svg");
        plot_timelines(&runs, "a step", &svg, (800, 600)).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        for label in [
            "expert_wise: step 100.0 ms",
            "naive",
            "prefetch",
            "optimizer-0",
        ] {
            assert!(text.contains(label), "{label}");
        }
        let none: [(&str, &[TimelineEvent]); 1] = [("empty", &[])];
        assert!(plot_timelines(&none, "x", &out, (800, 600)).is_err());
    }

    /// RGB pixels of a PNG plotters wrote (its bitmap encoder's format).
    fn image_pixels(path: &Path) -> Vec<[u8; 3]> {
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let decoder = png_rgb(&bytes);
        decoder
            .chunks_exact(3)
            .map(|c| [c[0], c[1], c[2]])
            .collect()
    }

    fn png_rgb(bytes: &[u8]) -> Vec<u8> {
        image::load_from_memory(bytes).unwrap().to_rgb8().into_raw()
    }
}
