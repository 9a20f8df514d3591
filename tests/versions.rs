//! scripts/versions.env is the one place that names versions: Cargo.toml, the set-up, the GPU
//! kit and the Docker image must agree with it.
mod common;

use std::collections::BTreeMap;

fn versions() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(common::root().join("scripts/versions.env")).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("not KEY=VALUE: {l}"));
            assert!(!k.contains(' ') && !v.contains('$'), "plain KEY=VALUE lines only: {l}");
            (k.to_string(), v.trim_matches('"').to_string())
        })
        .collect()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(common::root().join(path)).unwrap()
}

#[test]
fn every_version_comes_from_versions_env() {
    let v = versions();
    let cargo = read("Cargo.toml");
    for krate in ["tch", "torch-sys"] {
        assert!(
            cargo.contains(&format!("\n{krate} = \"{}\"", v["TCH_VERSION"])),
            "Cargo.toml's {krate} is not TCH_VERSION {}",
            v["TCH_VERSION"]
        );
    }
    // The GPU kit's map sends this torch to the same tch.
    let minor: Vec<&str> = v["TORCH_VERSION"].split('.').take(2).collect();
    assert_eq!(v[&format!("GPU_KIT_TORCH_{}", minor.join("_"))], v["TCH_VERSION"]);
    assert!(v.contains_key(&format!(
        "GPU_KIT_TORCH_{}",
        v["GPU_KIT_DEFAULT_TORCH"]
            .split('.')
            .take(2)
            .collect::<Vec<_>>()
            .join("_")
    )));
    // The Docker image's CUDA variants: the default among them.
    assert!(v.contains_key(&format!("CUDA_{}", v["DOCKER_DEFAULT_CUDA"])));
    // Every script and the Dockerfile read versions.env and name no version of their own.
    for file in ["scripts/setup.sh", "scripts/gpu-kit.sh", "docker/Dockerfile"] {
        let text = read(file);
        assert!(
            text.contains("versions.env"),
            "{file} does not read scripts/versions.env"
        );
        for (key, value) in &v {
            let code: String = text
                .lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n");
            if key.ends_with("VERSION") && value.contains('.') {
                assert!(!code.contains(value.as_str()), "{file} names {key}'s {value} itself");
            }
        }
    }
    // The Dockerfile installs the toolchain, torch and packages versions.env names.
    let docker = read("docker/Dockerfile");
    for var in [
        "$RUST_VERSION",
        "$TORCH_VERSION",
        "$PYTHON_PACKAGES",
        "$GLOO_PACKAGE",
        "$DOCKER_DEFAULT_CUDA",
    ] {
        assert!(docker.contains(var), "docker/Dockerfile does not use {var}");
    }
    assert!(read("scripts/setup.sh").contains("\"$GLOO_PACKAGE\""));
}
