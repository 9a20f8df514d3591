//! A run's host memory stays flat. Step records carry the process's anonymous resident
//! memory (`memory.host_rss_anon_bytes`); over a run with the default memory history
//! recording (`memory.snapshot: on_oom`), it must not climb step after step. It once did, by
//! about 40 MiB a step at the bench's GPT: the op-name interning behind the history kept a node
//! per new string address, and those small nodes fragmented the heap between the step's large
//! buffers (csrc/snapshot.cpp).
mod common;
use common::*;

#[test]
fn host_memory_stays_flat_over_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "flat.yaml",
        "model: {n_layer: 2, n_head: 2, n_embd: 64, block_size: 64, vocab_size: 256}\n\
         data: {source: embedded, embedded_bytes: 65536}\n\
         train: {micro_batch_size: 8, grad_accum_steps: 2, max_steps: 80, eval_every: 0, device: cpu, num_threads: 1}\n\
         log: {every: 1000}\n",
    );
    let run = train_ok(dir.path(), &cfg, &[]);
    let rss: Vec<f64> = records(&run, "step")
        .iter()
        .map(|s| {
            s["memory"]["host_rss_anon_bytes"]
                .as_f64()
                .expect("every step record carries it")
                / 1048576.0
        })
        .collect();
    assert_eq!(rss.len(), 80);
    // After warm-up (the allocator's pools, the first checkpoint's buffers), medians of ten
    // steps 60 steps apart (glibc hands memory back in bursts): a leak of 100 KiB a step
    // would show as 6 MiB.
    let (settled, end) = (median(rss[10..20].to_vec()), median(rss[70..80].to_vec()));
    assert!(
        end - settled < 4.0,
        "host memory grew from {settled:.1} MiB (steps 11-20) to {end:.1} MiB (steps 71-80): {rss:.1?}"
    );
}
