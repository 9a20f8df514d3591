//! `make bench` (report): wall time and peak memory of `oomguard report` on a synthetic
//! 100,000-step metrics.jsonl (an OOM every 7,000 steps and a grow-back between, a resume,
//! a shrink, an evaluation every 500 steps, CUDA-style memory stats), median of 5 per
//! format. The report must stay well under a few seconds on a run this long.
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Instant;

/// A run's records as the trainer writes them (the shape of src/metrics.rs's Record).
fn write_metrics(path: &std::path::Path) -> usize {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let (mut mb, mut acc, mut records) = (16u64, 2u64, 0);
    let mut line = |out: &mut std::io::BufWriter<std::fs::File>, text: String| {
        writeln!(out, "{text}").unwrap();
        records += 1;
    };
    let mut noise = 0x2545_f491_4f6c_dd1du64;
    for s in 0..100_000u64 {
        if s % 7000 == 50 {
            line(
                &mut out,
                format!(
                    concat!(
                        r#"{{"event":"oom","step":{s},"phase":"forward","source":"cuda","requested_bytes":1073741824,"#,
                        r#""memory_before":1,"memory_after_cleanup":1,"limit_bytes":85899345920,"old_micro_batch_size":{mb},"#,
                        r#""new_micro_batch_size":{},"time_lost_s":0.1,"message":"CUDA out of memory"}}"#
                    ),
                    mb / 2,
                    s = s,
                    mb = mb
                ),
            );
            (mb, acc) = (mb / 2, acc * 2);
        }
        if s % 7000 == 3000 && mb < 16 {
            line(
                &mut out,
                format!(
                    r#"{{"event":"grow","step":{s},"old_micro_batch_size":{mb},"new_micro_batch_size":{},"reason":"headroom"}}"#,
                    mb * 2
                ),
            );
            (mb, acc) = (mb * 2, acc / 2);
        }
        if s == 40_000 {
            line(
                &mut out,
                format!(r#"{{"event":"resumed","step":{s},"checkpoint":"runs/x/checkpoints/step-00040000"}}"#),
            );
        }
        if s == 60_000 {
            line(
                &mut out,
                format!(
                    r#"{{"event":"shrink","step":{s},"old_micro_batch_size":{mb},"new_micro_batch_size":{mb},"reason":"thrash"}}"#
                ),
            );
        }
        noise ^= noise << 13;
        noise ^= noise >> 7;
        noise ^= noise << 17;
        let jitter = (noise % 1000) as f64 / 1000.0 - 0.5;
        let loss = 1.5 + 4.0 * (-(s as f64) / 8000.0).exp() + 0.2 * jitter;
        let live = ((30.0 + 5.0 * (s as f64 / 3000.0).sin()) * (1u64 << 30) as f64) as u64;
        line(
            &mut out,
            format!(
                concat!(
                    r#"{{"event":"step","step":{s},"loss":{loss},"lr":0.001,"grad_norm":1.0,"tokens_per_s":{},"#,
                    r#""micro_batch_size":{mb},"grad_accum_steps":{acc},"num_samples":32,"world_size":1,"step_time_s":0.5,"#,
                    r#""elapsed_s":{},"memory":{{"live_bytes":{live},"peak_bytes":{},"reserved_bytes":{},"#,
                    r#""limit_bytes":85899345920,"alloc_retries":0,"device_free_bytes":1}},"precision":"bf16","#,
                    r#""activation_checkpointing":false}}"#
                ),
                250_000.0 + 16_000.0 * jitter,
                s as f64 * 0.5,
                live * 9 / 5,
                live * 2,
                s = s,
                loss = loss,
                mb = mb,
                acc = acc,
                live = live
            ),
        );
        if s % 500 == 499 {
            line(
                &mut out,
                format!(
                    r#"{{"event":"eval","step":{s},"val_loss":{},"eval_batch_size":32}}"#,
                    1.6 + 4.0 * (-(s as f64) / 8000.0).exp()
                ),
            );
        }
    }
    records
}

fn peak_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let records = write_metrics(&metrics);
    let size = std::fs::metadata(&metrics).unwrap().len();
    println!("report: 100,000 steps, {records} records, {:.1} MB", size as f64 / 1e6);
    for ext in ["png", "svg", "html"] {
        let out = dir.path().join(format!("report.{ext}"));
        let mut runs = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let mut child = Command::new(env!("CARGO_BIN_EXE_oomguard"))
                .args(["report", dir.path().to_str().unwrap(), "--out", out.to_str().unwrap()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let mut peak = 0;
            while child.try_wait().unwrap().is_none() {
                peak = peak.max(peak_kib(child.id()).unwrap_or(0));
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            runs.push((t.elapsed().as_secs_f64(), peak));
        }
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (secs, peak) = runs[runs.len() / 2];
        println!(
            "report --out .{ext}: median {secs:.3} s (min {:.3} s), peak memory {:.0} MiB",
            runs[0].0,
            peak as f64 / 1024.0
        );
    }
}
