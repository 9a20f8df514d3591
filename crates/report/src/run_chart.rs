//! Owns the picture of a run: a header over four panels sharing the step axis (loss, tokens/s,
//! memory, micro-batch and accumulation).
//! Keeps: every panel uses the same step axis.
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::draw::{self, draw_err, text, Line, Panel, Stroke, MUTED};
use crate::series::{MarkerKind, Point, RunSeries};
use crate::Error;

pub const WIDTH: u32 = 1400;
const HEADER: u32 = 96;
const PANEL: u32 = 290;
pub const HEIGHT: u32 = HEADER + 4 * PANEL;
const LEGEND: u32 = 230;

// Series colours stay clear of the markers' (red, orange, green, purple, brown, pink).
const BLUE: RGBColor = RGBColor(31, 119, 180);
const TEAL: RGBColor = RGBColor(23, 160, 180);
const INK: RGBColor = RGBColor(20, 20, 20);
const GREY: RGBColor = RGBColor(150, 150, 150);
const PALE: RGBColor = RGBColor(170, 204, 230);
const PALE_TEAL: RGBColor = RGBColor(170, 222, 230);

/// The steps drawn: every record's, with a little room so a marker at the first or last
/// step is not hidden by the axis.
pub fn x_range(s: &RunSeries) -> (f64, f64) {
    let (a, b) = s.step_range().unwrap_or((0, 1));
    let pad = ((b - a) as f64 * 0.01).max(0.5);
    (a as f64 - pad, b as f64 + pad)
}

/// A step function (micro-batch sizes) as the corners of its staircase.
fn stepped(points: &[Point]) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (i, &(s, v)) in points.iter().enumerate() {
        let last = i + 1 == points.len();
        match out.last().copied() {
            Some((_, prev)) if prev == v => {
                if last {
                    out.push((s as f64, v));
                }
            }
            Some((_, prev)) => {
                out.push((s as f64, prev));
                out.push((s as f64, v));
            }
            None => out.push((s as f64, v)),
        }
    }
    out
}

/// A long run's noisy series: the points pale, and their trend over them.
fn trend(label: &str, points: Vec<(f64, f64)>, color: RGBColor, pale: RGBColor) -> Vec<Line> {
    let window = points.len() / 150;
    if window < 3 {
        return vec![Line::new(label, points, Stroke::solid(color, 1))];
    }
    let mean = draw::moving_mean(&points, window);
    vec![
        Line::new(label, points, Stroke::solid(pale, 1)),
        Line::new(format!("{label}, mean of {window}"), mean, Stroke::solid(color, 2)),
    ]
}

fn panels(s: &RunSeries) -> Vec<Panel<'_>> {
    let loss_fmt: fn(&f64) -> String = |v| format!("{v:.2}");
    let number: fn(&f64) -> String = |v| crate::labels::short_number(*v);
    let mut eval = Line::new("eval loss", draw::to_f64(&s.eval_loss, 1.0), Stroke::solid(INK, 2));
    eval.dots = s.eval_loss.len() <= 60;
    let mut loss = trend("train loss", draw::to_f64(&s.loss, 1.0), BLUE, PALE);
    loss.push(eval);
    let max_mem = [&s.peak_bytes, &s.limit_bytes, &s.reserved_bytes, &s.live_bytes]
        .iter()
        .flat_map(|v| v.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    let (div, unit) = crate::labels::bytes_unit(max_mem);
    let mut memory = vec![
        Line::new("live", draw::to_f64(&s.live_bytes, div), Stroke::solid(BLUE, 2)),
        Line::new("peak", draw::to_f64(&s.peak_bytes, div), Stroke::solid(TEAL, 2)),
    ];
    if !s.reserved_bytes.is_empty() {
        memory.push(Line::new(
            "reserved (cache)",
            draw::to_f64(&s.reserved_bytes, div),
            Stroke::solid(GREY, 2),
        ));
    }
    if !s.limit_bytes.is_empty() {
        // CUDA steps report the cache too; their limit is the device's capacity.
        let label = if s.reserved_bytes.is_empty() {
            "budget"
        } else {
            "capacity"
        };
        memory.push(Line::new(
            label,
            draw::to_f64(&s.limit_bytes, div),
            Stroke::dashed(INK, 2),
        ));
    }
    let panel = |y_desc: String, lines, from_zero, y_format, empty_note| Panel {
        y_desc,
        lines,
        markers: &s.markers,
        from_zero,
        y_format,
        empty_note,
        legend_width: LEGEND,
    };
    vec![
        panel("loss".into(), loss, false, loss_fmt, "no steps recorded"),
        panel(
            "tokens/s".into(),
            trend("tokens/s", draw::to_f64(&s.tokens_per_s, 1.0), TEAL, PALE_TEAL),
            true,
            number,
            "no steps recorded",
        ),
        panel(format!("memory ({unit})"), memory, true, number, "no memory recorded"),
        panel(
            "micro-batch, accumulation".into(),
            vec![
                Line::new("micro-batch size", stepped(&s.micro_batch_size), Stroke::solid(BLUE, 2)),
                Line::new(
                    "accumulation steps",
                    stepped(&s.grad_accum_steps),
                    Stroke::dashed(TEAL, 2),
                ),
            ],
            true,
            number,
            "no steps recorded",
        ),
    ]
}

/// Draws the whole picture on `root` (WIDTH x HEIGHT).
pub fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &str, s: &RunSeries) -> Result<(), Error> {
    draw::register_font();
    root.fill(&WHITE).map_err(draw_err)?;
    let (header, body) = root.split_vertically(HEADER);
    header
        .draw(&Text::new(title.to_string(), (16, 10), text(22)))
        .map_err(draw_err)?;
    summary_lines(&header, s)?;
    marker_legend(&header, s, 80)?;
    let x = x_range(s);
    for (panel, area) in panels(s).iter().zip(body.split_evenly((4, 1)).iter()) {
        panel.draw(area, x, &[])?;
    }
    Ok(())
}

/// The run's figures under the title: one line, or two when one would not fit.
fn summary_lines<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, s: &RunSeries) -> Result<(), Error> {
    let style = text(14).color(&MUTED);
    let rows = s.summary().rows();
    let join = |rows: &[(&str, String)]| {
        rows.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let one = join(&rows);
    if area.estimate_text_size(&one, &style).map_err(draw_err)?.0 + 32 <= WIDTH {
        return area.draw(&Text::new(one, (16, 42), style)).map_err(draw_err);
    }
    let half = rows.len().div_ceil(2);
    area.draw(&Text::new(join(&rows[..half]), (16, 38), style.clone()))
        .map_err(draw_err)?;
    area.draw(&Text::new(join(&rows[half..]), (16, 56), style))
        .map_err(draw_err)
}

/// One row across the header: every marker kind that occurred, and always the guard's
/// four, with their counts.
fn marker_legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, s: &RunSeries, y: i32) -> Result<(), Error> {
    let style = draw::text_at(14, draw::HPos::Left);
    area.draw(&Text::new("markers:", (16, y), style.clone()))
        .map_err(draw_err)?;
    let mut x = 90;
    for kind in MarkerKind::ALL {
        let n = s.count(kind);
        let always = matches!(
            kind,
            MarkerKind::Oom | MarkerKind::Shrink | MarkerKind::Grow | MarkerKind::Resumed
        );
        if n == 0 && !always {
            continue;
        }
        let row = draw::LegendRow {
            label: format!("{} ({n})", kind.label()),
            swatch: Some(draw::marker_stroke(kind)),
            dot: false,
        };
        draw::draw_swatch(area, (x, y), &row)?;
        area.draw(&Text::new(row.label.clone(), (x + 38, y), style.clone()))
            .map_err(draw_err)?;
        let (w, _) = area.estimate_text_size(&row.label, &style).map_err(draw_err)?;
        x += 38 + w as i32 + 28;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_function_becomes_its_staircase() {
        let s = stepped(&[(0, 16.0), (1, 16.0), (2, 8.0), (3, 8.0), (4, 16.0), (5, 16.0)]);
        assert_eq!(
            s,
            [
                (0.0, 16.0),
                (2.0, 16.0),
                (2.0, 8.0),
                (4.0, 8.0),
                (4.0, 16.0),
                (5.0, 16.0)
            ]
        );
    }
}
