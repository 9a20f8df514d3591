//! Owns the safe API over csrc/memory.cpp: the counting CPU allocator, CUDA cache and stats.
//! Keeps: an allocation that would cross the CPU budget fails with an out-of-memory error.
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use tch::{Device, TchError, Tensor};

pub use oomguard_host::allocator;
pub use oomguard_host::oom::unit_multiplier;
pub mod budget;
mod config;
pub mod inject;
mod pressure;
pub mod snapshot;
pub use config::{Budget, MemoryConfig, Pressure};
pub use pressure::PressureSchedule;

mod ffi {
    use std::ffi::{c_char, c_int, c_void};
    extern "C" {
        pub fn og_cpu_install();
        pub fn og_cpu_set_budget(bytes: i64);
        pub fn og_cpu_set_footprint_limit(bytes: i64);
        pub fn og_cpu_budget() -> i64;
        pub fn og_cpu_live_bytes() -> i64;
        pub fn og_cpu_peak_bytes() -> i64;
        pub fn og_cpu_reset_peak();
        pub fn og_clear_grad(tensor: *mut c_void);
        pub fn og_set_grad(tensor: *mut c_void, grad: *mut c_void);
        pub fn og_grads_scratch(
            params: *const *mut c_void,
            n: c_int,
            out: *mut *mut c_void,
            count: *mut c_int,
        ) -> *mut c_char;
        pub fn og_cuda_available() -> c_int;
        pub fn og_cuda_set_device(device: c_int) -> *mut c_char;
        pub fn og_cuda_empty_cache() -> *mut c_char;
        pub fn og_cuda_stats(device: c_int, out: *mut i64) -> *mut c_char;
        pub fn og_cuda_reset_peak(device: c_int) -> *mut c_char;
        pub fn og_cuda_synchronize(device: c_int) -> *mut c_char;
        pub fn og_cuda_mem_info(device: c_int, out: *mut i64) -> *mut c_char;
        pub fn og_set_allocator_settings(settings: *const c_char) -> *mut c_char;
    }
}

// Its home is the leaf crate::error (rng.rs uses it without importing memory/).
pub(crate) use crate::error::check;

/// Routes every CPU tensor allocation through the counting allocator. Call it before the
/// first allocation that should be counted; later calls do nothing.
pub fn install_cpu_allocator() {
    unsafe { ffi::og_cpu_install() }
}

/// Sets (or with `None` removes) the CPU memory budget in bytes. Allocations that would
/// cross it fail with an out-of-memory error.
pub fn set_cpu_budget(bytes: Option<u64>) {
    unsafe { ffi::og_cpu_set_budget(bytes.map_or(-1, |b| b.min(i64::MAX as u64) as i64)) }
}

/// Sets (or with `None` removes) the limit on this process's RssAnon: an allocation of a
/// MiB or more that would cross it fails with an out-of-memory error, as the budget's do.
pub fn set_cpu_footprint_limit(bytes: Option<u64>) {
    unsafe { ffi::og_cpu_set_footprint_limit(bytes.map_or(-1, |b| b.min(i64::MAX as u64) as i64)) }
}

pub fn cpu_budget() -> Option<u64> {
    u64::try_from(unsafe { ffi::og_cpu_budget() }).ok()
}

/// Bytes of CPU tensor memory alive now (counted since `install_cpu_allocator`).
pub fn cpu_live_bytes() -> u64 {
    unsafe { ffi::og_cpu_live_bytes() }.max(0) as u64
}

pub fn cpu_peak_bytes() -> u64 {
    unsafe { ffi::og_cpu_peak_bytes() }.max(0) as u64
}

pub fn reset_cpu_peak() {
    unsafe { ffi::og_cpu_reset_peak() }
}

/// Drops a tensor's gradient (grad = None), returning its memory.
pub fn clear_grad(t: &Tensor) {
    // SAFETY: tch's C_tensor is a torch::Tensor*, which og_clear_grad takes.
    unsafe { ffi::og_clear_grad(t.as_ptr() as *mut c_void) }
}

/// `t`'s gradient becomes `grad` (same shape); the old one is let go.
pub fn set_grad(t: &Tensor, grad: &Tensor) {
    // SAFETY: both are torch::Tensor*, as og_set_grad takes them; it copies the handle.
    unsafe { ffi::og_set_grad(t.as_ptr() as *mut c_void, grad.as_ptr() as *mut c_void) }
}

/// The storages that only `params`' gradients hold, each whole as one flat tensor, largest
/// first: scratch once the gradients are spent. Nothing else holds them, so writing them
/// changes nothing but those gradients. Allocates no tensor memory.
pub fn grads_scratch(params: &[Tensor]) -> Result<Vec<Tensor>, TchError> {
    let ptrs: Vec<*mut c_void> = params.iter().map(|p| p.as_ptr() as *mut c_void).collect();
    let mut out = vec![std::ptr::null_mut(); ptrs.len()];
    let mut count = 0;
    // SAFETY: tch's C_tensor is a torch::Tensor*, as og_grads_scratch takes them; it fills
    // `count` (at most ptrs.len()) slots of `out` with new torch::Tensor*s it hands over.
    let done = check(unsafe { ffi::og_grads_scratch(ptrs.as_ptr(), ptrs.len() as i32, out.as_mut_ptr(), &mut count) });
    let taken = out[..count.max(0) as usize]
        .iter()
        .map(|&p| unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) })
        .collect();
    done.map(|()| taken)
}

pub fn cuda_available() -> bool {
    unsafe { ffi::og_cuda_available() != 0 }
}

/// Releases the CUDA caching allocator's unused blocks; on the CPU, the heap's free memory.
pub fn empty_cache(device: Device) -> Result<(), TchError> {
    match device {
        Device::Cuda(_) => check(unsafe { ffi::og_cuda_empty_cache() }),
        // The host's cache is glibc's arenas: a failed attempt's buffers go back to the system.
        _ => {
            oomguard_host::memory::return_freed_memory();
            Ok(())
        }
    }
}

/// Makes CUDA device `index` this process's current device (before any CUDA work).
pub fn cuda_set_device(index: usize) -> Result<(), TchError> {
    check(unsafe { ffi::og_cuda_set_device(index as i32) })
}

/// Waits until the device has run everything queued on it. Nothing to do on the CPU.
pub fn synchronize(device: Device) -> Result<(), TchError> {
    match device {
        Device::Cuda(i) => check(unsafe { ffi::og_cuda_synchronize(i as i32) }),
        _ => Ok(()),
    }
}

/// Applies caching-allocator settings (`key:value,...`) inside libtorch.
pub fn set_allocator_settings(settings: &str) -> Result<(), TchError> {
    let c = std::ffi::CString::new(settings).map_err(|e| TchError::Convert(e.to_string()))?;
    check(unsafe { ffi::og_set_allocator_settings(c.as_ptr()) })
}

/// Prepares memory before the first allocation of a run: the counting CPU allocator, the
/// budget and the allocator settings (`settings`, already merged with the environment),
/// which are also exported for child processes. On the CPU the budget is oomguard's own;
/// on CUDA a size becomes the caching allocator's `per_process_memory_fraction` (the
/// smaller, where one is set too). Returns the budget in bytes, if any.
pub fn prepare(
    cfg: &MemoryConfig,
    settings: &allocator::AllocatorSettings,
    device: Device,
) -> Result<Option<u64>, crate::Error> {
    install_cpu_allocator();
    let snapshots = cfg.snapshot()?;
    let mut settings = settings.clone();
    let mut described = None;
    let budget = match (device, cfg.budget()?) {
        (Device::Cuda(i), Budget::Bytes(b)) => {
            let total = cuda_mem_info(i).map_err(crate::Error::Torch)?.1;
            let set = settings.get("per_process_memory_fraction").and_then(|f| f.parse().ok());
            let fraction = budget::cuda_fraction(b, total, set);
            settings = settings
                .with("per_process_memory_fraction", &format!("{fraction:.9}"))
                .map_err(crate::Error::from)?;
            Some((total as f64 * fraction) as u64)
        }
        (Device::Cpu, b) => {
            set_cpu_footprint_limit(None);
            let host = budget::host_memory();
            let cgroup = host
                .as_ref()
                .filter(|h| matches!(h.source, oomguard_host::memory::Source::Cgroup { .. }));
            if let Some(h) = cgroup {
                if let Some(t) = oomguard_host::memory::bound_heap() {
                    tracing::info!(
                        "under a memory cgroup: freed buffers of {} and more go back to the system \
                         (MALLOC_MMAP_THRESHOLD_ overrides)",
                        human_bytes(t as u64)
                    );
                }
                // The kernel counts what the heap keeps too: the process's footprint may
                // grow by FOOTPRINT_SHARE of what is free, whatever the live tensors are.
                if let Some(rss) = oomguard_host::memory::own_anonymous_bytes() {
                    let limit = rss + (h.available as f64 * FOOTPRINT_SHARE) as u64;
                    set_cpu_footprint_limit(Some(limit));
                    tracing::info!(
                        "host footprint limit {} (RssAnon now {} + {:.0}% of what is free)",
                        human_bytes(limit),
                        human_bytes(rss),
                        FOOTPRINT_SHARE * 100.0
                    );
                }
            }
            let (bytes, why) = budget::resolve_described(b, &cfg.budget, cpu_live_bytes(), host.as_ref()).unzip();
            described = why;
            bytes
        }
        _ => None,
    };
    if device != Device::Cpu {
        // The host's memory still bounds what a GPU run keeps on the CPU (batches, offload).
        if let Some(h) = budget::host_memory() {
            tracing::info!("host memory: {}", h.describe());
        }
    }
    if !settings.is_empty() {
        let text = settings.render();
        for var in allocator::ENV_VARS {
            std::env::set_var(var, &text);
        }
        if let Err(e) = set_allocator_settings(&text) {
            tracing::warn!("libtorch did not take allocator settings `{text}`: {e}");
        }
        tracing::info!("allocator settings: {text}");
    }
    let fraction = settings
        .get("per_process_memory_fraction")
        .and_then(|f| f.parse::<f64>().ok())
        .unwrap_or(1.0);
    CUDA_FRACTION.store(fraction.to_bits(), Ordering::Relaxed);
    #[cfg(oomguard_cuda_snapshot)]
    if let Device::Cuda(i) = device {
        // After the settings, before the recorder: see csrc/cuda_allocator.cpp.
        cuda_start(i, fraction).map_err(crate::Error::Torch)?;
        if fraction < 1.0 {
            let held = cuda_memory_fraction(i).map_err(crate::Error::Torch)?;
            tracing::info!("the CUDA caching allocator's limit on cuda:{i}: {held:.9} of the card");
        }
    }
    snapshot::begin(snapshots, device);
    set_cpu_budget(if device == Device::Cpu { budget } else { None });
    if let Some(b) = budget {
        let why = described.unwrap_or_else(|| format!("memory.budget: {}", cfg.budget));
        tracing::info!("memory budget {} on {device:?} ({why})", human_bytes(b));
    }
    Ok(budget)
}

/// Under a memory cgroup, the share of what is free at start-up that the process's RssAnon
/// may grow by (the tensors' budget is 80% by default: the rest is the heap's slack).
const FOOTPRINT_SHARE: f64 = 0.95;

/// The `per_process_memory_fraction` in force (1.0 when none): the CUDA limit is the card's
/// memory times this.
static CUDA_FRACTION: AtomicU64 = AtomicU64::new(0x3FF0_0000_0000_0000); // 1.0f64

#[cfg(oomguard_cuda_snapshot)]
extern "C" {
    fn og_cuda_start(device: std::ffi::c_int, fraction: f64) -> *mut std::ffi::c_char;
    fn og_cuda_memory_fraction(device: std::ffi::c_int, out: *mut f64) -> *mut std::ffi::c_char;
}

/// CUDA started with the caching allocator's devices made, and `fraction` of the card the
/// limit on device `index` (1.0: none set).
#[cfg(oomguard_cuda_snapshot)]
fn cuda_start(index: usize, fraction: f64) -> Result<(), TchError> {
    check(unsafe { og_cuda_start(index as i32, fraction) })
}

/// The caching allocator's limit in force on device `index`, as a fraction of the card
/// (what libtorch holds, not what was asked).
#[cfg(oomguard_cuda_snapshot)]
pub fn cuda_memory_fraction(index: usize) -> Result<f64, TchError> {
    let mut out = 0.0;
    check(unsafe { og_cuda_memory_fraction(index as i32, &mut out) })?;
    Ok(out)
}

fn cuda_mem_info(index: usize) -> Result<(u64, u64), TchError> {
    let mut out = [0i64; 2];
    check(unsafe { ffi::og_cuda_mem_info(index as i32, out.as_mut_ptr()) })?;
    Ok((out[0].max(0) as u64, out[1].max(0) as u64))
}

/// Memory figures for one device, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct MemoryStats {
    /// Tensor memory alive now.
    pub live_bytes: u64,
    /// Highest `live_bytes` since the last reset.
    pub peak_bytes: u64,
    /// Held by the caching allocator (CUDA), or the budget's size (CPU), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// CUDA allocator retries (cache flushes after a failed cudaMalloc), cumulative.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alloc_retries: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free_bytes: Option<u64>,
    /// This process's anonymous resident host memory (RssAnon), on every device: flat over
    /// a run unless something on the host leaks. Step records only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_rss_anon_bytes: Option<u64>,
}

pub fn stats(device: Device) -> MemoryStats {
    match device {
        Device::Cuda(i) => cuda_stats(i).unwrap_or_default(),
        _ => MemoryStats {
            live_bytes: cpu_live_bytes(),
            peak_bytes: cpu_peak_bytes(),
            limit_bytes: cpu_budget(),
            ..Default::default()
        },
    }
}

fn cuda_stats(index: usize) -> Result<MemoryStats, TchError> {
    let mut out = [0i64; 7];
    check(unsafe { ffi::og_cuda_stats(index as i32, out.as_mut_ptr()) })?;
    let u = |v: i64| v.max(0) as u64;
    Ok(MemoryStats {
        live_bytes: u(out[0]),
        reserved_bytes: Some(u(out[1])),
        peak_bytes: u(out[2]),
        alloc_retries: Some(u(out[3])),
        device_free_bytes: Some(u(out[5])),
        limit_bytes: Some((u(out[6]) as f64 * f64::from_bits(CUDA_FRACTION.load(Ordering::Relaxed))) as u64),
        host_rss_anon_bytes: None,
    })
}

pub fn reset_peak(device: Device) {
    match device {
        Device::Cuda(i) => {
            let _ = check(unsafe { ffi::og_cuda_reset_peak(i as i32) });
        }
        _ => reset_cpu_peak(),
    }
}

pub use oomguard_host::memory::parse_size;

pub use oomguard_console::units::human_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_is_only_storage_no_one_but_the_gradients_holds() {
        let opts = (tch::Kind::Float, Device::Cpu);
        let params: Vec<Tensor> = [3i64, 5, 4, 7]
            .iter()
            .map(|&n| Tensor::zeros([n], opts).set_requires_grad(true))
            .collect();
        let sizes = |v: &[Tensor]| v.iter().map(|t| t.numel()).collect::<Vec<_>>();
        // Backward's own gradients: each its storage, largest first.
        params.iter().for_each(|p| p.sum(None).f_backward().unwrap());
        assert_eq!(sizes(&grads_scratch(&params).unwrap()), [7, 5, 4, 3]);
        // The first three as views of one bucket (as the reduction leaves them): that
        // bucket, whole, and not the gradients it replaced.
        let bucket = Tensor::arange(12, opts);
        let mut at = 0;
        for p in &params[..3] {
            let n = p.numel() as i64;
            set_grad(p, &bucket.narrow(0, at, n));
            at += n;
        }
        let bucket_ptr = bucket.data_ptr();
        // Still held here (as a live bucket would be): not scratch.
        assert_eq!(sizes(&grads_scratch(&params).unwrap()), [7]);
        drop(bucket);
        let got = grads_scratch(&params).unwrap();
        assert_eq!(sizes(&got), [12, 7]);
        assert_eq!(got[0].data_ptr(), bucket_ptr);
        drop(got);
        // A gradient someone else holds (a user's reference): its storage is not scratch.
        let kept = params[3].grad();
        assert_eq!(sizes(&grads_scratch(&params).unwrap()), [12]);
        drop(kept);
        // A view of a gradient held elsewhere keeps the whole bucket out.
        let view = params[1].grad().narrow(0, 1, 2);
        assert_eq!(sizes(&grads_scratch(&params).unwrap()), [7]);
        drop(view);
        assert_eq!(sizes(&grads_scratch(&params).unwrap()), [12, 7]);
        // Nothing to use where no gradient exists.
        params.iter().for_each(clear_grad);
        assert!(grads_scratch(&params).unwrap().is_empty());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("512 MiB"), Some(512 << 20));
        assert_eq!(parse_size("1.5G"), Some(3 << 29));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("12 parsecs"), None);
        assert_eq!(parse_size("-1GiB"), None);
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
    }
}
