//! Owns the OOM panels: per `oom/NNN/summary.json`, live bytes over the failing attempt by
//! category, and the largest live allocations beside it.
//! Keeps: reads only the summary the trainer wrote; a missing or bad one is a warning.
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Deserialize;
use std::path::Path;

use crate::draw::{draw_err, text, text_at, HPos, MUTED, PALETTE};
use crate::Error;

pub const PANEL: u32 = 340;
/// At most this many panels (the first ones: later OOMs usually repeat them).
pub const MAX_PANELS: usize = 8;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Allocation {
    pub bytes: u64,
    pub category: String,
    pub op: String,
    pub module: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Timeline {
    pub categories: Vec<String>,
    pub events: Vec<u64>,
    pub bytes: Vec<Vec<u64>>,
}

/// What a panel shows of one summary.json.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Oom {
    #[serde(skip)]
    pub folder: String,
    pub kind: String,
    pub limit_bytes: Option<u64>,
    pub live_bytes: u64,
    pub request_bytes: Option<u64>,
    pub text: String,
    pub largest: Vec<Allocation>,
    pub timeline: Timeline,
}

/// The run's OOM summaries in order (`oom/001`, ...); unreadable ones become warnings.
pub fn read(run_dir: &Path, warnings: &mut Vec<String>) -> Vec<Oom> {
    let mut dirs: Vec<_> = std::fs::read_dir(run_dir.join("oom"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs.into_iter()
        .filter_map(|d| {
            let p = d.join("summary.json");
            let parsed = std::fs::read_to_string(&p)
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str::<Oom>(&t).map_err(|e| e.to_string()));
            match parsed {
                Ok(mut o) => {
                    o.folder = format!("oom/{}", d.file_name().unwrap_or_default().to_string_lossy());
                    Some(o)
                }
                Err(e) => {
                    warnings.push(format!("{}: {e}", p.display()));
                    None
                }
            }
        })
        .collect()
}

fn label(category: &str) -> String {
    match category {
        "optimizer_state" => "optimizer state".into(),
        "loss_logits" => "loss/logits".into(),
        "failing_op" => "failing op's temporaries".into(),
        "allocator_reserve" => "allocator reserve".into(),
        c => c.replace('_', " "),
    }
}

fn color(categories: &[String], category: &str) -> RGBColor {
    PALETTE[categories
        .iter()
        .position(|c| c == category)
        .unwrap_or(PALETTE.len() - 1)
        % PALETTE.len()]
}

/// Draws one OOM's panel on `area` (the full width, PANEL high).
pub fn draw<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, o: &Oom) -> Result<(), Error> {
    let (head, body) = area.split_vertically(58);
    head.draw(&Text::new(
        format!(
            "{} ({})",
            o.folder,
            if o.kind == "end" { "at the end" } else { "out of memory" }
        ),
        (16, 8),
        text(16),
    ))
    .map_err(draw_err)?;
    // The paragraph, cut to what fits on two lines.
    let words: Vec<&str> = o.text.split_whitespace().collect();
    let (mut lines, mut line) = (Vec::new(), String::new());
    for w in words {
        if line.len() + w.len() + 1 > 190 {
            lines.push(std::mem::take(&mut line));
        }
        line = if line.is_empty() {
            w.to_string()
        } else {
            format!("{line} {w}")
        };
    }
    lines.push(line);
    for (i, l) in lines.iter().take(2).enumerate() {
        let l = if i == 1 && lines.len() > 2 {
            format!("{l} ...")
        } else {
            l.clone()
        };
        head.draw(&Text::new(l, (16, 30 + 14 * i as i32), text(11).color(&MUTED)))
            .map_err(draw_err)?;
    }
    let (w, _) = body.dim_in_pixel();
    let (left, right) = body.split_horizontally(w * 62 / 100);
    timeline(&left, o)?;
    largest(&right, o)
}

fn timeline<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, o: &Oom) -> Result<(), Error> {
    let t = &o.timeline;
    let top = t
        .bytes
        .iter()
        .map(|v| v.iter().sum::<u64>())
        .chain(o.limit_bytes)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let (div, unit) = crate::labels::bytes_unit(top);
    let x_max = t.events.last().copied().unwrap_or(1).max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .margin(8)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max, 0.0..top * 1.05 / div)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc("allocation events of the failing attempt")
        .y_desc(format!("live ({unit})"))
        .label_style(text(11))
        .axis_desc_style(text(12))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(draw_err)?;
    // Stacked: each category's band from the cumulative sum below it to the one with it.
    let mut below = vec![0.0; t.events.len()];
    for (c, name) in t.categories.iter().enumerate() {
        let above: Vec<f64> = below
            .iter()
            .zip(&t.bytes)
            .map(|(b, v)| b + v.get(c).copied().unwrap_or(0) as f64 / div)
            .collect();
        if above.iter().zip(&below).all(|(a, b)| a == b) {
            continue;
        }
        let mut polygon: Vec<(f64, f64)> = t.events.iter().zip(&above).map(|(&x, &y)| (x as f64, y)).collect();
        polygon.extend(t.events.iter().zip(&below).rev().map(|(&x, &y)| (x as f64, y)));
        let fill = color(&t.categories, name);
        chart
            .draw_series(std::iter::once(Polygon::new(polygon, fill.mix(0.75).filled())))
            .map_err(draw_err)?
            .label(label(name))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], fill.filled()));
        below = above;
    }
    if let Some(l) = o.limit_bytes {
        let y = l as f64 / div;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, y), (x_max, y)],
                BLACK.stroke_width(2),
            )))
            .map_err(draw_err)?
            .label("limit")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], BLACK.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(MUTED)
        .label_font(text(11))
        .draw()
        .map_err(draw_err)
}

fn largest<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, o: &Oom) -> Result<(), Error> {
    area.draw(&Text::new("largest live allocations", (8, 10), text(13)))
        .map_err(draw_err)?;
    let rows: Vec<&Allocation> = o.largest.iter().take(10).collect();
    let max = rows.first().map_or(1, |a| a.bytes.max(1)) as f64;
    let (w, _) = area.dim_in_pixel();
    let bar_w = (w as f64 * 0.28).max(40.0);
    for (i, a) in rows.iter().enumerate() {
        let y = 36 + i as i32 * 24;
        let len = (bar_w * a.bytes as f64 / max).max(2.0) as i32;
        area.draw(&Rectangle::new(
            [(8, y - 8), (8 + len, y + 8)],
            color(&o.timeline.categories, &a.category).filled(),
        ))
        .map_err(draw_err)?;
        let what = if a.op.is_empty() {
            "(no op)".to_string()
        } else {
            a.op.clone()
        };
        let module = if a.module.is_empty() {
            String::new()
        } else {
            format!(" in {}", a.module)
        };
        let size = if a.bytes < 1 << 20 {
            format!("{:.1} KiB", a.bytes as f64 / 1024.0)
        } else {
            crate::labels::human_bytes(a.bytes as f64)
        };
        let s = format!("{size}  {what}{module}  [{}]", label(&a.category));
        area.draw(&Text::new(s, (bar_w as i32 + 16, y), text_at(11, HPos::Left)))
            .map_err(draw_err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_summaries_in_order_and_warns_on_a_bad_one() {
        let dir = tempfile::tempdir().unwrap();
        for (n, body) in [
            ("002", "{\"kind\":\"oom\",\"live_bytes\":5}"),
            ("001", "{\"kind\":\"oom\",\"live_bytes\":3,\"extra\":1}"),
            ("003", "not json"),
        ] {
            std::fs::create_dir_all(dir.path().join("oom").join(n)).unwrap();
            std::fs::write(dir.path().join("oom").join(n).join("summary.json"), body).unwrap();
        }
        std::fs::create_dir_all(dir.path().join("oom/.004.1.tmp")).unwrap();
        let mut warnings = Vec::new();
        let o = read(dir.path(), &mut warnings);
        assert_eq!(
            o.iter().map(|o| (o.folder.as_str(), o.live_bytes)).collect::<Vec<_>>(),
            [("oom/001", 3), ("oom/002", 5)]
        );
        assert_eq!(warnings.len(), 1, "{warnings:?}");
    }
}
