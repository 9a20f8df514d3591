//! The guard on CUDA, with `per_process_memory_fraction` as the budget. GPU-only: each test
//! returns early, saying so, when CUDA is not present.
mod common;
use common::*;

fn cuda_total_bytes() -> Option<u64> {
    if !oomguard::memory::cuda_available() {
        eprintln!("CUDA not present: skipping the CUDA guard test");
        return None;
    }
    let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cuda(0))); // initialise the allocator
    oomguard::memory::stats(tch::Device::Cuda(0)).limit_bytes
}

#[test]
fn cuda_oom_is_recovered_with_the_same_result() {
    let Some(total) = cuda_total_bytes() else { return };
    let dir = tempfile::tempdir().unwrap();
    let yaml = TINY.replace("device: cpu", "device: cuda").replace("micro_batch_size: 8, grad_accum_steps: 2", "micro_batch_size: 64, grad_accum_steps: 1")
        .replace("block_size: 32", "block_size: 256").replace("embedded_bytes: 65536", "embedded_bytes: 262144");
    let cfg = write_config(dir.path(), "cuda.yaml", &yaml);
    let free = train_ok(dir.path(), &cfg, &[]);
    std::fs::rename(&free, dir.path().join("free")).unwrap();
    let peak = records(&dir.path().join("free"), "step")[0]["memory"]["peak_bytes"].as_u64().unwrap();
    // A process limit at 60% of the free run's peak (plus the CUDA context's share).
    let fraction = (peak as f64 * 0.6 / total as f64).max(1e-6);
    let run = train_ok(dir.path(), &cfg, &["--set", &format!("memory.allocator.per_process_memory_fraction={fraction:.8}")]);
    let ooms = records(&run, "oom");
    assert!(!ooms.is_empty(), "the fraction should have forced an OOM");
    assert!(ooms.iter().all(|e| e["source"] == "cuda"), "{ooms:?}");
    let d = max_abs_diff(&weights(&dir.path().join("free")), &weights(&run));
    assert!(d < 1e-4, "parameters differ by {d}");
}
