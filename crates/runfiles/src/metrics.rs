//! Owns what happens to metrics.jsonl when a run resumes at an earlier step than it had
//! recorded (a kill after the last checkpoint, an elastic round, a script's own resume).
//! Keeps: metrics.jsonl reads as one uninterrupted run, and no line written is lost: the
//! records of steps the resumed run redoes, and a torn last line, move to
//! metrics.replaced.jsonl.
use std::io::Write;
use std::path::Path;

/// Splits metrics.jsonl's text into the lines to keep and those the resumed run replaces:
/// records of steps at or after `next_step` (an `auto_micro_batch` record of `next_step`
/// itself stays: the search ran before its step and is not redone) and unreadable lines.
pub fn split(text: &str, next_step: u64) -> (String, String) {
    let (mut keep, mut replaced) = (String::new(), String::new());
    for line in text.lines() {
        let v = serde_json::from_str::<serde_json::Value>(line).ok();
        let step = v.as_ref().and_then(|v| v.get("step").and_then(|s| s.as_u64()));
        let before = v.as_ref().is_some_and(|v| v["event"] == "auto_micro_batch");
        let out = if step.is_some_and(|s| s < next_step || (before && s <= next_step)) {
            &mut keep
        } else {
            &mut replaced
        };
        out.push_str(line);
        out.push('\n');
    }
    (keep, replaced)
}

/// Applies `split` to `dir`/metrics.jsonl: the replaced lines are appended to
/// metrics.replaced.jsonl (synced) before metrics.jsonl is rewritten whole. Returns how many
/// lines moved.
pub fn resume(dir: &Path, next_step: u64) -> std::io::Result<usize> {
    let path = dir.join("metrics.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let (keep, replaced) = split(&text, next_step);
    if replaced.is_empty() {
        return Ok(0);
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("metrics.replaced.jsonl"))?;
    f.write_all(replaced.as_bytes())?;
    f.sync_all()?;
    crate::atomic::write(&path, keep.as_bytes())?;
    Ok(replaced.lines().count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_steps_and_torn_lines_move_and_nothing_is_lost() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"event":"step","step":0}"#,
            r#"{"event":"oom","step":1}"#,
            r#"{"event":"step","step":1}"#,
            r#"{"event":"auto_micro_batch","step":2}"#,
            r#"{"event":"step","step":2}"#,
            r#"{"event":"st"#,
        ];
        std::fs::write(dir.path().join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
        assert_eq!(resume(dir.path(), 2).unwrap(), 2);
        let kept = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        let moved = std::fs::read_to_string(dir.path().join("metrics.replaced.jsonl")).unwrap();
        assert_eq!(kept, lines[..4].join("\n") + "\n");
        assert_eq!(moved, lines[4..].join("\n") + "\n");
        // Nothing later than the step: nothing moves, nothing is rewritten.
        assert_eq!(resume(dir.path(), 9).unwrap(), 0);
        assert_eq!(resume(&dir.path().join("none"), 0).unwrap(), 0);
    }
}
