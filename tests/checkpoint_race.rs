//! Two writers of one step's checkpoint at once, as two survivors of an elastic job on two
//! nodes that share the run directory: one checkpoint stays, whole (one writer's, never a
//! mixture), both writers succeed, and nothing temporary is left. In-process, one thread a
//! writer: one process id for both, as containers on two nodes often have.
mod common;
use oomguard::checkpoint;
use oomguard::task::Task;
use std::path::Path;
use tch::Device;

/// A tiny GPT whose first parameter is shifted by `shift` (writers whose bits differ), saved
/// as step `step`'s checkpoint in `run`; returns the folder and the shifted tensor's name
/// and value.
fn save(run: &Path, step: u64, shift: f64) -> (std::path::PathBuf, String, tch::Tensor) {
    let common::TinyGpt { task, opt, .. } = common::tiny_gpt();
    let (name, first) = task.state().swap_remove(0);
    let _ = tch::no_grad(|| first.shallow_clone().f_add_scalar_(shift).unwrap());
    let state = common::train_state(&task, step);
    let opt_state: Vec<_> = opt.state().into_iter().map(|(n, t)| (n, t.shallow_clone())).collect();
    let dir = checkpoint::save(run, &state, &task, &opt_state, Device::Cpu).unwrap();
    (dir, name, first.detach().copy())
}

#[test]
fn two_survivors_saving_one_step_leave_one_whole_checkpoint() {
    tch::set_num_threads(1);
    let run = tempfile::tempdir().unwrap();
    for step in 1..=12u64 {
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| save(run.path(), step, 0.0));
            let b = s.spawn(|| save(run.path(), step, 1.0));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert_eq!(a.0, b.0, "step {step}: two folders");
        checkpoint::verify(&a.0).unwrap_or_else(|e| panic!("step {step}: {e}"));
        let saved = common::safetensors(&a.0.join("model.safetensors"));
        let (_, first) = saved.iter().find(|(n, _)| *n == a.1).unwrap();
        let whose = [&a.2, &b.2]
            .iter()
            .filter(|t| (first - **t).abs().max().double_value(&[]) == 0.0)
            .count();
        assert_eq!(whose, 1, "step {step}: the checkpoint is neither writer's whole state");
        let left: Vec<String> = std::fs::read_dir(checkpoint::checkpoints_dir(run.path()))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-"))
            .collect();
        assert!(left.is_empty(), "step {step}: left behind {left:?}");
    }
}
