//! `make bench` (auto): the time `micro_batch_size: auto` spends searching, as a fraction of
//! a 100-step run of the demo model under a 60 MiB budget (cache off: a fresh search).
mod common;
use common::events;
use oomguard::config::{Config, RawConfig};
use oomguard::train::{train, MicroBatch};

fn main() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("OOMGUARD_CACHE", dir.path().join("cache"));
    let mut c = RawConfig::default(); // the demo's model shape: 4 x 128, block 128, vocab 256
    c.train.micro_batch_size = MicroBatch::Auto;
    c.train.global_batch_size = Some(64);
    c.train.max_steps = 100;
    c.train.eval_every = 0;
    c.train.eval_batches = 1;
    c.train.device = "cpu".into();
    c.memory.budget = "60MiB".into();
    c.log.every = 1000;
    let cfg = Config {
        raw: c,
        path: dir.path().join("auto.yaml"),
    };
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let s = train(&cfg, &run, &Default::default(), Default::default()).unwrap();
    let auto = events(&run, "auto_micro_batch").remove(0);
    let search = auto["search_s"].as_f64().unwrap();
    println!(
        "auto micro-batch: {} fits, training at {} after {} trial steps in {:.2}s; 100-step run {:.1}s: search is {:.1}% of the run",
        auto["largest_fitting"], auto["micro_batch_size"], auto["trials"], search, s.wall_s + search, 100.0 * search / (s.wall_s + search)
    );
}
