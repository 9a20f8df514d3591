//! Owns W&B's `command`: reading its macros and expanding them for a trial.
//! Keeps: a command is `oomguard train [BASE]` with parameter macros or `oomguard launch ...`
//! with at least one; anything else is refused at load, naming `command`.
use serde_json::Value;
use std::path::{Path, PathBuf};

use super::spec::Trial;
use oomguard_console::ConfigError;

/// What each trial runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Runner {
    /// `oomguard train BASE --set KEY=VALUE ...` (BASE resolved against the sweep file).
    Train { base: PathBuf },
    /// A script of the user's through `oomguard launch`: the words after `launch`, with the
    /// parameter macros still in place (expanded per trial by `Runner::launch_args`).
    /// `script`: `program`'s file, when the command runs it as a Python script.
    Launch {
        words: Vec<String>,
        script: Option<PathBuf>,
    },
}

/// W&B's command macros, and what each means here.
/// (`${envvar:NAME}` is the eighth: the variable's value, within any word, before the rest.)
const MACROS: [(&str, &str); 8] = [
    ("${env}", "dropped (oomguard is not run by /usr/bin/env)"),
    ("${interpreter}", "dropped (oomguard launch runs a script with python3)"),
    ("${program}", "`program`"),
    ("${args}", "--KEY=VALUE per parameter"),
    (
        "${args_no_boolean_flags}",
        "--KEY=VALUE per parameter, --KEY for a true one, nothing for a false one",
    ),
    ("${args_no_hyphens}", "KEY=VALUE per parameter"),
    ("${args_json}", "the parameters as one JSON object"),
    ("${args_json_file}", "a file holding that JSON object"),
];

fn is_args(w: &str) -> bool {
    w.starts_with("${args")
}

/// `${envvar:NAME}` in `word`, as W&B's agent expands it before the other macros: NAME's value
/// in `env`, or NAME itself when it is unset (W&B's `create_sweep_command`). NAME is W&B's
/// `[A-Z0-9_]*`; anything else is left as it is (and refused as an unknown macro).
pub fn expand_envvars(word: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    const OPEN: &str = "${envvar:";
    let mut out = String::new();
    let mut rest = word;
    while let Some(i) = rest.find(OPEN) {
        let after = &rest[i + OPEN.len()..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(after.len());
        if !after[name_len..].starts_with('}') {
            out.push_str(&rest[..i + OPEN.len()]);
            rest = after;
            continue;
        }
        let name = &after[..name_len];
        out.push_str(&rest[..i]);
        out.push_str(&env(name).unwrap_or_else(|| name.to_string()));
        rest = &after[name_len + 1..];
    }
    out.push_str(rest);
    out
}

/// Reads W&B's `command` (`program` fills `${program}`): the runner, and the notice saying how
/// it was read. `base` is the sweep file's `base`, if it gives one.
pub fn read(
    c: &serde_yaml::Value,
    program: Option<&serde_yaml::Value>,
    base: Option<&Path>,
) -> Result<(Runner, String), ConfigError> {
    let shown = base.map_or("BASE".into(), |b| b.display().to_string());
    let nearest = format!(
        "give command: [oomguard, train, ${{args}}] (each trial `oomguard train {shown} --set KEY=VALUE ...`), \
         or [oomguard, launch, ${{program}}, ${{args}}] with program: your script (it runs under `oomguard launch`), or leave command out"
    );
    let refuse = |why: String| ConfigError::invalid("command", format!("{why}; {nearest}"));
    let Some(items) = c.as_sequence() else {
        return Err(refuse("is not a list (W&B's schema: type array)".into()));
    };
    let mut words: Vec<String> = vec![];
    let mut script = None;
    for item in items {
        let w = match item {
            serde_yaml::Value::String(s) => expand_envvars(s, &|v| std::env::var(v).ok()),
            serde_yaml::Value::Number(n) => n.to_string(),
            other => return Err(refuse(format!("holds {other:?}, not a word"))),
        };
        if w.contains("${") && !MACROS.iter().any(|(m, _)| *m == w) {
            let known = MACROS.map(|m| m.0).join(", ") + ", ${envvar:NAME}";
            return Err(refuse(format!("`{w}` is not one of W&B's macros ({known})")));
        }
        match w.as_str() {
            "${env}" | "${interpreter}" => {}
            "${program}" => match program.and_then(|p| p.as_str()) {
                Some(p) => {
                    let not_a_file = ["-m", "--module", "--no-python", "--no_python"];
                    if !words.iter().any(|w| not_a_file.contains(&w.as_str())) {
                        script = p.split_whitespace().next().map(PathBuf::from);
                    }
                    words.extend(p.split_whitespace().map(String::from));
                }
                None => return Err(refuse("uses ${program} but `program` is not given".into())),
            },
            _ => words.push(w),
        }
    }
    let is_oomguard = |w: &str| Path::new(w).file_name().is_some_and(|n| n == "oomguard");
    let passes_none =
        "passes no parameters (none of ${args}, ${args_no_boolean_flags}, ${args_no_hyphens}, ${args_json}, \
        ${args_json_file}): every trial would be the same";
    match words.as_slice() {
        [exe, sub, rest @ ..] if is_oomguard(exe) && sub == "train" => {
            let Some(base) = base else {
                return Err(refuse(
                    "runs `oomguard train` but the sweep file gives no `base`: add base: CONFIG".into(),
                ));
            };
            let rest = match rest {
                [b, tail @ ..] if !is_args(b) && Path::new(b.as_str()) == base => tail,
                _ => rest,
            };
            if let Some(w) = rest.iter().find(|w| !is_args(w)) {
                return Err(refuse(format!("passes `{w}` to oomguard train; only the parameter macros (${{args}}, ${{args_no_hyphens}}, ${{args_json}}, \
                    ${{args_json_file}}) and the base config may follow")));
            }
            if rest.is_empty() {
                return Err(refuse(passes_none.into()));
            }
            let notice = format!("is read as `oomguard train {shown} --set KEY=VALUE ...` (${{env}} and ${{interpreter}} dropped; ${{args}} and its \
                kin are the parameters)");
            Ok((
                Runner::Train {
                    base: base.to_path_buf(),
                },
                notice,
            ))
        }
        [exe, sub, rest @ ..] if is_oomguard(exe) && sub == "launch" => {
            if base.is_some() {
                return Err(ConfigError::invalid(
                    "base",
                    "is for trials that run `oomguard train`; this command runs a script under `oomguard launch`, \
                    whose parameters reach it as arguments: remove base",
                ));
            }
            if let Some(w) = rest.iter().find(|w| {
                ["--run-dir", "--run_dir"]
                    .iter()
                    .any(|f| w.split('=').next() == Some(f))
            }) {
                return Err(refuse(format!("passes `{w}`: the sweep gives each trial its own run directory (trials/ID, as OOMGUARD_RUN_DIR): remove it")));
            }
            if !rest.iter().any(|w| is_args(w)) {
                return Err(refuse(passes_none.into()));
            }
            let notice = format!(
                "runs each trial as `oomguard launch --run-dir TRIAL_DIR {}` (${{env}} and ${{interpreter}} dropped; ${{args}} is --KEY=VALUE per \
                    parameter, as W&B's agent passes them)",
                rest.join(" ")
            );
            Ok((
                Runner::Launch {
                    words: rest.to_vec(),
                    script,
                },
                notice,
            ))
        }
        _ => Err(refuse(format!(
            "runs `{}`, which is neither `oomguard train` nor `oomguard launch`; oomguard cannot honour it",
            words.join(" ")
        ))),
    }
}

impl Runner {
    /// `oomguard launch`'s arguments for trial `t`, whose run directory is `run_dir`: the
    /// macros expanded as W&B's agent expands them (`${args_json_file}` written into run_dir).
    pub fn launch_args(words: &[String], t: &Trial, run_dir: &Path) -> std::io::Result<Vec<String>> {
        let json = || Value::Object(t.params.clone().into_iter().collect()).to_string();
        let mut out = vec!["--run-dir".to_string(), run_dir.display().to_string()];
        for w in words {
            match w.as_str() {
                "${args}" => out.extend(t.params.iter().map(|(k, v)| format!("--{k}={}", python_str(v)))),
                "${args_no_boolean_flags}" => out.extend(t.params.iter().filter_map(|(k, v)| match v {
                    Value::Bool(true) => Some(format!("--{k}")),
                    Value::Bool(false) => None,
                    v => Some(format!("--{k}={}", python_str(v))),
                })),
                "${args_no_hyphens}" => out.extend(t.params.iter().map(|(k, v)| format!("{k}={}", python_str(v)))),
                "${args_json}" => out.push(json()),
                "${args_json_file}" => {
                    let path = run_dir.join("args.json");
                    std::fs::write(&path, json())?;
                    out.push(path.display().to_string());
                }
                _ => out.push(w.clone()),
            }
        }
        Ok(out)
    }
}

/// A value as Python's `str()` writes it: W&B's agent formats `--KEY={value}` with an
/// f-string, so scripts written for it parse these (`True`, `1e-05`, `[1, 2]`, `None`).
pub fn python_str(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) => python_float(f),
            None => n.to_string(),
        },
        Value::Array(a) => format!("[{}]", a.iter().map(python_repr).collect::<Vec<_>>().join(", ")),
        Value::Object(m) => {
            let items: Vec<String> = m.iter().map(|(k, v)| format!("'{k}': {}", python_repr(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

/// Inside a list or dict, Python writes strings quoted.
fn python_repr(v: &Value) -> String {
    match v {
        Value::String(s) => format!("'{s}'"),
        other => python_str(other),
    }
}

/// Python's float repr: the shortest digits, an exponent below 1e-4 and from 1e16.
fn python_float(f: f64) -> String {
    if !f.is_finite() {
        return if f.is_nan() {
            "nan".into()
        } else if f > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let e = format!("{f:e}");
        let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
        let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(s: &str) -> serde_yaml::Value {
        serde_yaml::from_str(s).unwrap()
    }

    #[test]
    fn values_are_written_as_pythons_str_writes_them() {
        let cases = [
            ("0.001", "0.001"),
            ("1.0e-5", "1e-05"),
            ("3.0", "3.0"),
            ("3", "3"),
            ("1.0e20", "1e+20"),
            ("true", "True"),
            ("null", "None"),
            ("adamw", "adamw"),
            ("[1, 0.5, a]", "[1, 0.5, 'a']"),
        ];
        for (v, want) in cases {
            let v: Value = serde_yaml::from_str(v).unwrap();
            assert_eq!(python_str(&v), want);
        }
    }

    #[test]
    fn a_launch_command_expands_per_trial() {
        let (r, notice) = read(
            &yaml("['${env}', oomguard, launch, --nproc-per-node, 2, '${program}', '${args}', '${args_json_file}']"),
            Some(&yaml("train.py")),
            None,
        )
        .unwrap();
        assert!(
            notice.contains("oomguard launch --run-dir TRIAL_DIR --nproc-per-node 2 train.py"),
            "{notice}"
        );
        let Runner::Launch { words, script } = r else {
            panic!("{r:?}")
        };
        assert_eq!(script, Some(PathBuf::from("train.py")));
        let dir = tempfile::tempdir().unwrap();
        let t = Trial {
            index: 0,
            id: "000-x".into(),
            params: [
                ("lr".to_string(), serde_json::json!(1e-5)),
                ("wide".into(), serde_json::json!(true)),
            ]
            .into_iter()
            .collect(),
        };
        let args = Runner::launch_args(&words, &t, dir.path()).unwrap();
        let file = dir.path().join("args.json");
        let d = dir.path().display().to_string();
        assert_eq!(
            args,
            [
                "--run-dir",
                &d,
                "--nproc-per-node",
                "2",
                "train.py",
                "--lr=1e-05",
                "--wide=True",
                &file.display().to_string()
            ]
        );
        let written: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        assert_eq!(written, serde_json::json!({"lr": 1e-5, "wide": true}));
    }

    /// Every macro of W&B's documented list: `${args_no_boolean_flags}` (a true boolean as a bare
    /// flag, a false one left out) and `${envvar:NAME}` (within a word, NAME when unset), as
    /// W&B's agent expands them.
    #[test]
    fn boolean_flags_and_environment_variables_as_wandbs_agent_expands_them() {
        let env = |v: &str| (v == "DATA_DIR").then(|| "/data".to_string());
        assert_eq!(expand_envvars("--data=${envvar:DATA_DIR}/x", &env), "--data=/data/x");
        assert_eq!(expand_envvars("${envvar:UNSET_ONE}", &env), "UNSET_ONE");
        assert_eq!(
            expand_envvars("${envvar:DATA_DIR}${envvar:DATA_DIR}", &env),
            "/data/data"
        );
        assert_eq!(expand_envvars("${envvar:lower}", &env), "${envvar:lower}");
        let (r, _) = read(
            &yaml("[oomguard, launch, '${program}', '${args_no_boolean_flags}', '--out=${envvar:NO_SUCH_VAR_42}']"),
            Some(&yaml("train.py")),
            None,
        )
        .unwrap();
        let Runner::Launch { words, .. } = r else {
            panic!("{r:?}")
        };
        assert_eq!(words, ["train.py", "${args_no_boolean_flags}", "--out=NO_SUCH_VAR_42"]);
        let t = Trial {
            index: 0,
            id: "000-x".into(),
            params: [
                ("lr".to_string(), serde_json::json!(0.5)),
                ("wide".into(), serde_json::json!(true)),
                ("deep".into(), serde_json::json!(false)),
            ]
            .into_iter()
            .collect(),
        };
        let dir = tempfile::tempdir().unwrap();
        let args = Runner::launch_args(&words, &t, dir.path()).unwrap();
        assert_eq!(args[2..], ["train.py", "--lr=0.5", "--wide", "--out=NO_SUCH_VAR_42"]);
        let e = read(
            &yaml("[oomguard, train, '${args_nope}']"),
            None,
            Some(Path::new("b.yaml")),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("${args_no_boolean_flags}") && e.to_string().contains("${envvar:NAME}"),
            "{e}"
        );
    }

    #[test]
    fn commands_oomguard_cannot_honour_are_refused_naming_the_key() {
        let base = Some(Path::new("base.yaml"));
        let cases = [
            ("[oomguard, launch, train.py]", None, "passes no parameters"),
            (
                "[oomguard, launch, --run-dir, x, train.py, '${args}']",
                None,
                "its own run directory",
            ),
            ("[oomguard, launch, train.py, '${args}']", base, "remove base"),
            ("[oomguard, train, '${args}']", None, "gives no `base`"),
            (
                "[python, train.py, '${args}']",
                base,
                "neither `oomguard train` nor `oomguard launch`",
            ),
        ];
        for (c, base, want) in cases {
            let e = read(&yaml(c), None, base).unwrap_err();
            assert!(format!("{e}").contains(want), "{c}: {e}");
        }
    }
}
