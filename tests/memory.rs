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

/// A C++ error whose message cannot be copied (csrc's malloc for the copy failing, here
/// through `OOMGUARD_TEST_CSRC_FAIL=message`) is still an error, with a fixed message: never
/// the success a null message means. The hook is read from the environment, so the check
/// runs in a child process: this test, run again with it set.
#[test]
fn a_cpp_error_whose_message_cannot_be_copied_is_still_an_error() {
    // Malformed allocator settings: libtorch's parser throws.
    let bad = "max_split_size_mb:not-a-number";
    if std::env::var_os("OOMGUARD_TEST_CSRC_FAIL").is_some() {
        let e = memory::set_allocator_settings(bad).expect_err("the settings threw inside C++");
        assert!(
            matches!(&e, tch::TchError::Torch(m)
                if m == "a C++ exception whose message could not be copied (no memory left for it)"),
            "{e:?}"
        );
        return;
    }
    let e = memory::set_allocator_settings(bad).expect_err("libtorch refuses the settings");
    assert!(!e.to_string().contains("could not be copied"), "{e}");
    let name = "a_cpp_error_whose_message_cannot_be_copied_is_still_an_error";
    let o = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads", "1", "--nocapture"])
        .env("OOMGUARD_TEST_CSRC_FAIL", "message")
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("1 passed"),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
