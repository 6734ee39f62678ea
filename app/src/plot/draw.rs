//! The figure itself (plotters): four panels against the step, under a
//! title that names the run.

use std::path::Path;
use std::sync::OnceLock;

use plotters::chart::MeshStyle;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::RunSeries;

/// DejaVu Sans (app/assets, with its license), so text renders the same
/// on a machine without fonts.
const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");
pub(super) const FAMILY: &str = "sans-serif";

#[derive(Clone, Copy, Debug)]
pub enum Format {
    Png,
    Svg,
}

impl Format {
    pub fn of(out: &Path) -> Result<Self, String> {
        match out.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("png") => Ok(Format::Png),
            Some(e) if e.eq_ignore_ascii_case("svg") => Ok(Format::Svg),
            _ => Err(format!(
                "cannot tell the figure's format from {}: end --out in .png or .svg",
                out.display()
            )),
        }
    }
}

type Drawn = Result<(), Box<dyn std::error::Error>>;

pub fn figure(run: &RunSeries, out: &Path, format: Format, size: (u32, u32)) -> Result<(), String> {
    register_font()?;
    let failed = |e: Box<dyn std::error::Error>| format!("drawing {}: {e}", out.display());
    match format {
        Format::Png => draw(BitMapBackend::new(out, size).into_drawing_area(), run),
        Format::Svg => draw(SVGBackend::new(out, size).into_drawing_area(), run),
    }
    .map_err(failed)
}

pub(super) fn register_font() -> Result<(), String> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    ok.then_some(())
        .ok_or_else(|| "the figure's font (app/assets/DejaVuSans.ttf) did not load".into())
}

const TRAIN: RGBColor = RGBColor(31, 119, 180);
const EVAL: RGBColor = RGBColor(214, 39, 40);
const SSD: RGBColor = RGBColor(255, 127, 14);
const UPLOAD: RGBColor = RGBColor(44, 160, 44);
const OPTIMIZER: RGBColor = RGBColor(148, 103, 189);

fn draw<B: DrawingBackend>(root: DrawingArea<B, Shift>, run: &RunSeries) -> Drawn
where
    B::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let (w, _) = root.dim_in_pixel();
    let scale = (w as f64 / 1600.0).max(0.5);
    let px = |x: f64| (x * scale).round() as u32;
    let tokens: f64 = run.steps.iter().map(|p| p.tokens).sum();
    let title = format!(
        "{} — {} steps, {} tokens",
        run.name,
        run.steps.last().map_or(0, |p| p.step),
        human(tokens)
    );
    let root = root
        .margin(px(12.0), 0, 0, 0)
        .titled(&title, (FAMILY, px(30.0)))?;
    let (summary, panels) = root.split_vertically(px(34.0));
    summary.draw_text(
        &run.summary,
        &TextStyle::from((FAMILY, px(20.0))).color(&BLACK.mix(0.75)),
        (px(16.0) as i32, 0),
    )?;
    let areas = panels.split_evenly((2, 2));
    let first = run.steps.first().map_or(0, |p| p.step) as f64;
    let last = run.steps.last().map_or(1, |p| p.step).max(1) as f64;
    let x_range = first.min(last - 1.0)..last;
    loss_panel(&areas[0], run, x_range.clone(), px)?;
    throughput_panel(&areas[1], run, x_range.clone(), px)?;
    stall_panel(&areas[2], run, x_range.clone(), px)?;
    lr_panel(&areas[3], run, x_range, px)?;
    root.present()?;
    Ok(())
}

/// 1.2M, 35k, 640.
fn human(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.1}G", x / 1e9),
        x if x >= 1e6 => format!("{:.1}M", x / 1e6),
        x if x >= 1e4 => format!("{:.0}k", x / 1e3),
        x if x >= 1e3 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// (low, high) of `values` with a margin, never empty.
fn span(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(v), h.max(v))
        });
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-9);
    (lo - pad)..(hi + pad)
}

fn panel<'a, B: DrawingBackend>(
    area: &'a DrawingArea<B, Shift>,
    caption: &str,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    y_axis: YAxis,
    px: impl Fn(f64) -> u32,
) -> Result<
    ChartContext<'a, B, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    Box<dyn std::error::Error>,
>
where
    B::ErrorType: 'static,
{
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FAMILY, px(22.0)))
        .margin(px(14.0))
        .x_label_area_size(px(44.0))
        .y_label_area_size(px(90.0))
        .build_cartesian_2d(x, y)?;
    let mut mesh = chart.configure_mesh();
    configure(&mut mesh, y_axis, px);
    mesh.draw()?;
    Ok(chart)
}

/// A panel's axes: steps along the bottom, `y_desc` and its labels up
/// the side.
fn configure<B: DrawingBackend>(
    mesh: &mut MeshStyle<'_, '_, RangedCoordf64, RangedCoordf64, B>,
    (y_desc, y_label): YAxis,
    px: impl Fn(f64) -> u32,
) {
    mesh.x_desc("step")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(y_label)
        .label_style((FAMILY, px(15.0)))
        .axis_desc_style((FAMILY, px(16.0)))
        .light_line_style(BLACK.mix(0.05));
}

/// A y axis: its description and how its labels are written.
type YAxis = (&'static str, &'static dyn Fn(&f64) -> String);

fn legend<'a, B: DrawingBackend + 'a>(
    chart: &mut ChartContext<'a, B, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    px: impl Fn(f64) -> u32,
) -> Drawn
where
    B::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .label_font((FAMILY, px(15.0)))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}

fn loss_panel<B: DrawingBackend>(
    area: &DrawingArea<B, Shift>,
    run: &RunSeries,
    x: std::ops::Range<f64>,
    px: impl Fn(f64) -> u32 + Copy,
) -> Drawn
where
    B::ErrorType: 'static,
{
    let y = span(
        run.steps
            .iter()
            .map(|p| p.loss)
            .chain(run.evals.iter().map(|e| e.1)),
    );
    // Tokens seen along the top: steps times the tokens of a step (the
    // trainer's batch is the same every step).
    let per_step = run.steps.last().map_or(0.0, |p| p.tokens);
    let tokens = x.start * per_step..x.end * per_step;
    // Built here rather than by `panel`: the secondary axis must exist
    // before the mesh is drawn, or the step labels are drawn on top too.
    let mut chart = ChartBuilder::on(area)
        .caption("Loss", (FAMILY, px(22.0)))
        .margin(px(14.0))
        .x_label_area_size(px(44.0))
        .top_x_label_area_size(px(40.0))
        .y_label_area_size(px(90.0))
        .build_cartesian_2d(x.clone(), y.clone())?
        .set_secondary_coord(tokens, y);
    let mut mesh = chart.configure_mesh();
    configure(&mut mesh, ("loss", &|v| format!("{v:.2}")), px);
    mesh.draw()?;
    chart
        .configure_secondary_axes()
        .x_desc("tokens")
        .x_label_formatter(&|t| human(*t))
        .label_style((FAMILY, px(15.0)))
        .axis_desc_style((FAMILY, px(16.0)))
        .draw()?;
    let train = run.steps.iter().map(|p| (p.step as f64, p.loss));
    chart
        .draw_series(LineSeries::new(train, TRAIN.stroke_width(px(2.0))))?
        .label("training (each step)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], TRAIN.stroke_width(2)));
    if !run.evals.is_empty() {
        let evals = run.evals.iter().map(|&(s, l)| (s as f64, l));
        chart
            .draw_series(LineSeries::new(evals.clone(), EVAL.stroke_width(px(2.0))))?
            .label("held-out")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], EVAL.stroke_width(2)));
        chart.draw_series(evals.map(|p| Circle::new(p, px(4.0), EVAL.filled())))?;
    }
    legend(&mut chart, px)
}

fn throughput_panel<B: DrawingBackend>(
    area: &DrawingArea<B, Shift>,
    run: &RunSeries,
    x: std::ops::Range<f64>,
    px: impl Fn(f64) -> u32 + Copy,
) -> Drawn
where
    B::ErrorType: 'static,
{
    let rate = |p: &super::StepPoint| p.tokens / p.wall_s.max(1e-9);
    let y = span(run.steps.iter().map(rate).chain([0.0]));
    let mut chart = panel(area, "Throughput", x, y, ("tokens / s", &|v| human(*v)), px)?;
    let points = run.steps.iter().map(|p| (p.step as f64, rate(p)));
    chart.draw_series(LineSeries::new(points, TRAIN.stroke_width(px(2.0))))?;
    Ok(())
}

fn stall_panel<B: DrawingBackend>(
    area: &DrawingArea<B, Shift>,
    run: &RunSeries,
    x: std::ops::Range<f64>,
    px: impl Fn(f64) -> u32 + Copy,
) -> Drawn
where
    B::ErrorType: 'static,
{
    let y_axis: YAxis = ("% of the step", &|v| format!("{v:.0}"));
    let caption = "Share of each step stalled, stacked";
    let mut chart = panel(area, caption, x, 0.0..100.0, y_axis, px)?;
    // Cumulative shares: SSD, then + uploads, then + optimizer.
    let share = |p: &super::StepPoint, upto: usize| {
        let parts = [p.stall_ssd_s, p.stall_upload_s, p.stall_optimizer_s];
        (100.0 * parts[..upto].iter().sum::<f64>() / p.wall_s.max(1e-9)).min(100.0)
    };
    // Drawn top layer first, so each lower band paints over the one above.
    for (upto, color, name) in [
        (3, OPTIMIZER, "optimizer"),
        (2, UPLOAD, "upload"),
        (1, SSD, "SSD"),
    ] {
        let points: Vec<(f64, f64)> = run
            .steps
            .iter()
            .map(|p| (p.step as f64, share(p, upto)))
            .collect();
        chart
            .draw_series(AreaSeries::new(points, 0.0, color.mix(0.8)).border_style(color))?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], color.filled()));
    }
    legend(&mut chart, px)
}

fn lr_panel<B: DrawingBackend>(
    area: &DrawingArea<B, Shift>,
    run: &RunSeries,
    x: std::ops::Range<f64>,
    px: impl Fn(f64) -> u32 + Copy,
) -> Drawn
where
    B::ErrorType: 'static,
{
    let points: Vec<(f64, f64)> = run
        .steps
        .iter()
        .filter_map(|p| p.lr.map(|lr| (p.step as f64, lr)))
        .collect();
    let y = span(points.iter().map(|p| p.1).chain([0.0]));
    let mut chart = panel(
        area,
        "Learning rate",
        x,
        y,
        ("lr", &|v| format!("{v:.1e}")),
        px,
    )?;
    chart.draw_series(LineSeries::new(points, TRAIN.stroke_width(px(2.0))))?;
    Ok(())
}
