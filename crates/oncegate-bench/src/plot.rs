//! The benchmark's plot: throughput and p99 latency against requests in flight, one
//! line per target, as an SVG.

use std::path::Path;

use plotters::prelude::*;

use crate::Report;

/// Where a TrueType font is looked for; plotters' SVG backend needs one for its labels.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn register_font() -> anyhow::Result<()> {
    let path = FONTS.iter().find(|p| Path::new(p).exists()).ok_or_else(|| {
        anyhow::anyhow!("no DejaVu Sans font found (install fonts-dejavu-core); looked in {FONTS:?}")
    })?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(path)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{path} is not a usable font"))?;
    Ok(())
}

const COLOURS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type Metric = fn(&Report) -> f64;

/// Draws pairs/s and p99 (ms) against in-flight requests (log scale) for every target.
pub fn plot(reports: &[Report], path: &Path) -> anyhow::Result<()> {
    register_font()?;
    let mut targets: Vec<&str> = Vec::new();
    for r in reports {
        if !targets.contains(&r.target.as_str()) {
            targets.push(&r.target);
        }
    }
    let x_max = reports.iter().map(|r| r.in_flight).max().unwrap_or(1).max(2) as f64 * 1.5;
    let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(550);
    let charts: [(&str, &Area<'_>, Metric); 2] = [
        ("completed reserve+commit pairs per second", &left, |r| r.pairs_per_s),
        ("p99 latency of a pair (ms)", &right, |r| r.p99_us as f64 / 1000.0),
    ];
    for (title, area, value) in charts {
        let y_max = reports.iter().map(value).fold(0.0f64, f64::max) * 1.1 + 1e-9;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d((0.8f64..x_max).log_scale(), 0.0..y_max)?;
        chart.configure_mesh().x_desc("requests in flight").draw()?;
        for (i, target) in targets.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let mut points: Vec<(f64, f64)> = reports
                .iter()
                .filter(|r| r.target == *target)
                .map(|r| (r.in_flight as f64, value(r)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?
                .label(*target)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2)));
            chart.draw_series(points.into_iter().map(|p| Circle::new(p, 3, colour.filled())))?;
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    }
    root.present()?;
    Ok(())
}
