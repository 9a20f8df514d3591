//! The README is a test. Every shell command of README.md and docs/getting-started.md (the
//! lines of their ```sh blocks, joined across trailing backslashes, comments left out) runs
//! here exactly as written, through `bash -c` from the repository root, or carries a mark in the
//! page saying why it is not run: `<!-- not run by tests/readme.rs: REASON -->` on the line
//! before its block (every command of the block), or `# (not run by tests/readme.rs: REASON)`
//! after the command. A command neither run here nor marked fails the test.
//!
//! The commands run the plain build, `./target/release/oomguard` (`cargo build --release`),
//! so this file is compiled only without the test hooks: `make test` runs the other tests with
//! them, then `cargo build --release` and `cargo test --release --test readme`. What the commands write stays out of the repository and the user's
//! cache: their micro-batch cache is a temp dir (OOMGUARD_CACHE), Python writes no bytecode
//! (PYTHONDONTWRITEBYTECODE), and the run directories they write under runs/ are removed
//! afterwards, any of the user's own of those names moved aside meanwhile and put back.
#![cfg(not(feature = "test-hooks"))]
mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The pages whose commands run.
const PAGES: [&str; 2] = ["README.md", "docs/getting-started.md"];

/// The mark of a command that is not run, followed by the reason.
const MARK: &str = "not run by tests/readme.rs:";

/// A command of a page, as the shell gets it.
#[derive(Debug, Clone, PartialEq)]
struct DocCommand {
    /// `page:line` of its first line.
    at: String,
    text: String,
    /// The mark's reason, when it is not run.
    not_run: Option<String>,
}

/// `line` without its shell comment: the comment starts at a `#` that begins a word, outside
/// quotes. Returns (code, comment).
fn split_comment(line: &str) -> (&str, &str) {
    let (mut single, mut double, mut prev) = (false, false, ' ');
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single && prev != '\\' => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return (&line[..i], &line[i + 1..]),
            _ => {}
        }
        prev = c;
    }
    (line, "")
}

/// The reason after MARK in `text`, up to the end of the comment or of the parenthesis.
fn mark_reason(text: &str) -> Option<String> {
    let rest = &text[text.find(MARK)? + MARK.len()..];
    let end = rest.find("-->").unwrap_or(rest.len());
    let reason = rest[..end].trim().trim_end_matches(')').trim();
    Some(reason.to_string())
}

/// The commands of a Markdown page's shell blocks (```sh, ```bash, ```shell).
fn doc_commands(page: &str, markdown: &str) -> Vec<DocCommand> {
    let mut out = vec![];
    let mut block: Option<Option<String>> = None; // inside a shell block: the block's mark
    let mut fence_open = false;
    let mut last_text = "";
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(lang) = trimmed.strip_prefix("```") {
            if fence_open {
                assert!(
                    pending.is_none(),
                    "{page}:{}: a shell block ends inside a command (a trailing backslash)",
                    i + 1
                );
                fence_open = false;
                block = None;
            } else {
                fence_open = true;
                if ["sh", "bash", "shell"].contains(&lang.trim()) {
                    block = Some(mark_reason(last_text).filter(|_| last_text.trim_start().starts_with("<!--")));
                }
            }
            continue;
        }
        if !line.trim().is_empty() {
            last_text = line;
        }
        let Some(block_mark) = &block else { continue };
        let (code, comment) = split_comment(line);
        let code = code.trim();
        let (start, mut text) = pending.take().unwrap_or((i + 1, String::new()));
        if code.is_empty() && text.is_empty() {
            continue;
        }
        if let Some(head) = code.strip_suffix('\\') {
            text.push_str(head.trim_end());
            text.push(' ');
            pending = Some((start, text));
            continue;
        }
        text.push_str(code);
        out.push(DocCommand {
            at: format!("{page}:{start}"),
            text: text.trim().to_string(),
            not_run: mark_reason(comment).or_else(|| block_mark.clone()),
        });
    }
    out
}

/// Every command of `pages` that is neither marked nor in `run`; and every one of `run` that
/// no page has (a step left behind by an edit).
fn unaccounted(commands: &[DocCommand], run: &[&str]) -> (Vec<String>, Vec<String>) {
    let unmarked: Vec<String> = commands
        .iter()
        .filter(|c| c.not_run.is_none() && !run.contains(&c.text.as_str()))
        .map(|c| format!("{}: `{}`", c.at, c.text))
        .collect();
    let gone: Vec<String> = run
        .iter()
        .filter(|r| !commands.iter().any(|c| c.not_run.is_none() && c.text == **r))
        .map(|r| format!("`{r}`"))
        .collect();
    (unmarked, gone)
}

/// The marks and the joining, on a page written for the purpose: a new unmarked command is
/// found, marked ones are not, continued lines are one command.
#[test]
fn commands_are_read_as_the_shell_reads_them_and_an_unmarked_one_is_found() {
    let page = "Intro `not code`.\n\n```yaml\nkey: value  # not a command\n```\n\n\
                ```sh\n# a comment line\nmake thing   # builds it\n./a --flag 'x # y' \\\n  --more   # continued\n\
                make gpu  # (not run by tests/readme.rs: needs a GPU)\n```\n\n\
                <!-- not run by tests/readme.rs: Docker -->\n```sh\ndocker run x\n```\n";
    let got = doc_commands("p.md", page);
    let want = [
        ("p.md:9", "make thing", None),
        ("p.md:10", "./a --flag 'x # y' --more", None),
        ("p.md:12", "make gpu", Some("needs a GPU")),
        ("p.md:17", "docker run x", Some("Docker")),
    ]
    .map(|(at, text, why)| DocCommand {
        at: at.into(),
        text: text.into(),
        not_run: why.map(String::from),
    });
    assert_eq!(got, want);
    let (unmarked, gone) = unaccounted(&got, &["make thing", "./a --flag 'x # y' --more", "make old"]);
    assert_eq!((unmarked, gone), (vec![], vec!["`make old`".to_string()]));
    let (unmarked, _) = unaccounted(&got, &["make thing"]);
    assert_eq!(unmarked, ["p.md:10: `./a --flag 'x # y' --more`"]);
}

const DEMO_50: &str = "./target/release/oomguard train configs/demo.yaml --set train.max_steps=50 --run-dir runs/mine";
const RESUME: &str = "./target/release/oomguard train --run-dir runs/mine --resume";
const REPORT: &str = "./target/release/oomguard report runs/mine";
const TINY_LM: &str = "./target/release/oomguard train examples/python/tiny_lm.yaml";
const LAUNCH: &str = "./target/release/oomguard launch --nproc-per-node 2 --no-python ./target/release/oomguard train configs/demo.yaml \
                      --max-steps 20 --run-dir runs/ddp";
const SWEEP: &str = "./target/release/oomguard sweep configs/demo-sweep.yaml";

/// A command this test runs, and the function that runs it and checks what it must show.
type Step = (&'static str, fn(&Shell));

/// The commands this test runs, in the pages' order, and what each must show.
const STEPS: [Step; 6] = [
    (DEMO_50, demo_stopped_after_its_first_steps),
    (RESUME, demo_resumed_to_its_end),
    (REPORT, demo_drawn),
    (TINY_LM, tiny_lm_recovers_its_oom),
    (LAUNCH, launch_trains_two_ranks),
    (SWEEP, sweep_starts_its_first_trial),
];

/// What the commands write under runs/ (relative to the repository, as they are run).
const WRITES: [&str; 4] = ["runs/mine", "runs/tiny_lm", "runs/ddp", "runs/demo-sweep"];

/// The repository root and the commands' environment.
struct Shell {
    root: PathBuf,
    cache: tempfile::TempDir,
    logs: tempfile::TempDir,
}

impl Shell {
    /// `bash -c CMD` from the repository root, in a process group of its own (signalled as a
    /// terminal's Ctrl-C signals one), its output in a log file. bash, not dash: it runs a
    /// single command in its own process (dash would die of the Ctrl-C before the command,
    /// which stops with a checkpoint, has exited).
    fn spawn(&self, cmd: &str) -> (Child, PathBuf) {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = self.logs.path().join(format!("{n}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let mut c = Command::new("bash");
        c.args(["-c", cmd])
            .current_dir(&self.root)
            .env("OOMGUARD_CACHE", self.cache.path())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .process_group(0);
        common::dies_with_test(&mut c);
        (c.spawn().unwrap_or_else(|e| panic!("`{cmd}`: {e}")), log)
    }

    /// Runs `cmd` to its end (within `limit`): its exit code and output.
    fn run(&self, cmd: &str, limit: Duration) -> (i32, String) {
        let (mut child, log) = self.spawn(cmd);
        let code = wait(&mut child, limit, cmd, &log);
        (code, read(&log))
    }

    /// Runs `cmd` until `shown` holds (within `limit`), then stops it with SIGINT, as Ctrl-C
    /// does: its exit code and output.
    fn run_until(&self, cmd: &str, limit: Duration, shown: impl Fn() -> bool) -> (i32, String) {
        let (mut child, log) = self.spawn(cmd);
        let t = Instant::now();
        while !shown() {
            if let Some(s) = child.try_wait().unwrap() {
                panic!("`{cmd}` ended ({s}) before showing it works:\n{}", read(&log));
            }
            if t.elapsed() > limit {
                stop(&child, libc::SIGKILL);
                panic!("`{cmd}` showed nothing within {limit:?}:\n{}", read(&log));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        stop(&child, libc::SIGINT);
        let code = wait(&mut child, Duration::from_secs(120), cmd, &log);
        (code, read(&log))
    }

    fn path(&self, p: &str) -> PathBuf {
        self.root.join(p)
    }
}

fn read(log: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned()
}

fn stop(child: &Child, signal: i32) {
    // SAFETY: signals the child's own process group (it was started with process_group(0)).
    unsafe { libc::kill(-(child.id() as i32), signal) };
}

fn wait(child: &mut Child, limit: Duration, cmd: &str, log: &Path) -> i32 {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s
                .code()
                .unwrap_or_else(|| panic!("`{cmd}` was killed ({s}):\n{}", read(log)));
        }
        if t.elapsed() > limit {
            stop(child, libc::SIGKILL);
            panic!("`{cmd}` still ran after {limit:?}:\n{}", read(log));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// metrics.jsonl's records of `run` with the given event, the lines a writer has finished.
fn events(run: &Path, event: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect()
}

fn steps(run: &Path) -> Vec<u64> {
    events(run, "step")
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect()
}

/// The demo, 50 steps, stopped (Ctrl-C) once it has logged 5 steps: its OOM at the start was
/// recovered (the micro-batch cache is empty), and it stopped with a checkpoint (exit 130).
fn demo_stopped_after_its_first_steps(sh: &Shell) {
    let run = sh.path("runs/mine");
    let (code, out) = sh.run_until(DEMO_50, Duration::from_secs(300), || steps(&run).len() >= 5);
    assert_eq!(code, 130, "{out}");
    assert!(!events(&run, "oom").is_empty(), "the demo's OOM: {out}");
    assert_eq!(events(&run, "stopped").len(), 1, "{out}");
}

/// The same run goes on where it stopped, to its 50 steps: each step trained once.
fn demo_resumed_to_its_end(sh: &Shell) {
    let run = sh.path("runs/mine");
    let before = steps(&run).len();
    let (code, out) = sh.run(RESUME, Duration::from_secs(600));
    assert_eq!(code, 0, "{out}");
    assert_eq!(steps(&run), (0..50).collect::<Vec<u64>>(), "{out}");
    assert!(before < 50, "stopped after {before} steps");
}

/// `oomguard report` draws the run into RUN_DIR/report.png.
fn demo_drawn(sh: &Shell) {
    let (code, out) = sh.run(REPORT, Duration::from_secs(120));
    assert_eq!(code, 0, "{out}");
    let png = std::fs::read(sh.path("runs/mine/report.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{out}");
}

/// The Python model trains in-process and recovers the OOM its 16 MiB budget causes (at its
/// first step): stopped with Ctrl-C once it has logged 5 steps, it checkpoints (exit 130),
/// each step logged once.
fn tiny_lm_recovers_its_oom(sh: &Shell) {
    let run = sh.path("runs/tiny_lm/001");
    let (code, out) = sh.run_until(TINY_LM, Duration::from_secs(300), || steps(&run).len() >= 5);
    assert_eq!(code, 130, "{out}");
    let ooms: Vec<u64> = events(&run, "oom")
        .iter()
        .map(|o| o["step"].as_u64().unwrap())
        .collect();
    assert_eq!(ooms.first(), Some(&0), "{out}");
    let logged = steps(&run);
    assert_eq!(logged, (0..logged.len() as u64).collect::<Vec<u64>>(), "{out}");
    assert_eq!(events(&run, "stopped").len(), 1, "{out}");
}

/// The launcher trains the demo on two ranks to its 20 steps.
fn launch_trains_two_ranks(sh: &Shell) {
    let run = sh.path("runs/ddp");
    let (code, out) = sh.run(LAUNCH, Duration::from_secs(600));
    assert_eq!(code, 0, "{out}");
    assert_eq!(steps(&run), (0..20).collect::<Vec<u64>>(), "{out}");
    let worlds: Vec<u64> = events(&run, "step")
        .iter()
        .map(|r| r["world_size"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(worlds, [2; 20], "{out}");
}

/// The sweep checks its trials (`base: demo.yaml`, beside the sweep file) and starts the first;
/// stopped once it has logged a step, the trial is recorded interrupted (exit 130).
fn sweep_starts_its_first_trial(sh: &Shell) {
    let out_dir = sh.path("runs/demo-sweep");
    let trial_steps = || {
        std::fs::read_dir(out_dir.join("trials"))
            .map(|d| d.flatten().map(|t| steps(&t.path()).len()).sum::<usize>())
            .unwrap_or(0)
    };
    let (code, out) = sh.run_until(SWEEP, Duration::from_secs(300), || trial_steps() >= 1);
    assert_eq!(code, 130, "{out}");
    let results = std::fs::read_to_string(out_dir.join("results.jsonl")).unwrap();
    let statuses: Vec<String> = results
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["status"].to_string())
        .collect();
    assert_eq!(statuses, ["\"interrupted\""], "{results}\n{out}");
}

/// The user's own runs/ entries of the names the commands write, moved aside while they run
/// and put back afterwards (also when the test fails); what the commands wrote is removed.
struct RunsAside {
    root: PathBuf,
    aside: PathBuf,
    runs_existed: bool,
    moved: Vec<&'static str>,
}

impl RunsAside {
    fn new(root: &Path) -> RunsAside {
        let runs = root.join("runs");
        let runs_existed = runs.exists();
        let aside = runs.join(format!(".readme-test-{}", std::process::id()));
        let mut moved = vec![];
        for w in WRITES {
            let p = root.join(w);
            if p.exists() {
                let to = aside.join(Path::new(w).strip_prefix("runs").unwrap());
                std::fs::create_dir_all(&aside).unwrap();
                std::fs::rename(&p, &to).unwrap();
                eprintln!(
                    "readme: {} moved to {} while the README's commands run",
                    p.display(),
                    to.display()
                );
                moved.push(w);
            }
        }
        RunsAside {
            root: root.to_path_buf(),
            aside,
            runs_existed,
            moved,
        }
    }
}

impl Drop for RunsAside {
    fn drop(&mut self) {
        for w in WRITES {
            let _ = std::fs::remove_dir_all(self.root.join(w));
        }
        for w in &self.moved {
            let from = self.aside.join(Path::new(w).strip_prefix("runs").unwrap());
            if let Err(e) = std::fs::rename(&from, self.root.join(w)) {
                eprintln!("readme: could not put {} back: {e}", from.display());
            }
        }
        let _ = std::fs::remove_dir(&self.aside);
        if !self.runs_existed {
            let _ = std::fs::remove_dir(self.root.join("runs"));
        }
    }
}

/// The names under runs/ (and one level down), to see that the commands wrote nothing else.
fn runs_listing(root: &Path) -> Vec<String> {
    let mut names = vec![];
    for e in std::fs::read_dir(root.join("runs")).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        names.push(name.clone());
        for f in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
            names.push(format!("{name}/{}", f.file_name().to_string_lossy()));
        }
    }
    names.sort();
    names
}

/// Every command of the two pages runs as written or is marked, and those that run show what
/// the README says they do; afterwards runs/ holds what it held before.
#[test]
fn the_readmes_commands_run_as_written() {
    let root = common::root();
    let commands: Vec<DocCommand> = PAGES
        .iter()
        .flat_map(|p| doc_commands(p, &std::fs::read_to_string(root.join(p)).unwrap()))
        .collect();
    let run: Vec<&str> = STEPS.iter().map(|(c, _)| *c).collect();
    let (unmarked, gone) = unaccounted(&commands, &run);
    assert!(
        unmarked.is_empty(),
        "commands neither run by tests/readme.rs nor marked `# ({MARK} REASON)` (or `<!-- {MARK} REASON -->` before their block): \
         {unmarked:#?}"
    );
    assert!(
        gone.is_empty(),
        "tests/readme.rs runs commands the pages no longer have: {gone:#?}"
    );
    for c in commands.iter().filter(|c| c.not_run.is_some()) {
        assert!(
            c.not_run.as_ref().is_some_and(|r| r.len() > 3),
            "{}: the mark gives no reason",
            c.at
        );
    }
    let plain = common::plain_bin();
    assert!(
        plain.is_file(),
        "{} is missing: the README's commands run it; `cargo build --release` (make test runs it)",
        plain.display()
    );
    let sh = Shell {
        root: root.clone(),
        cache: tempfile::tempdir().unwrap(),
        logs: tempfile::tempdir().unwrap(),
    };
    let before = runs_listing(&root);
    {
        let _aside = RunsAside::new(&root);
        let mut ran = vec![];
        for c in commands.iter().filter(|c| c.not_run.is_none()) {
            if ran.contains(&c.text) {
                continue;
            }
            let (_, step) = STEPS.iter().find(|(t, _)| *t == c.text).unwrap();
            eprintln!("readme: {}: {}", c.at, c.text);
            let t = Instant::now();
            step(&sh);
            eprintln!("readme: {:.1} s", t.elapsed().as_secs_f64());
            ran.push(c.text.clone());
        }
        let written: Vec<String> = runs_listing(&root)
            .into_iter()
            .filter(|n| !WRITES.iter().any(|w| format!("runs/{n}").starts_with(w)) && !n.starts_with(".readme-test-"))
            .filter(|n| !before.contains(n))
            .collect();
        assert!(
            written.is_empty(),
            "the commands wrote more under runs/ than WRITES names: {written:?}"
        );
    }
    assert_eq!(runs_listing(&root), before, "runs/ after the README's commands");
}

/// `./target/release/oomguard`, which the README runs, is the plain build: a test hook
/// (OOMGUARD_TEST_OOM_IN, an OOM in step 1's forward), which fails an allocation in the tests'
/// build (tests/shard.rs, tests/elastic.rs), does nothing there.
#[test]
fn the_readmes_binary_is_the_plain_build() {
    let plain = common::plain_bin();
    assert!(
        plain.is_file(),
        "{} is missing: `cargo build --release`",
        plain.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::write_config(dir.path(), "tiny.yaml", common::TINY);
    let run = dir.path().join("plain");
    let o = Command::new(&plain)
        .args(["train", cfg.to_str().unwrap(), "--max-steps", "2", "--run-dir"])
        .arg(&run)
        .env("OOMGUARD_CACHE", dir.path().join("cache"))
        .env("OOMGUARD_TEST_OOM_IN", "forward:0:1")
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}: {}", plain.display(), common::stderr(&o));
    assert_eq!(
        (events(&run, "oom").len(), steps(&run)),
        (0, vec![0, 1]),
        "{} honours a test hook: it is a test-hooks build (`cargo test --release --features oomguard/test-hooks` writes one there); \
         `cargo build --release` makes it the plain build again",
        plain.display()
    );
}
