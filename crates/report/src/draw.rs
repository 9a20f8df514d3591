//! Owns what the run and sweep pictures share: font, colours, markers, decimation and a panel
//! of lines with its legend.
//! Keeps: a legend is drawn beside the data, never on it; long runs are decimated to stay fast.
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
pub use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::sync::Once;

use crate::series::{Marker, MarkerKind, Point};
use crate::Error;

/// DejaVu Sans (licence in assets/), so pictures never depend on the system's fonts.
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
/// The SVG names it for browsers (metrics like the PNG's where DejaVu is installed).
pub const FAMILY: &str = "DejaVu Sans, Verdana, sans-serif";

pub fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid TrueType font, checked by the tests.
        let _ = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT);
    });
}

pub fn draw_err(e: impl std::fmt::Display) -> Error {
    Error::Draw(e.to_string())
}

/// Tableau 10: distinct for the colour-blind, readable on white.
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
pub const TEXT: RGBColor = RGBColor(40, 40, 40);
pub const MUTED: RGBColor = RGBColor(110, 110, 110);

pub fn text(size: u32) -> TextStyle<'static> {
    (FAMILY, size).into_font().color(&TEXT)
}

/// Text centred vertically on its y, anchored at its left (or centre, right) on its x.
pub fn text_at(size: u32, h: HPos) -> TextStyle<'static> {
    text(size).pos(Pos::new(h, VPos::Center))
}

/// How a series is stroked.
#[derive(Debug, Clone, Copy)]
pub struct Stroke {
    pub color: RGBColor,
    pub width: u32,
    pub dashed: bool,
}

impl Stroke {
    pub const fn solid(color: RGBColor, width: u32) -> Stroke {
        Stroke {
            color,
            width,
            dashed: false,
        }
    }
    pub const fn dashed(color: RGBColor, width: u32) -> Stroke {
        Stroke {
            color,
            width,
            dashed: true,
        }
    }
    fn style(&self) -> ShapeStyle {
        self.color.stroke_width(self.width)
    }
}

pub fn marker_stroke(kind: MarkerKind) -> Stroke {
    match kind {
        MarkerKind::Oom => Stroke::solid(RGBColor(214, 39, 40), 2),
        MarkerKind::Shrink => Stroke::dashed(RGBColor(255, 127, 14), 2),
        MarkerKind::Grow => Stroke::dashed(RGBColor(44, 160, 44), 2),
        MarkerKind::Resumed => Stroke::solid(RGBColor(148, 103, 189), 3),
        MarkerKind::Rung => Stroke::dashed(RGBColor(140, 86, 75), 2),
        MarkerKind::Stopped => Stroke::solid(RGBColor(60, 60, 60), 2),
        MarkerKind::Leak => Stroke::dashed(RGBColor(227, 119, 194), 2),
        MarkerKind::Membership => Stroke::solid(RGBColor(23, 190, 207), 3),
    }
}

/// A line's points reduced to at most about four per pixel column (first, min, max, last
/// of each column, in order): the drawn line looks the same and a 100k-step run draws fast.
pub fn decimate(points: &[(f64, f64)], x: (f64, f64), columns: usize) -> Vec<(f64, f64)> {
    if points.len() <= 4 * columns.max(1) {
        return points.to_vec();
    }
    let width = (x.1 - x.0).max(f64::MIN_POSITIVE);
    let column = |px: f64| (((px - x.0) / width) * columns as f64) as i64;
    let mut out = Vec::with_capacity(4 * columns + 4);
    let mut i = 0;
    while i < points.len() {
        let c = column(points[i].0);
        let mut j = i;
        let (mut lo, mut hi) = (i, i);
        while j < points.len() && column(points[j].0) == c {
            if points[j].1 < points[lo].1 {
                lo = j;
            }
            if points[j].1 > points[hi].1 {
                hi = j;
            }
            j += 1;
        }
        let mut keep = [i, lo, hi, j - 1];
        keep.sort_unstable();
        let mut last = usize::MAX;
        for k in keep {
            if k != last {
                out.push(points[k]);
                last = k;
            }
        }
        i = j;
    }
    out
}

/// A series of one panel: a label for the legend, its points, how it is drawn.
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub stroke: Stroke,
    /// Draw a dot on every point too (few points, such as evaluations).
    pub dots: bool,
}

impl Line {
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>, stroke: Stroke) -> Line {
        Line {
            label: label.into(),
            points,
            stroke,
            dots: false,
        }
    }
}

pub fn to_f64(points: &[Point], scale: f64) -> Vec<(f64, f64)> {
    points.iter().map(|&(s, v)| (s as f64, v / scale)).collect()
}

/// The centred mean of `window` points around each point (fewer at the ends): the trend
/// through a noisy loss, without the lag of an exponential average.
pub fn moving_mean(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let half = window / 2;
    let mut prefix = Vec::with_capacity(points.len() + 1);
    prefix.push(0.0);
    for p in points {
        prefix.push(prefix.last().copied().unwrap_or(0.0) + p.1);
    }
    (0..points.len())
        .map(|i| {
            let (a, b) = (i.saturating_sub(half), (i + half + 1).min(points.len()));
            (points[i].0, (prefix[b] - prefix[a]) / (b - a) as f64)
        })
        .collect()
}

/// A chart: lines over steps, event markers, axes labelled, its legend on the right.
pub struct Panel<'a> {
    pub y_desc: String,
    pub lines: Vec<Line>,
    pub markers: &'a [Marker],
    /// Start the y axis at zero (memory, sizes), or fit it to the data (loss).
    pub from_zero: bool,
    pub y_format: fn(&f64) -> String,
    /// Greyed out instead of the chart when nothing was recorded.
    pub empty_note: &'static str,
    /// Pixels kept on the right for the legend.
    pub legend_width: u32,
}

impl Panel<'_> {
    /// Draws into `area` over the steps `x`; `legend_extra` rows go under the lines' legend.
    pub fn draw<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        x: (f64, f64),
        legend_extra: &[LegendRow],
    ) -> Result<(), Error> {
        let (w, _) = area.dim_in_pixel();
        let (plot, legend) = area.split_horizontally(w.saturating_sub(self.legend_width));
        let values = self.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
        let (lo, hi) = y_range(values, self.from_zero);
        let mut chart = ChartBuilder::on(&plot)
            .margin_top(12)
            .margin_right(16)
            .margin_left(8)
            .x_label_area_size(46)
            .y_label_area_size(78)
            .build_cartesian_2d(x.0..x.1, lo..hi)
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(self.y_desc.as_str())
            .axis_desc_style(text(16))
            .label_style(text(13))
            .x_labels(10)
            .y_labels(6)
            .x_label_formatter(&|v| crate::labels::step_label(*v, x.1 - x.0))
            .y_label_formatter(&self.y_format)
            .light_line_style(RGBColor(246, 246, 246))
            .bold_line_style(RGBColor(215, 215, 215))
            .draw()
            .map_err(draw_err)?;
        if self.lines.iter().all(|l| l.points.is_empty()) {
            let (pw, ph) = plot.dim_in_pixel();
            let style = text_at(16, HPos::Center).color(&MUTED);
            plot.draw(&Text::new(self.empty_note, ((pw / 2) as i32, (ph / 2) as i32), style))
                .map_err(draw_err)?;
        }
        let columns = chart.plotting_area().dim_in_pixel().0 as usize;
        for line in &self.lines {
            let pts = decimate(&line.points, x, columns);
            let style = line.stroke.style();
            if line.stroke.dashed {
                chart
                    .draw_series(std::iter::once(DashedPathElement::new(
                        pts.iter().copied(),
                        8,
                        5,
                        style,
                    )))
                    .map_err(draw_err)?;
            } else {
                chart
                    .draw_series(LineSeries::new(pts.iter().copied(), style))
                    .map_err(draw_err)?;
            }
            if line.dots {
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, line.stroke.color.filled())))
                    .map_err(draw_err)?;
            }
        }
        // Markers: solid ones first, so that a dashed one at the same step still shows.
        let mut marks: Vec<Marker> = self.markers.to_vec();
        marks.sort_by_key(|m| (marker_stroke(m.kind).dashed, m.kind, m.step));
        marks.dedup();
        for m in marks {
            let s = marker_stroke(m.kind);
            let seg = [(m.step as f64, lo), (m.step as f64, hi)];
            if s.dashed {
                chart
                    .draw_series(std::iter::once(DashedPathElement::new(seg, 6, 4, s.style())))
                    .map_err(draw_err)?;
            } else {
                chart
                    .draw_series(std::iter::once(PathElement::new(seg.to_vec(), s.style())))
                    .map_err(draw_err)?;
            }
        }
        let rows: Vec<LegendRow> = self
            .lines
            .iter()
            .filter(|l| !l.points.is_empty())
            .map(|l| LegendRow {
                label: l.label.clone(),
                swatch: Some(l.stroke),
                dot: l.dots,
            })
            .collect();
        draw_legend(&legend, 14, rows.iter().chain(legend_extra))
    }
}

/// The y axis over `values`, padded: finite, and within [-Y_MAX, Y_MAX] (a diverged run's
/// 1e308 loss is drawn at the edge: a wider axis overflows the padding and the ticks).
fn y_range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    const Y_MAX: f64 = 1e300;
    let values = values.filter(|v| v.is_finite()).map(|v| v.clamp(-Y_MAX, Y_MAX));
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    if lo > hi {
        return (0.0, 1.0);
    }
    let lo = if from_zero { lo.min(0.0) } else { lo };
    let pad = ((hi - lo) * 0.06).max(hi.abs() * 0.02).max(1e-9);
    (if from_zero && lo >= 0.0 { 0.0 } else { lo - pad }, hi + pad)
}

/// A legend entry: a short stroke and its words (no stroke: a note in grey).
#[derive(Debug, Clone)]
pub struct LegendRow {
    pub label: String,
    pub swatch: Option<Stroke>,
    pub dot: bool,
}

pub const ROW: i32 = 22;

/// Stacks `rows` from `top`, a swatch then the label; rows that do not fit become "... N more".
pub fn draw_legend<'r, DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    top: i32,
    rows: impl Iterator<Item = &'r LegendRow>,
) -> Result<(), Error> {
    let rows: Vec<&LegendRow> = rows.collect();
    let fit = ((area.dim_in_pixel().1 as i32 - top - 8) / ROW).max(1) as usize;
    let shown = if rows.len() > fit { fit - 1 } else { rows.len() };
    for (i, row) in rows.iter().take(shown).enumerate() {
        let y = top + i as i32 * ROW + ROW / 2;
        draw_swatch(area, (4, y), row)?;
        let color = if row.swatch.is_some() { TEXT } else { MUTED };
        let style = text_at(14, HPos::Left).color(&color);
        area.draw(&Text::new(row.label.clone(), (42, y), style))
            .map_err(draw_err)?;
    }
    if shown < rows.len() {
        let y = top + shown as i32 * ROW + ROW / 2;
        let style = text_at(14, HPos::Left).color(&MUTED);
        area.draw(&Text::new(format!("... {} more", rows.len() - shown), (42, y), style))
            .map_err(draw_err)?;
    }
    Ok(())
}

/// A 30-pixel stroke centred on `y`, starting at `x`.
pub fn draw_swatch<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    (x, y): (i32, i32),
    row: &LegendRow,
) -> Result<(), Error> {
    let Some(s) = row.swatch else { return Ok(()) };
    let seg = [(x, y), (x + 30, y)];
    if s.dashed {
        area.draw(&DashedPathElement::new(seg, 6, 4, s.style()))
            .map_err(draw_err)?;
    } else {
        area.draw(&PathElement::new(seg.to_vec(), s.style()))
            .map_err(draw_err)?;
    }
    if row.dot {
        area.draw(&Circle::new((x + 15, y), 3, s.color.filled()))
            .map_err(draw_err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimation_keeps_each_columns_extremes_in_order() {
        let pts: Vec<(f64, f64)> = (0..100_000).map(|i| (i as f64, ((i * 7919) % 1000) as f64)).collect();
        let d = decimate(&pts, (0.0, 100_000.0), 1000);
        assert!(d.len() <= 4000 && d.len() >= 2000, "{}", d.len());
        assert!(d.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!((d[0], *d.last().unwrap()), (pts[0], *pts.last().unwrap()));
        for c in 0..1000 {
            let col: Vec<f64> = pts[c * 100..(c + 1) * 100].iter().map(|p| p.1).collect();
            let kept: Vec<f64> = d.iter().filter(|p| (p.0 as usize) / 100 == c).map(|p| p.1).collect();
            let max = col.iter().copied().fold(f64::MIN, f64::max);
            let min = col.iter().copied().fold(f64::MAX, f64::min);
            assert!(kept.contains(&max) && kept.contains(&min), "column {c}");
        }
        let few = [(0.0, 1.0), (1.0, 2.0)];
        assert_eq!(decimate(&few, (0.0, 1.0), 1000), few);
    }

    #[test]
    fn a_diverged_runs_extremes_give_a_finite_axis() {
        for vals in [
            vec![-1e308, 1e308],
            vec![f64::MAX, 1.0],
            vec![f64::INFINITY, f64::NAN, 2.0],
        ] {
            for from_zero in [false, true] {
                let (lo, hi) = y_range(vals.iter().copied(), from_zero);
                assert!(
                    lo.is_finite() && hi.is_finite() && lo < hi && hi - lo < f64::INFINITY,
                    "{vals:?}"
                );
            }
        }
        assert_eq!(y_range([f64::NAN].into_iter(), false), (0.0, 1.0));
        assert_eq!(y_range([0.0, 10.0].into_iter(), true).0, 0.0);
    }

    #[test]
    fn the_moving_mean_is_centred_and_shrinks_at_the_ends() {
        let pts: Vec<(f64, f64)> = [1.0, 2.0, 3.0, 4.0, 5.0]
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as f64, v))
            .collect();
        assert_eq!(
            moving_mean(&pts, 3),
            [(0.0, 1.5), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 4.5)]
        );
    }
}
