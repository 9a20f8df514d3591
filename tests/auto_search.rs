//! Under a budget, `micro_batch_size: auto` lands within 10% of the true largest size that
//! fits, which this test finds by brute force with real training steps. Alone in its file:
//! the CPU budget is process-wide.
use oomguard::data::{DataConfig, Dataset};
use oomguard::memory;
use oomguard::model::{no_weight_decay, Gpt, GptConfig};
use oomguard::optim::{AdamW, OptimConfig};
use oomguard::plan::auto_micro_batch;
use oomguard::train::{train_step, GptBatches};
use tch::{nn::VarStore, Device};

#[test]
fn search_lands_within_10_percent_of_brute_force() {
    let cache = tempfile::tempdir().unwrap();
    std::env::set_var("OOMGUARD_CACHE", cache.path());
    memory::install_cpu_allocator();
    tch::manual_seed(0);
    let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 32, block_size: 32, vocab_size: 256, dropout: 0.0, bias: true };
    let data = Dataset::open(&DataConfig { embedded_bytes: 65536, ..Default::default() }, std::path::Path::new("."), 32).unwrap();
    let vs = VarStore::new(Device::Cpu);
    let model = Gpt::new(&vs.root(), &cfg).unwrap();
    let mut opt = AdamW::new(&vs, &OptimConfig::default(), no_weight_decay).unwrap();
    const GLOBAL: usize = 96;
    let batches = GptBatches { split: &data.train, seed: 1, global_batch: GLOBAL, block: 32, vocab: 256, device: Device::Cpu };
    memory::set_cpu_budget(Some(memory::cpu_live_bytes() + (5 << 20)));

    // Brute force: the largest micro-batch at which a whole real training step succeeds.
    let mut truth = 0;
    for m in 1..=GLOBAL {
        match train_step(&model, &mut opt, &batches, 0, m, 1e-6, 1.0) {
            Ok(_) => truth = m,
            Err(e) if e.is_oom() => {
                opt.clear_grads();
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(truth > 4 && truth < GLOBAL, "the budget should cut somewhere inside: {truth}");

    let r = auto_micro_batch(&model, &batches, || opt.clear_grads(), Device::Cpu, "test".into(), 2, GLOBAL, 0.1).unwrap();
    memory::set_cpu_budget(None);
    let found = r.largest_fitting;
    assert!(found <= truth + truth / 10 && found as f64 >= 0.9 * truth as f64, "found {found}, truth {truth}");
    assert!(r.trials as f64 <= 2.0 * (truth as f64).log2().ceil() + 2.0, "{} trials", r.trials);
    assert_eq!(r.micro_batch_size, ((found as f64) * 0.9).floor() as usize);
}
