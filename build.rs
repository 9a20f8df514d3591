//! Compiles csrc/ against the libtorch that torch-sys found, and makes the binaries find
//! libtorch at run time without LD_LIBRARY_PATH.
use std::path::PathBuf;

fn main() {
    // torch-sys (links = "tch") exports the directory it linked against.
    let lib_dir = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not export DEP_TCH_LIBTORCH_LIB: run `make setup` first"),
    );
    let lib_dir = lib_dir.canonicalize().unwrap_or(lib_dir);
    let torch_dir = lib_dir.parent().expect("libtorch lib dir has a parent").to_path_buf();
    let include = torch_dir.join("include");

    const SOURCES: [&str; 11] = [
        "csrc/memory.cpp",
        "csrc/snapshot.cpp",
        "csrc/optim.cpp",
        "csrc/rng.cpp",
        "csrc/torchscript.cpp",
        "csrc/ops.cpp",
        "csrc/amp.cpp",
        "csrc/dist.cpp",
        "csrc/shm.cpp",
        "csrc/overlap.cpp",
        "csrc/loss.cpp",
    ];
    // `cargo clippy` checks the Rust and links nothing: csrc/ is not compiled for it (its build
    // script run is its own, so it would compile csrc/ anew: about 3 minutes on 2 cores).
    let linking = !std::env::var("RUSTC_WORKSPACE_WRAPPER").is_ok_and(|w| w.contains("clippy-driver"));
    let compile = |b: &mut cc::Build, name: &str| {
        if linking {
            b.compile(name);
        }
    };
    let base = || {
        let mut b = cc::Build::new();
        b.cpp(true)
            .std("c++17")
            .define("_GLIBCXX_USE_CXX11_ABI", "1")
            .include(&include)
            .include(include.join("torch/csrc/api/include"))
            .flag("-Wno-unused-parameter")
            .flag("-Wno-c++20-extensions")
            .flag("-Wno-deprecated-declarations")
            .opt_level(2);
        // Test-only hooks (OOMGUARD_TEST_CSRC_FAIL): compiled in only with the `test-hooks` feature.
        if std::env::var_os("CARGO_FEATURE_TEST_HOOKS").is_some() {
            b.define("OG_TEST_HOOKS", None);
        }
        b
    };
    // c10d's Gloo headers come from Debian's libgloo-dev (the wheel ships none).
    assert!(
        std::path::Path::new("/usr/include/gloo/config.h").exists(),
        "gloo headers are missing: run `make setup` (it installs Debian's libgloo-dev)"
    );
    compile(base().define("USE_C10D_GLOO", None).files(SOURCES), "oomguard_csrc");
    // NCCL's c10d header needs nccl.h and the CUDA runtime headers: the pip nvidia packages
    // beside torch (scripts/setup.sh installs the two header-only ones).
    let nvidia = torch_dir.parent().expect("site-packages").join("nvidia");
    let (cuda_inc, nccl_inc) = (nvidia.join("cu13/include"), nvidia.join("nccl/include"));
    assert!(
        cuda_inc.join("crt/host_config.h").exists() && nccl_inc.join("nccl.h").exists(),
        "CUDA and NCCL headers are missing under {}: run `make setup`",
        nvidia.display()
    );
    compile(
        base()
            .define("USE_C10D_NCCL", None)
            .include(&cuda_inc)
            .include(nccl_inc)
            .flag("-w")
            .file("csrc/dist_nccl.cpp"),
        "oomguard_nccl",
    );
    // The CUDA memory snapshot and the caching allocator's start need libtorch_cuda's symbols: only against a libtorch that has
    // them; Rust sees `cfg(oomguard_cuda_snapshot)` (a CPU-only libtorch builds without it).
    println!("cargo:rustc-check-cfg=cfg(oomguard_cuda_snapshot)");
    if lib_dir.join("libtorch_cuda.so").exists() {
        compile(
            base()
                .include(&cuda_inc)
                .flag("-w")
                .file("csrc/snapshot_cuda.cpp")
                .file("csrc/cuda_allocator.cpp"),
            "oomguard_cuda_snapshot",
        );
        println!("cargo:rustc-cfg=oomguard_cuda_snapshot");
        // --as-needed keeps them only where the snapshot is referenced (not in `oomguard`).
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }

    for f in SOURCES.iter().chain(&[
        "csrc/dist_nccl.cpp",
        "csrc/snapshot_cuda.cpp",
        "csrc/cuda_allocator.cpp",
        "csrc/snapshot.h",
        "csrc/oomguard.h",
    ]) {
        println!("cargo:rerun-if-changed={f}");
    }
    if std::env::var_os("CARGO_FEATURE_PYTHON").is_some() {
        python(&torch_dir);
    }
    // An rpath makes nothing load: harmless for the libtorch-free `oomguard` binary.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    // rustc links with --as-needed, which drops libtorch_cuda.so (nothing references it by
    // symbol); without it CUDA goes undetected on a GPU machine. Only for what runs
    // libtorch: `oomguard` itself must not load it (it starts the launcher in milliseconds).
    if lib_dir.join("libtorch_cuda.so").exists() {
        let arg = "-Wl,--no-as-needed,-ltorch_cuda,--as-needed";
        println!("cargo:rustc-link-arg-bin=oomguard-torch={arg}");
        for kind in ["tests", "benches", "examples"] {
            println!("cargo:rustc-link-arg-{kind}={arg}");
        }
    }
}

/// `model.kind: python`: pyo3 links libpython (PYO3_PYTHON's); an rpath finds it at run time
/// (pyenv's and venv-based interpreters keep it outside the loader's path), and the binary
/// learns the site-packages that hold the torch it links (a Python model imports that torch).
fn python(torch_dir: &std::path::Path) {
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&python)
        .args(["-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python} (PYO3_PYTHON): {e}; run `make setup` first"));
    let libdir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !libdir.is_empty() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
    let site = torch_dir.parent().expect("torch sits in site-packages");
    println!("cargo:rustc-env=OOMGUARD_BUILD_SITE_PACKAGES={}", site.display());
    // The torch version a Python model's `import torch` must match (torch/version.py).
    let version = std::fs::read_to_string(torch_dir.join("version.py"))
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("__version__ = ")
                    .map(|v| v.trim_matches(['\'', '"']).to_string())
            })
        })
        .unwrap_or_default();
    println!("cargo:rustc-env=OOMGUARD_BUILD_TORCH_VERSION={version}");
}
