//! The counting CPU allocator itself. Alone in its file: its figures are process-wide.
use oomguard::memory;
use tch::{Device, Kind, Tensor};

/// An allocation the underlying allocator refuses (far beyond the machine's memory) is an
/// error, and the bytes it asked for are given back: the guard must not see a leak.
#[test]
fn a_refused_allocation_gives_its_bytes_back() {
    memory::install_cpu_allocator();
    memory::set_cpu_budget(None);
    let keep = Tensor::zeros([1024], (Kind::Float, Device::Cpu));
    let before = memory::cpu_live_bytes();
    let r = Tensor::f_empty([1i64 << 50], (Kind::Float, Device::Cpu));
    let e = oomguard::Error::from(r.expect_err("a 4 PiB tensor cannot be allocated"));
    assert!(e.is_oom(), "{e}");
    assert_eq!(
        memory::cpu_live_bytes(),
        before,
        "the refused allocation's bytes are still counted as live"
    );
    drop(keep);
}
