//! `oomguard report` on real runs and sweeps, and `log.tensorboard`, through the binary.
mod common;

use common::{oomguard, records, stderr, train_at, write_config, TINY};
use oomguard_report::tensorboard::read_events;
use oomguard_report::{run_chart, sweep_chart, MarkerKind, RunSeries};
use std::path::Path;

/// (width, height) from a PNG's header, after checking its signature.
fn png_size(path: &Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
    let be = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap());
    (be(16), be(20))
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn report(args: &[&str], cwd: &Path) -> std::process::Output {
    let mut a = vec!["report"];
    a.extend_from_slice(args);
    oomguard(&a, cwd)
}

#[test]
fn a_recorded_run_with_an_oom_gives_pictures_whose_series_match_its_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/demo.yaml");
    let o = oomguard(
        &[
            "train",
            demo.to_str().unwrap(),
            "--max-steps",
            "6",
            "--run-dir",
            run.to_str().unwrap(),
            "--set",
            "train.eval_every=3",
            "--set",
            "train.num_threads=1",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!run.join("tensorboard").exists(), "log.tensorboard is off by default");

    // What the picture draws is what metrics.jsonl says.
    let s = RunSeries::read(&run.join("metrics.jsonl")).unwrap();
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    let steps = records(&run, "step");
    let ooms = records(&run, "oom");
    assert!(!ooms.is_empty(), "the demo's memory pressure makes its first step fail");
    assert_eq!(s.loss.len(), 6);
    assert_eq!(
        s.loss.iter().map(|p| p.0).collect::<Vec<_>>(),
        (0..6).collect::<Vec<u64>>()
    );
    assert_eq!(
        s.loss.iter().map(|p| p.1).collect::<Vec<_>>(),
        steps.iter().map(|r| r["loss"].as_f64().unwrap()).collect::<Vec<_>>()
    );
    let evals: Vec<(u64, f64)> = records(&run, "eval")
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), r["val_loss"].as_f64().unwrap()))
        .collect();
    assert_eq!(s.eval_loss, evals);
    assert_eq!(s.eval_loss.iter().map(|p| p.0).collect::<Vec<_>>(), [2, 5]);
    let oom_steps: Vec<u64> = s
        .markers
        .iter()
        .filter(|m| m.kind == MarkerKind::Oom)
        .map(|m| m.step)
        .collect();
    assert_eq!(
        oom_steps,
        ooms.iter().map(|r| r["step"].as_u64().unwrap()).collect::<Vec<_>>()
    );
    assert_eq!(oom_steps[0], 0);
    let after = ooms.last().unwrap()["new_micro_batch_size"].as_f64().unwrap();
    assert_eq!(
        s.micro_batch_size.last().unwrap().1,
        after,
        "the micro-batch the guard settled on"
    );
    assert_eq!(s.limit_bytes[0].1, 100.0 * 1048576.0, "the demo's 100MiB budget");
    assert!(s
        .live_bytes
        .iter()
        .zip(&s.peak_bytes)
        .all(|(l, p)| l.1 <= p.1 && l.1 > 0.0));

    // Default: RUN/report.png, the figures on stdout.
    let o = report(&[run.to_str().unwrap()], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    // A panel per OOM snapshot under the run's four (RUN_DIR/oom/NNN/, at most 8).
    let panels = ooms.len().min(oomguard_report::oom_chart::MAX_PANELS) as u32;
    assert_eq!(
        png_size(&run.join("report.png")),
        (
            run_chart::WIDTH,
            run_chart::HEIGHT + panels * oomguard_report::oom_chart::PANEL
        )
    );
    let out = stdout(&o);
    assert!(out.contains(&format!("OOMs                 {}", ooms.len())), "{out}");
    assert!(out.contains("steps                6"), "{out}");

    let svg_path = dir.path().join("r.svg");
    let o = report(
        &[run.to_str().unwrap(), "--out", svg_path.to_str().unwrap()],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
    for text in [
        "loss",
        "eval loss",
        "tokens/s",
        "memory (MiB)",
        "budget",
        "micro-batch size",
        "accumulation steps",
        "step",
        &format!("OOM, micro-batch halved ({})", ooms.len()),
    ] {
        assert!(svg.contains(&format!("\n{text}\n")), "the SVG lacks the text {text:?}");
    }

    let html_path = dir.path().join("r.html");
    let o = report(
        &[run.to_str().unwrap(), "--out", html_path.to_str().unwrap()],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let html = std::fs::read_to_string(&html_path).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>") && html.contains("<svg") && !html.contains("<script"));
    assert!(
        html.contains(&format!("<th>OOMs</th><td class=\"n\">{}</td>", ooms.len())),
        "{html}"
    );
    assert!(html.contains(&format!(
        "<th>best eval loss</th><td class=\"n\">{:.4}</td>",
        evals.iter().map(|e| e.1).fold(f64::MAX, f64::min)
    )));
}

const STEP: &str = concat!(
    r#"{"event":"step","step":STEP,"loss":5.0,"lr":0.001,"grad_norm":1.0,"tokens_per_s":1000.0,"micro_batch_size":8,"#,
    r#""grad_accum_steps":2,"num_samples":16,"world_size":1,"step_time_s":0.1,"elapsed_s":1.0,"#,
    r#""memory":{"live_bytes":1000,"peak_bytes":2000},"precision":"fp32","activation_checkpointing":false}"#
);

#[test]
fn a_truncated_last_line_still_gives_a_report_and_a_warning_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut text: String = (0..5).map(|s| STEP.replace("STEP", &s.to_string()) + "\n").collect();
    let torn = STEP.replace("STEP", "5");
    text.push_str(&torn[..torn.len() / 2]);
    std::fs::write(dir.path().join("metrics.jsonl"), text).unwrap();
    let o = report(&[dir.path().to_str().unwrap()], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("WARN") && err.contains("metrics.jsonl:6:") && err.contains("truncated"),
        "{err}"
    );
    assert!(stdout(&o).contains("steps                5"), "{}", stdout(&o));
    assert_eq!(
        png_size(&dir.path().join("report.png")),
        (run_chart::WIDTH, run_chart::HEIGHT)
    );
}

#[test]
fn a_sweep_gives_a_table_naming_the_best_trial_and_marking_the_infeasible_ones() {
    let dir = tempfile::tempdir().unwrap();
    let sweep = dir.path();
    let trial = |name: &str, status: &str, extra: &str, evals: &[(u64, f64)]| {
        if !evals.is_empty() {
            let run = sweep.join("trials").join(name);
            std::fs::create_dir_all(&run).unwrap();
            let lines: String = evals
                .iter()
                .map(|(s, v)| format!("{{\"event\":\"eval\",\"step\":{s},\"val_loss\":{v},\"eval_batch_size\":8}}\n"))
                .collect();
            std::fs::write(run.join("metrics.jsonl"), lines).unwrap();
        }
        format!(
            r#"{{"trial":"{name}","params":{{"optim.lr":0.001}},"status":"{status}","run_dir":"trials/{name}","duration_s":10.0{extra}}}"#
        ) + "\n"
    };
    let results = [
        trial(
            "000-aaaa",
            "ok",
            r#","best_eval_loss":2.5,"tokens_per_s":900.0,"ooms":0"#,
            &[(0, 4.0), (5, 2.5)],
        ),
        trial(
            "001-bbbb",
            "ok",
            r#","best_eval_loss":1.75,"tokens_per_s":800.0,"ooms":2"#,
            &[(0, 4.0), (5, 1.75)],
        ),
        trial(
            "002-cccc",
            "infeasible",
            r#","told_by":"planner","best_eval_loss":null"#,
            &[],
        ),
        trial(
            "003-dddd",
            "failed",
            r#","exit_code":1,"best_eval_loss":1.5"#,
            &[(0, 3.9)],
        ),
    ];
    std::fs::write(sweep.join("results.jsonl"), results.concat() + r#"{"trial":"004-ee"#).unwrap();

    let o = report(&[sweep.to_str().unwrap()], sweep);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("results.jsonl:5:"),
        "a torn last trial line warns: {}",
        stderr(&o)
    );
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "4 trials: 2 ok, 1 infeasible, 1 failed", "{out}");
    assert!(
        lines[2].starts_with("best  001-bbbb  ok"),
        "the best completed trial first, marked: {out}"
    );
    assert!(
        out.contains("002-cccc  infeasible (planner)") && out.contains("003-dddd  failed (exit 1)"),
        "{out}"
    );
    let (w, h) = png_size(&sweep.join("report.png"));
    assert_eq!(w, sweep_chart::WIDTH);
    assert!(h > 700, "the chart and the table: {h}");

    let html_path = sweep.join("sweep.html");
    let o = report(&[sweep.to_str().unwrap(), "--out", html_path.to_str().unwrap()], sweep);
    assert!(o.status.success(), "{}", stderr(&o));
    let html = std::fs::read_to_string(&html_path).unwrap();
    assert!(
        html.contains("<tr class=\"best\"><td>best</td><td><span class=\"swatch\""),
        "{html}"
    );
    assert!(html.contains("<td class=\"bad\">infeasible (planner)</td>"), "{html}");
    assert!(
        html.contains("\n002-cccc: infeasible (planner)\n"),
        "the chart's legend lists the trial without a line"
    );
}

#[test]
fn bad_input_exits_2_naming_the_file_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: [(&[&str], &str); 4] = [
        (&["nowhere"], "nowhere: no such directory"),
        (
            &["."],
            "no metrics.jsonl (a run directory) or results.jsonl (a sweep directory)",
        ),
        (&[".", "--out", "r.pdf"], "name a .png, .svg or .html file"),
        (&["garbage"], "no valid record in it (2 lines skipped)"),
    ];
    std::fs::create_dir(d.join("garbage")).unwrap();
    std::fs::write(d.join("garbage/metrics.jsonl"), "hello\nworld\n").unwrap();
    for (args, message) in cases {
        let o = report(args, d);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(message), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn log_tensorboard_writes_scalars_that_decode_with_the_runs_tags_and_steps() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let run = dir.path().join("run");
    let args = [
        "train",
        cfg.to_str().unwrap(),
        "--run-dir",
        run.to_str().unwrap(),
        "--set",
        "log.tensorboard=true",
        "--set",
        "train.eval_every=3",
        "--inject-oom",
        "1:5",
    ];
    let o = oomguard(&args, dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let files: Vec<_> = std::fs::read_dir(run.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0]
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("events.out.tfevents."));
    let events = read_events(&std::fs::read(&files[0]).unwrap()).unwrap();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    let series = |tag: &str| -> Vec<(u64, f32)> {
        events
            .iter()
            .flat_map(|e| e.values.iter().filter(|v| v.0 == tag).map(move |v| (e.step, v.1)))
            .collect()
    };
    let losses: Vec<(u64, f32)> = records(&run, "step")
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap() as f32))
        .collect();
    assert_eq!(series("train/loss"), losses);
    for tag in [
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/micro_batch_size",
        "train/grad_accum_steps",
        "memory/live_bytes",
        "memory/peak_bytes",
    ] {
        assert_eq!(series(tag).len(), losses.len(), "{tag}");
    }
    let evals: Vec<(u64, f32)> = records(&run, "eval")
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), r["val_loss"].as_f64().unwrap() as f32))
        .collect();
    assert_eq!(series("eval/val_loss"), evals);
    let ooms: Vec<(u64, f32)> = records(&run, "oom")
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), 1.0))
        .collect();
    assert!(!ooms.is_empty(), "--inject-oom makes one allocation fail");
    assert_eq!(series("guard/oom"), ooms);
}

#[test]
fn a_tensorboard_folder_that_cannot_be_written_warns_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(run.join("tensorboard"), "a file where the folder would go").unwrap();
    let o = train_at(
        dir.path(),
        &cfg,
        &run,
        &["--set", "log.tensorboard=true", "--max-steps", "2"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("log.tensorboard: cannot create an event file"),
        "{}",
        stderr(&o)
    );
    assert_eq!(records(&run, "step").len(), 2);
}

/// A diverged run: losses at the edge of f64 (and past it: inf is not JSON) still draw, as
/// PNG and HTML, within the test's time (the axis overflowed and the drawing never ended).
#[test]
fn a_diverged_runs_extreme_losses_still_draw() {
    let dir = tempfile::tempdir().unwrap();
    let losses = ["5.0", "-1e308", "1e308", "1.7976931348623157e308", "3.0"];
    let text: String = losses
        .iter()
        .enumerate()
        .map(|(s, l)| {
            STEP.replace("STEP", &s.to_string())
                .replace(r#""loss":5.0"#, &format!(r#""loss":{l}"#))
                + "\n"
        })
        .collect();
    std::fs::write(dir.path().join("metrics.jsonl"), text).unwrap();
    for out in ["r.png", "r.html"] {
        let o = report(&[dir.path().to_str().unwrap(), "--out", out], dir.path());
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(dir.path().join(out).metadata().unwrap().len() > 1000);
    }
}
