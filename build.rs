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

    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-Wno-unused-parameter")
        .flag("-Wno-c++20-extensions")
        .flag("-Wno-deprecated-declarations")
        .opt_level(2)
        .file("csrc/memory.cpp")
        .file("csrc/optim.cpp")
        .file("csrc/rng.cpp")
        .file("csrc/torchscript.cpp")
        .file("csrc/ops.cpp")
        .file("csrc/amp.cpp")
        .compile("oomguard_csrc");

    for f in ["csrc/memory.cpp", "csrc/optim.cpp", "csrc/rng.cpp", "csrc/torchscript.cpp", "csrc/ops.cpp", "csrc/amp.cpp", "csrc/oomguard.h"] {
        println!("cargo:rerun-if-changed={f}");
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
