//! The examples/ MLP (a non-GPT model of the user's own) trains under the guard.
#[path = "../examples/mlp.rs"]
mod mlp;

#[test]
fn own_model_trains_under_the_guard() {
    let r = mlp::run(150, Some(1 << 20)).unwrap();
    assert!(r.num_ooms >= 1, "the budget should have forced a shrink");
    assert!(r.final_micro_batch_size < 512);
    assert!(r.last_loss < 0.7 * r.first_loss, "loss {} -> {}", r.first_loss, r.last_loss);
}
