//! The manual against the code: every config key the config types accept is in
//! docs/configuration.md and every key there is accepted; every subcommand's flags in the real
//! binary's `--help` are the ones docs/cli.md lists; every relative link (and #anchor) in
//! README.md and docs/ resolves; every docs page opens with what its reader is trying to do.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use oomguard::config::RawConfig;

const PROBE: &str = "__probe";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fields serde knows at `path` (a section, or a nested section), read from its own
/// `deny_unknown_fields` error for an unknown key there; `None` where `path` is not a struct
/// (a value, a list, a free-form map).
fn serde_fields(path: &[String]) -> Option<Vec<String>> {
    let mut yaml = format!("{{{PROBE}: 1}}");
    for key in path.iter().rev() {
        yaml = format!("{{{key}: {yaml}}}");
    }
    let err = serde_yaml::from_str::<RawConfig>(&yaml).err()?.to_string();
    let rest = err.split(&format!("unknown field `{PROBE}`")).nth(1)?;
    let expected = rest.split(" at line ").next().unwrap_or(rest);
    Some(expected.split('`').skip(1).step_by(2).map(str::to_string).collect())
}

/// Every key the config types accept, dotted (`train.grad_scaler.init_scale`), found by
/// walking serde's field lists: a key added to any section's struct shows up here.
fn config_keys() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut todo: Vec<Vec<String>> = vec![vec![]];
    while let Some(path) = todo.pop() {
        match serde_fields(&path) {
            Some(fields) => {
                assert!(
                    !fields.is_empty() || !path.is_empty(),
                    "no sections found: {:?}",
                    serde_fields(&[])
                );
                for f in fields {
                    todo.push(path.iter().cloned().chain([f]).collect());
                }
            }
            None => {
                keys.insert(path.join("."));
            }
        }
    }
    keys
}

/// The first backticked word of each table row in `text`.
fn table_keys(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| l.split('`').next().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn the_configuration_reference_lists_every_key_and_only_real_keys() {
    let keys = config_keys();
    assert!(
        keys.contains("train.grad_scaler.init_scale") && keys.contains("model.settings"),
        "the walk missed nested or optional keys: {keys:?}"
    );
    let doc = read(&root().join("docs/configuration.md"));
    let listed = table_keys(&doc);
    let listed_set: BTreeSet<String> = listed.iter().cloned().collect();
    assert_eq!(
        listed.len(),
        listed_set.len(),
        "a key is listed twice in docs/configuration.md"
    );
    let missing: Vec<_> = keys.difference(&listed_set).collect();
    let unknown: Vec<_> = listed_set.difference(&keys).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/configuration.md is out of step with the config types:\n  keys the code accepts and the page lacks (add a row, from the field's doc \
            comment): {missing:?}\n  keys the page lists that the code refuses (remove or rename): {unknown:?}"
    );
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_oomguard"))
        .args(args)
        .arg("--help")
        .output()
        .expect("running oomguard --help");
    assert!(out.status.success(), "oomguard {args:?} --help exited {:?}", out.status);
    String::from_utf8(out.stdout).expect("utf-8 help")
}

/// `--set <KEY.PATH=VALUE>`, `-r, --redirects <REDIRECTS>`: each option's signature, as
/// `--help` prints it (short and long forms on one line, the description after two spaces
/// or on the next lines).
fn help_flags(text: &str) -> BTreeSet<String> {
    let options = text.split("\nOptions:\n").nth(1).expect("an Options section");
    options
        .lines()
        .filter(|l| l.len() - l.trim_start().len() <= 6 && l.trim_start().starts_with('-'))
        .map(|l| l.trim().split("  ").next().unwrap_or_default().to_string())
        .filter(|sig| sig != "-h, --help")
        .collect()
}

fn subcommands() -> Vec<String> {
    let top = help(&[]);
    let commands = top.split("\nCommands:\n").nth(1).expect("a Commands section");
    commands
        .lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

#[test]
fn the_command_line_reference_lists_each_subcommands_flags() {
    let doc = read(&root().join("docs/cli.md"));
    let mut sections: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for part in doc.split("\n## oomguard ").skip(1) {
        let (name, body) = part.split_once('\n').unwrap_or((part, ""));
        let body = body.split("\n## ").next().unwrap_or(body);
        sections.insert(
            name.trim().to_string(),
            table_keys(body).into_iter().filter(|k| k.starts_with('-')).collect(),
        );
    }
    let subs = subcommands();
    assert!(subs.len() >= 5, "subcommands: {subs:?}");
    let mut problems = vec![];
    for sub in &subs {
        let flags = help_flags(&help(&[sub]));
        assert!(
            flags.contains("--log-format <LOG_FORMAT>"),
            "{sub}: help parsed as {flags:?}"
        );
        let Some(listed) = sections.get(sub) else {
            problems.push(format!("`oomguard {sub}` has no `## oomguard {sub}` section"));
            continue;
        };
        for f in flags.difference(listed) {
            problems.push(format!("oomguard {sub}: `{f}` is in --help, not in docs/cli.md"));
        }
        for f in listed.difference(&flags) {
            problems.push(format!("oomguard {sub}: `{f}` is in docs/cli.md, not in --help"));
        }
    }
    for name in sections.keys().filter(|n| !subs.contains(n)) {
        problems.push(format!("docs/cli.md documents `oomguard {name}`, which does not exist"));
    }
    assert!(
        problems.is_empty(),
        "docs/cli.md is out of step with --help:\n  {}",
        problems.join("\n  ")
    );
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens, and
/// `-1`, `-2` ... for repeats.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut in_code = false;
    for line in markdown.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        }
        let Some(title) = line
            .strip_prefix('#')
            .filter(|_| !in_code)
            .map(|t| t.trim_start_matches('#'))
        else {
            continue;
        };
        let slug: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 { slug.clone() } else { format!("{slug}-{n}") });
        *n += 1;
    }
    out
}

/// `[text](target)` and `![alt](target)` targets of a Markdown file, outside code blocks.
fn links(markdown: &str) -> Vec<String> {
    let mut out = vec![];
    let mut in_code = false;
    for line in markdown.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        }
        if in_code {
            continue;
        }
        for part in line.split("](").skip(1) {
            if let Some(end) = part.find(')') {
                out.push(part[..end].to_string());
            }
        }
    }
    out
}

fn manual() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

#[test]
fn every_relative_link_in_the_manual_resolves() {
    let files = manual();
    assert!(files.len() > 10, "docs pages: {files:?}");
    let mut broken = vec![];
    let mut checked = 0;
    for file in &files {
        let text = read(file);
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = link
                .split_once('#')
                .map_or((link.as_str(), None), |(p, a)| (p, Some(a)));
            let target = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !target.exists() {
                broken.push(format!("{}: `{link}`: no such file", file.display()));
                continue;
            }
            if let Some(a) = anchor.filter(|_| target.extension().is_some_and(|e| e == "md")) {
                if !anchors(&read(&target)).contains(a) {
                    broken.push(format!(
                        "{}: `{link}`: no heading with that anchor in {}",
                        file.display(),
                        target.display()
                    ));
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} links found");
    assert!(broken.is_empty(), "broken links:\n  {}", broken.join("\n  "));
}

#[test]
fn the_readme_is_short_and_each_page_says_whom_it_is_for() {
    let readme = read(&root().join("README.md"));
    assert!(
        readme.lines().count() <= 180,
        "README.md has {} lines: keep it about 150, move the rest to docs/",
        readme.lines().count()
    );
    for file in manual().iter().skip(1) {
        let text = read(file);
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let title = lines.next().unwrap_or_default();
        let opening = lines.next().unwrap_or_default();
        assert!(
            title.starts_with("# ") && opening.starts_with("*You "),
            "{}: a page opens with its title, then what its reader is trying to do \
            (`*You want ...*`); found {title:?} / {opening:?}",
            file.display()
        );
    }
}

/// Every environment variable the code names: an `OOMGUARD_*` string anywhere in the
/// sources (Rust, C++, the Python front, the scripts), and every name a Rust
/// `env::var`/`var_os` reads.
fn variables_in_code() -> BTreeSet<String> {
    let mut files = vec![];
    let mut todo: Vec<PathBuf> = [
        "src",
        "crates",
        "csrc",
        "python/src",
        "python/oomguard",
        "scripts",
        "tests",
    ]
    .iter()
    .map(|d| root().join(d))
    .collect();
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() && !p.ends_with("target") {
                todo.push(p);
            } else if ["rs", "cpp", "h", "py", "sh"]
                .iter()
                .any(|x| p.extension().is_some_and(|e| e == *x))
            {
                files.push(p);
            }
        }
    }
    let mut names = BTreeSet::new();
    for f in files {
        let text = read(&f);
        let mut rest = text.as_str();
        while let Some(i) = rest.find("OOMGUARD_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            names.insert(name.trim_end_matches('_').to_string());
            rest = &rest[i + 9..];
        }
        for call in ["var(\"", "var_os(\""] {
            let mut rest = text.as_str();
            while let Some(i) = rest.find(call) {
                let tail = &rest[i + call.len()..];
                let name: String = tail.chars().take_while(|c| *c != '"').collect();
                if name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                {
                    names.insert(name);
                }
                rest = tail;
            }
        }
    }
    names
}

#[test]
fn the_environment_page_lists_every_variable_the_code_reads() {
    let page = read(&root().join("docs/environment.md"));
    let names = variables_in_code();
    // The page itself, and the prefix spelt alone in prose, are not variables.
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| n.as_str() != "OOMGUARD" && !page.contains(&format!("`{n}`")))
        .collect();
    assert!(
        names.contains("OOMGUARD_CACHE") && names.contains("WORLD_SIZE"),
        "the scan found {names:?}"
    );
    assert!(missing.is_empty(), "docs/environment.md lists no row for {missing:?}");
}
