//! Owns `oomguard report` (pictures of a run or a sweep, as PNG, SVG or HTML) and the
//! TensorBoard event writer the trainer uses.
//! Keeps: no libtorch, no Python, no system fonts; a report comes out of whatever is readable.
//!
//! ```
//! // Two steps and an evaluation of a run, drawn as a self-contained HTML page.
//! let dir = tempfile::tempdir()?;
//! let step = |s: u64, loss: f64| {
//!     format!(concat!(
//!         r#"{{"event":"step","step":{s},"loss":{loss},"tokens_per_s":100.0,"micro_batch_size":8,"grad_accum_steps":1,"#,
//!         r#""memory":{{"live_bytes":1048576,"peak_bytes":2097152}}}}"#
//!     ), s = s, loss = loss)
//! };
//! let eval = r#"{"event":"eval","step":1,"val_loss":1.5}"#;
//! std::fs::write(dir.path().join("metrics.jsonl"), [step(0, 2.0), step(1, 1.0), eval.into()].join("\n"))?;
//! let outcome = oomguard_report::report(dir.path(), Some(&dir.path().join("run.html")))?;
//! assert!(outcome.out.is_file() && outcome.warnings.is_empty(), "{:?}", outcome.warnings);
//! assert!(outcome.text.contains("1.5"), "{}", outcome.text);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
use std::path::{Path, PathBuf};

pub use oomguard_runfiles::atomic;
pub mod draw;
pub mod html;
pub mod jsonl;
pub mod labels;
pub mod oom_chart;
pub mod run_chart;
pub mod series;
pub mod sweep;
pub mod sweep_chart;
pub mod tensorboard;

pub use series::{Marker, MarkerKind, RunSeries, Summary};
pub use sweep::{Sweep, Trial};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Exit code 2: the message names the file and the fix.
    #[error("{0}")]
    BadInput(String),
    #[error("{context} {path}: {source}")]
    Io {
        context: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("drawing the report: {0}")]
    Draw(String),
}

impl Error {
    pub fn io(path: &Path, context: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            context,
            path: path.to_path_buf(),
            source,
        }
    }

    /// 2 for bad input, 1 for anything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::BadInput(_) => 2,
            _ => 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Png,
    Svg,
    Html,
}

impl Format {
    /// From `--out`'s extension.
    pub fn of(out: &Path) -> Result<Format, Error> {
        let ext = out
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        match ext.as_str() {
            "png" => Ok(Format::Png),
            "svg" => Ok(Format::Svg),
            "html" | "htm" => Ok(Format::Html),
            _ => Err(Error::BadInput(format!(
                "--out {}: cannot tell the format from {}; name a .png, .svg or .html file",
                out.display(),
                if ext.is_empty() {
                    "a name without an extension".to_string()
                } else {
                    format!("the extension `.{ext}`")
                }
            ))),
        }
    }
}

/// What a report found: the file written, what to print, and the lines it had to skip.
#[derive(Debug)]
pub struct Outcome {
    pub out: PathBuf,
    /// The run's figures, or the sweep's table (printed to stdout).
    pub text: String,
    pub warnings: Vec<String>,
}

/// A directory's kind: a sweep has results.jsonl, a run metrics.jsonl.
pub enum Source {
    Run(Box<RunSeries>),
    Sweep(Sweep),
}

/// Reads DIR as a sweep or a run; bad input (no such folder, neither file) is exit code 2.
pub fn read(dir: &Path) -> Result<Source, Error> {
    if !dir.is_dir() {
        return Err(Error::BadInput(format!(
            "{}: no such directory; give a run directory (holding metrics.jsonl) or a sweep directory (holding results.jsonl)",
            dir.display()
        )));
    }
    if dir.join("results.jsonl").is_file() {
        return Ok(Source::Sweep(Sweep::read(dir)?));
    }
    let metrics = dir.join("metrics.jsonl");
    if !metrics.is_file() {
        return Err(Error::BadInput(format!(
            "{}: no metrics.jsonl (a run directory) or results.jsonl (a sweep directory) in it; give the --run-dir of `oomguard train` or the \
                directory of `oomguard sweep`",
            dir.display()
        )));
    }
    let series = RunSeries::read(&metrics)?;
    if series.steps == 0 && series.eval_loss.is_empty() && series.markers.is_empty() && !series.warnings.is_empty() {
        return Err(Error::BadInput(format!(
            "{}: no valid record in it ({} lines skipped); is it an oomguard metrics file?",
            metrics.display(),
            series.warnings.len()
        )));
    }
    Ok(Source::Run(Box::new(series)))
}

/// The directory a report reads: DIR, or the folder of a metrics.jsonl or results.jsonl
/// given instead (what a user who just opened that file types); another file is refused.
pub fn directory_of(path: &Path) -> Result<PathBuf, Error> {
    if !path.is_file() {
        return Ok(path.to_path_buf());
    }
    let named = |n: &str| path.file_name().is_some_and(|f| f == n);
    match path.parent() {
        Some(parent) if named("metrics.jsonl") || named("results.jsonl") => {
            Ok(if parent.as_os_str().is_empty() { PathBuf::from(".") } else { parent.to_path_buf() })
        }
        _ => Err(Error::BadInput(format!(
            "{}: a file, not a directory; give a run directory (holding metrics.jsonl) or a sweep directory (holding results.jsonl)",
            path.display()
        ))),
    }
}

/// `oomguard report DIR [--out FILE]`: writes the picture (default DIR/report.png). DIR may
/// also name the run's metrics.jsonl or the sweep's results.jsonl.
pub fn report(dir: &Path, out: Option<&Path>) -> Result<Outcome, Error> {
    let dir = &directory_of(dir)?;
    let out = out.map_or_else(|| dir.join("report.png"), Path::to_path_buf);
    let format = Format::of(&out)?;
    let source = read(dir)?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty() && !p.is_dir()) {
        return Err(Error::BadInput(format!(
            "--out {}: the folder {} does not exist; create it or write elsewhere",
            out.display(),
            parent.display()
        )));
    }
    let name = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let name = name
        .file_name()
        .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    let (bytes, text, warnings) = match source {
        Source::Run(mut s) => {
            let title = format!("oomguard run: {name}");
            let ooms = oom_chart::read(dir, &mut s.warnings);
            let shown = &ooms[..ooms.len().min(oom_chart::MAX_PANELS)];
            let (w, h) = (
                run_chart::WIDTH,
                run_chart::HEIGHT + shown.len() as u32 * oom_chart::PANEL,
            );
            let bytes = match format {
                Format::Png => png((w, h), |root| draw_run(root, &title, &s, shown))?,
                Format::Svg => svg((w, h), |root| draw_run(root, &title, &s, shown))?.into_bytes(),
                Format::Html => {
                    let svg = svg((w, h), |root| draw_run(root, &title, &s, shown))?;
                    html::run(&title, &s.summary(), &svg, &s.warnings).into_bytes()
                }
            };
            let mut text: String = s
                .summary()
                .rows()
                .iter()
                .map(|(k, v)| format!("{k:<20} {v}\n"))
                .collect();
            for o in &ooms {
                text += &format!("{:<20} {}\n", o.folder, o.text);
            }
            if ooms.len() > shown.len() {
                s.warnings.push(format!(
                    "{} snapshots under oom/: the picture shows the first {}",
                    ooms.len(),
                    shown.len()
                ));
            }
            (bytes, text, s.warnings)
        }
        Source::Sweep(s) => {
            let title = format!("oomguard sweep: {name}");
            let w = sweep_chart::WIDTH;
            let bytes = match format {
                Format::Png => png((w, sweep_chart::height(&s, true)), |root| {
                    sweep_chart::draw(root, &title, &s, true)
                })?,
                Format::Svg => svg((w, sweep_chart::height(&s, true)), |root| {
                    sweep_chart::draw(root, &title, &s, true)
                })?
                .into_bytes(),
                Format::Html => {
                    let svg = svg((w, sweep_chart::height(&s, false)), |root| {
                        sweep_chart::draw(root, &title, &s, false)
                    })?;
                    html::sweep(&title, &s, &svg, &s.warnings).into_bytes()
                }
            };
            (bytes, format!("{}\n{}", s.counts(), s.text_table()), s.warnings)
        }
    };
    // Written whole: a reader never sees half a picture.
    atomic::write(&out, &bytes).map_err(|e| Error::io(&out, "cannot write", e))?;
    Ok(Outcome { out, text, warnings })
}

/// The run's picture, then a panel per OOM snapshot below it.
fn draw_run<DB: plotters::prelude::DrawingBackend>(
    root: &Root<DB>,
    title: &str,
    s: &RunSeries,
    ooms: &[oom_chart::Oom],
) -> Result<(), Error> {
    root.fill(&plotters::style::colors::WHITE).map_err(draw::draw_err)?;
    let (run, rest) = root.split_vertically(run_chart::HEIGHT);
    run_chart::draw(&run, title, s)?;
    if ooms.is_empty() {
        return Ok(());
    }
    for (o, area) in ooms.iter().zip(rest.split_evenly((ooms.len(), 1)).iter()) {
        oom_chart::draw(area, o)?;
    }
    Ok(())
}

type Root<'a, DB> = plotters::drawing::DrawingArea<DB, plotters::coord::Shift>;

fn svg(
    size: (u32, u32),
    draw: impl FnOnce(&Root<plotters::backend::SVGBackend>) -> Result<(), Error>,
) -> Result<String, Error> {
    use plotters::prelude::IntoDrawingArea;
    let mut buf = String::new();
    {
        let root = plotters::backend::SVGBackend::with_string(&mut buf, size).into_drawing_area();
        draw(&root)?;
        root.present().map_err(draw::draw_err)?;
    }
    Ok(buf)
}

/// The picture's pixels, RGB, row by row.
fn pixels(
    size: (u32, u32),
    draw: impl FnOnce(&Root<plotters::backend::BitMapBackend>) -> Result<(), Error>,
) -> Result<Vec<u8>, Error> {
    use plotters::prelude::IntoDrawingArea;
    let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = plotters::backend::BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area();
        draw(&root)?;
        root.present().map_err(draw::draw_err)?;
    }
    Ok(rgb)
}

fn png(
    size: (u32, u32),
    draw: impl FnOnce(&Root<plotters::backend::BitMapBackend>) -> Result<(), Error>,
) -> Result<Vec<u8>, Error> {
    let rgb = pixels(size, draw)?;
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, size.0, size.1);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Default);
    let mut writer = encoder.write_header().map_err(draw::draw_err)?;
    writer.write_image_data(&rgb).map_err(draw::draw_err)?;
    writer.finish().map_err(draw::draw_err)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pixels darker than the background inside a box of the picture.
    fn ink(rgb: &[u8], width: u32, (x0, y0, x1, y1): (u32, u32, u32, u32)) -> usize {
        let mut n = 0;
        for y in y0..y1 {
            for x in x0..x1 {
                let i = ((y * width + x) * 3) as usize;
                n += usize::from(rgb[i..i + 3].iter().all(|&c| c < 160));
            }
        }
        n
    }

    #[test]
    fn the_png_shows_its_text_with_the_embedded_font() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        std::fs::write(&p, "{\"event\":\"step\",\"step\":0,\"loss\":5.0,\"tokens_per_s\":10.0,\"micro_batch_size\":8,\"grad_accum_steps\":1}\n").unwrap();
        let s = RunSeries::read(&p).unwrap();
        let size = (run_chart::WIDTH, run_chart::HEIGHT);
        let rgb = pixels(size, |root| run_chart::draw(root, "oomguard run: TITLE", &s)).unwrap();
        // The title, 22 px at (16, 10): a few hundred dark pixels where it is, none beyond it.
        let title = ink(&rgb, size.0, (16, 8, 260, 36));
        assert!(title > 300, "the title drew {title} dark pixels: no font?");
        assert_eq!(ink(&rgb, size.0, (400, 8, 1300, 36)), 0);
        // The y-axis description of the loss panel, written upwards left of its axis.
        assert!(ink(&rgb, size.0, (0, 110, 30, 380)) > 50);
    }

    #[test]
    fn a_runs_metrics_file_names_its_directory_and_another_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let metrics = d.path().join("metrics.jsonl");
        std::fs::write(&metrics, "").unwrap();
        assert_eq!(directory_of(&metrics).unwrap(), d.path());
        assert_eq!(directory_of(d.path()).unwrap(), d.path());
        let other = d.path().join("config.yaml");
        std::fs::write(&other, "").unwrap();
        let e = directory_of(&other).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("a file, not a directory"), "{e}");
    }

    #[test]
    fn the_format_follows_the_extension_and_an_unknown_one_is_bad_input() {
        assert_eq!(Format::of(Path::new("a/b.PNG")).unwrap(), Format::Png);
        assert_eq!(Format::of(Path::new("r.html")).unwrap(), Format::Html);
        let e = Format::of(Path::new("r.pdf")).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains(".png, .svg or .html"), "{e}");
    }
}
