//! Owns the picture of a sweep: eval loss over steps, one line per trial, and the table of
//! trials.
//! Keeps: every trial appears, as a line or listed beside the chart with its status.
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::draw::{self, draw_err, text, LegendRow, Line, Panel, Stroke, MUTED, ROW, TEXT};
use crate::sweep::Sweep;
use crate::Error;

pub const WIDTH: u32 = 1400;
const HEADER: u32 = 70;
const CHART: u32 = 560;
/// Rows of the table drawn in the picture; stdout and the HTML page have them all.
const MAX_ROWS: usize = 40;

pub fn colour(i: usize) -> RGBColor {
    draw::PALETTE[i % draw::PALETTE.len()]
}

pub fn height(s: &Sweep, with_table: bool) -> u32 {
    let rows = s.trials.len().min(MAX_ROWS) + 1 + usize::from(s.trials.len() > MAX_ROWS);
    HEADER
        + CHART
        + if with_table {
            30 + rows as u32 * ROW as u32 + 16
        } else {
            0
        }
}

pub fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    s: &Sweep,
    with_table: bool,
) -> Result<(), Error> {
    draw::register_font();
    root.fill(&WHITE).map_err(draw_err)?;
    let (header, rest) = root.split_vertically(HEADER);
    header
        .draw(&Text::new(title.to_string(), (16, 10), text(22)))
        .map_err(draw_err)?;
    let best = s.best.map_or("no completed trial".into(), |i| {
        let t = &s.trials[i];
        format!(
            "best: {} ({} {:.4})",
            t.name,
            s.metric,
            t.value(&s.metric).unwrap_or(f64::NAN)
        )
    });
    header
        .draw(&Text::new(
            format!("{} | {best}", s.counts()),
            (16, 42),
            text(14).color(&MUTED),
        ))
        .map_err(draw_err)?;
    let (chart, table) = rest.split_vertically(CHART);

    let mut lines = Vec::new();
    let mut others = Vec::new();
    let plotted = s.trials.iter().filter(|t| !t.eval_loss.is_empty()).count();
    for i in s.ranked() {
        let t = &s.trials[i];
        let is_best = s.best == Some(i);
        if t.eval_loss.is_empty() {
            others.push(LegendRow {
                label: format!("{}: {}", t.name, t.status()),
                swatch: None,
                dot: false,
            });
            continue;
        }
        let label = match (is_best, t.is_ok()) {
            (true, _) => format!("{} (best)", t.name),
            (false, true) => t.name.clone(),
            (false, false) => format!("{}: {}", t.name, t.status()),
        };
        let stroke = Stroke {
            color: colour(i),
            width: if is_best { 4 } else { 2 },
            dashed: !t.is_ok(),
        };
        let mut line = Line::new(label, draw::to_f64(&t.eval_loss, 1.0), stroke);
        line.dots = plotted <= 10 && t.eval_loss.len() <= 60;
        lines.push(line);
    }
    let steps = s.trials.iter().flat_map(|t| t.eval_loss.iter().map(|p| p.0));
    let (a, b) = steps.fold((u64::MAX, 0), |(a, b), x| (a.min(x), b.max(x)));
    let x = if a > b {
        (0.0, 1.0)
    } else {
        (
            a as f64 - ((b - a) as f64 * 0.01).max(0.5),
            b as f64 + ((b - a) as f64 * 0.01).max(0.5),
        )
    };
    let panel = Panel {
        y_desc: "eval loss".into(),
        lines,
        markers: &[],
        from_zero: false,
        y_format: |v| format!("{v:.2}"),
        empty_note: "no trial recorded an evaluation",
        legend_width: 330,
    };
    panel.draw(&chart, x, &others)?;
    if with_table {
        draw_table(&table, s)?;
    }
    Ok(())
}

/// The table of trials as text: columns as wide as their widest cell, the best row shaded,
/// each trial's colour beside its name, statuses other than ok in red.
fn draw_table<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, s: &Sweep) -> Result<(), Error> {
    let (header, rows) = s.table();
    let style = draw::text_at(14, draw::HPos::Left);
    let width = |t: &str| {
        area.estimate_text_size(t, &style)
            .map(|(w, _)| w as i32)
            .map_err(draw_err)
    };
    let mut widths = Vec::with_capacity(header.len());
    for (c, h) in header.iter().enumerate() {
        let mut w = width(h)?;
        for (_, r) in rows.iter().take(MAX_ROWS) {
            w = w.max(width(&r[c])?);
        }
        widths.push(w);
    }
    let (total, _) = area.dim_in_pixel();
    let swatch = 22;
    let mut xs = vec![16];
    for (c, w) in widths.iter().enumerate().take(header.len() - 1) {
        xs.push(xs[c] + w + 24 + if c == 1 { swatch } else { 0 });
    }
    let top = 24;
    let params_room = total as i32 - xs[header.len() - 1] - 16;
    for (c, h) in header.iter().enumerate() {
        area.draw(&Text::new(h.to_string(), (xs[c], top), style.clone()))
            .map_err(draw_err)?;
    }
    let rule = [(16, top + ROW / 2), (total as i32 - 16, top + ROW / 2)];
    area.draw(&PathElement::new(rule.to_vec(), RGBColor(180, 180, 180)))
        .map_err(draw_err)?;
    for (n, (i, row)) in rows.iter().take(MAX_ROWS).enumerate() {
        let (i, t) = (*i, &s.trials[*i]);
        let y = top + (n as i32 + 1) * ROW;
        if s.best == Some(i) {
            let shade = Rectangle::new(
                [(10, y - ROW / 2), (total as i32 - 10, y + ROW / 2)],
                RGBColor(255, 243, 191).filled(),
            );
            area.draw(&shade).map_err(draw_err)?;
        }
        for (c, cell) in row.iter().enumerate() {
            let mut cell = cell.clone();
            if c == header.len() - 1 {
                cell = fit(&cell, params_room, &width)?;
            }
            let color = if c == 2 && !t.is_ok() {
                RGBColor(200, 30, 30)
            } else {
                TEXT
            };
            let x = xs[c] + if c == 1 { swatch } else { 0 };
            area.draw(&Text::new(cell, (x, y), style.color(&color)))
                .map_err(draw_err)?;
        }
        if !t.eval_loss.is_empty() {
            let sq = Rectangle::new([(xs[1], y - 6), (xs[1] + 12, y + 6)], colour(i).filled());
            area.draw(&sq).map_err(draw_err)?;
        }
    }
    if rows.len() > MAX_ROWS {
        let y = top + (MAX_ROWS as i32 + 1) * ROW;
        let note = format!(
            "... {} more trials: the table on stdout and report.html list them all",
            rows.len() - MAX_ROWS
        );
        area.draw(&Text::new(note, (16, y), style.color(&MUTED)))
            .map_err(draw_err)?;
    }
    Ok(())
}

/// `text` cut to `room` pixels, ending in "...".
fn fit(text: &str, room: i32, width: &impl Fn(&str) -> Result<i32, Error>) -> Result<String, Error> {
    if width(text)? <= room {
        return Ok(text.to_string());
    }
    let mut chars: Vec<char> = text.chars().collect();
    while !chars.is_empty() {
        chars.pop();
        let t: String = chars.iter().collect::<String>() + "...";
        if width(&t)? <= room {
            return Ok(t);
        }
    }
    Ok(String::new())
}
