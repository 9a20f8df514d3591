//! Owns recognising out-of-memory errors in libtorch's messages and parsing what they say.
//! Keeps: this is the one place that knows those messages; the trainer and the Python guard ask it.
use std::fmt;

/// Where in a step an error happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Data,
    Forward,
    Backward,
    /// Gradient clipping (and the gradient norm).
    Clip,
    Optimizer,
    Eval,
    /// Writing a checkpoint.
    Checkpoint,
    /// Creating the model and the optimizer state, or restoring a checkpoint.
    Init,
}

impl Phase {
    /// Every phase, in declaration order: `ALL[p as usize] == p` (the number the ranks
    /// exchange and the snapshot hook's code stand for a phase by its place here).
    pub const ALL: [Phase; 8] = [
        Phase::Data,
        Phase::Forward,
        Phase::Backward,
        Phase::Clip,
        Phase::Optimizer,
        Phase::Eval,
        Phase::Checkpoint,
        Phase::Init,
    ];
}

/// Where an out-of-memory error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OomSource {
    /// The CUDA caching allocator (`CUDA out of memory. Tried to allocate ...`).
    Cuda,
    /// A CUDA runtime or library call (`CUDA error: out of memory`, cuBLAS, cuDNN).
    CudaRuntime,
    /// libtorch's default CPU allocator (`can't allocate memory`).
    Cpu,
    /// oomguard's own CPU memory budget.
    Budget,
}

impl OomSource {
    /// Another rank's OOM of this source, as that rank's peers say it: with this source's
    /// words, so that whoever reads the peer's error (the launcher, deciding on a relaunch at
    /// a smaller micro-batch) reads an OOM whichever rank's error it reads first.
    pub fn said_by_peer(self, rank: usize) -> String {
        let words = match self {
            OomSource::Cuda => "CUDA out of memory",
            OomSource::CudaRuntime => "CUDA error: out of memory",
            OomSource::Cpu => "can't allocate memory",
            OomSource::Budget => "oomguard memory budget exceeded",
        };
        format!("rank {rank} ran out of memory ({words} there)")
    }
}

/// An out-of-memory error with what could be parsed from libtorch's message.
#[derive(Debug, Clone, PartialEq)]
pub struct OomError {
    pub source: OomSource,
    pub requested_bytes: Option<u64>,
    pub capacity_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub phase: Option<Phase>,
    /// Which micro-batch of the step it happened in (0-based), when known.
    pub micro_batch: Option<usize>,
    /// The line of libtorch's message that says out of memory (libtorch may wrap it, e.g.
    /// under "The following operation failed in the TorchScript interpreter."; the rest is
    /// often a C++ backtrace).
    pub message: String,
}

impl fmt::Display for OomError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "out of memory ({:?}): {}", self.source, self.message)
    }
}

/// Classifies a libtorch error message: `Some` if it is an out-of-memory error.
/// The markers of each source, most specific first.
const MARKERS: [(OomSource, &[&str]); 4] = [
    (OomSource::Budget, &["oomguard memory budget exceeded"]),
    (OomSource::Cuda, &["cuda out of memory", "outofmemoryerror"]),
    (
        OomSource::CudaRuntime,
        &[
            "cuda error: out of memory",
            "cublas_status_alloc_failed",
            "cudnn_status_alloc_failed",
            "cudnn_status_not_enough_workspace",
            "cudaerrormemoryallocation",
        ],
    ),
    // The CPU: libtorch's allocator; oneDNN, which reports its own allocation failure as
    // "could not create a primitive"; Python's MemoryError (a host allocation in Python
    // code: numpy, a collator), which both fronts name by its type.
    (
        OomSource::Cpu,
        &[
            "can't allocate memory",
            "cannot allocate memory",
            "could not create a primitive",
            "memoryerror",
        ],
    ),
];

pub fn classify_oom(msg: &str) -> Option<OomError> {
    let lower = msg.to_ascii_lowercase();
    let (source, marker) = MARKERS
        .iter()
        .find_map(|(source, ms)| ms.iter().find(|m| lower.contains(*m)).map(|m| (*source, *m)))?;
    // The line that matched, with the next one when the sizes follow on it (CUDA's
    // "CUDA out of memory.\nTried to allocate ...").
    let lines: Vec<&str> = msg.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.to_ascii_lowercase().contains(marker))
        .unwrap_or(0);
    let mut line = lines.get(at).map_or(msg, |l| l.trim()).to_string();
    if !line.to_ascii_lowercase().contains("tried to allocate") {
        if let Some(next) = lines
            .get(at + 1)
            .filter(|n| n.to_ascii_lowercase().contains("tried to allocate"))
        {
            line = format!("{line} {}", next.trim());
        }
    }
    let first_line = line.as_str();
    let (requested, capacity, free) = match source {
        OomSource::Budget => (
            number_after(&lower, "tried to allocate "),
            number_after(&lower, "budget of "),
            number_after(&lower, "bytes ("),
        ),
        OomSource::Cpu => (number_after(&lower, "you tried to allocate "), None, None),
        _ => (
            size_after(&lower, "tried to allocate "),
            size_after(&lower, "total capacity of "),
            size_after(&lower, " of which "),
        ),
    };
    Some(OomError {
        source,
        requested_bytes: requested,
        capacity_bytes: capacity,
        free_bytes: free,
        phase: None,
        micro_batch: None,
        message: first_line.to_string(),
    })
}

/// A plain byte count right after `key` (`... allocate 123 bytes`).
fn number_after(text: &str, key: &str) -> Option<u64> {
    let rest = &text[text.find(key)? + key.len()..];
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// A size with a unit right after `key` (`... allocate 32.00 MiB`), in bytes.
fn size_after(text: &str, key: &str) -> Option<u64> {
    let rest = text[text.find(key)? + key.len()..].trim_start();
    let num_len = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let value: f64 = rest[..num_len].parse().ok()?;
    let unit = rest[num_len..]
        .trim_start()
        .split(|c: char| !c.is_ascii_alphabetic())
        .next()?;
    unit_multiplier(unit).map(|m| (value * m as f64).round() as u64)
}

/// Bytes per unit: `B`, `KB`/`KiB`, `MB`/`MiB`, `GB`/`GiB`, `TB`/`TiB` (case-insensitive;
/// both spellings are binary, as in libtorch's messages).
pub fn unit_multiplier(unit: &str) -> Option<u64> {
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    Some(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    /// A peer's words for another rank's OOM read as that OOM, of its source: the launcher
    /// relaunches at half whichever rank's error it reads first (it read rank 1's "rank 0 ran
    /// out of memory" as no OOM, and relaunched at the same size, in half the runs).
    #[test]
    fn a_peers_account_of_an_oom_reads_as_that_oom() {
        for s in [
            OomSource::Cuda,
            OomSource::CudaRuntime,
            OomSource::Cpu,
            OomSource::Budget,
        ] {
            let said = format!("out of memory ({s:?}): {}", s.said_by_peer(0));
            assert_eq!(classify_oom(&said).map(|o| o.source), Some(s), "{said}");
        }
    }

    #[test]
    fn onednn_and_python_memory_errors_are_the_cpu_running_out() {
        let o = classify_oom("RuntimeError: could not create a primitive").unwrap();
        assert_eq!(
            (o.source, o.message.as_str()),
            (OomSource::Cpu, "RuntimeError: could not create a primitive")
        );
        let o = classify_oom("MemoryError: ").unwrap();
        assert_eq!(o.source, OomSource::Cpu);
        // CUDA's error type names itself first.
        assert_eq!(classify_oom("OutOfMemoryError: x").unwrap().source, OomSource::Cuda);
        assert!(classify_oom("ValueError: memory layout").is_none());
    }

    // Messages as quoted in ../shared/seeds/ and as libtorch 2.13 prints them.
    #[test]
    fn cuda_caching_allocator_messages_from_the_seeds() {
        let m = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB. \nGPU 0 has a total capacity of 14.74 GiB of which 4.19 MiB \
            is free. \nProcess has 14.73 GiB memory in use.";
        let o = classify_oom(m).unwrap();
        assert_eq!(o.source, OomSource::Cuda);
        assert_eq!(o.requested_bytes, Some(32 * MIB));
        assert_eq!(o.capacity_bytes, Some((14.74 * GIB as f64).round() as u64));
        assert_eq!(o.free_bytes, Some((4.19 * MIB as f64).round() as u64));

        let m = "OutOfMemoryError: CUDA out of memory.\nTried to allocate 2.00 MiB. GPU 0 has a total capacity of 15.57 GiB";
        let o = classify_oom(m).unwrap();
        assert_eq!(o.requested_bytes, Some(2 * MIB));
        assert_eq!(o.capacity_bytes, Some((15.57 * GIB as f64).round() as u64));

        let o = classify_oom("OutOfMemoryError: CUDA out of memory.\nTried to allocate 7.45 GiB. ").unwrap();
        assert_eq!(o.requested_bytes, Some((7.45 * GIB as f64).round() as u64));
    }

    #[test]
    fn cuda_runtime_and_library_failures() {
        for m in [
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
            "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
            "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        ] {
            assert_eq!(classify_oom(m).unwrap().source, OomSource::CudaRuntime, "{m}");
        }
    }

    #[test]
    fn cpu_allocator_and_budget() {
        let m = "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes. \
            Error code 12 (Cannot allocate memory)";
        let o = classify_oom(m).unwrap();
        assert_eq!(o.source, OomSource::Cpu);
        assert_eq!(o.requested_bytes, Some(1 << 40));

        let m = "oomguard memory budget exceeded: tried to allocate 4096 bytes with 1000 bytes in use of a budget of 2000 bytes (1000 bytes free)";
        let o = classify_oom(m).unwrap();
        assert_eq!(
            (o.source, o.requested_bytes, o.capacity_bytes, o.free_bytes),
            (OomSource::Budget, Some(4096), Some(2000), Some(1000))
        );
    }

    #[test]
    fn reports_the_line_that_matched_not_a_wrapper() {
        let m = "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript (most recent call last):\n  \
            File \"model.py\", line 12\nRuntimeError: oomguard memory budget exceeded: tried to allocate 4096 bytes with 10 bytes in use of a budget \
            of 100 bytes (90 bytes free)\n";
        let o = classify_oom(m).unwrap();
        assert_eq!(o.source, OomSource::Budget);
        assert!(
            o.message
                .starts_with("RuntimeError: oomguard memory budget exceeded: tried to allocate 4096"),
            "{}",
            o.message
        );
        assert_eq!(o.requested_bytes, Some(4096));
        let o = classify_oom("OutOfMemoryError: CUDA out of memory.\nTried to allocate 2.00 MiB. GPU 0 has a total capacity of 15.57 GiB").unwrap();
        assert_eq!(
            o.message,
            "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 15.57 GiB"
        );
    }

    #[test]
    fn other_errors_are_not_oom() {
        for m in [
            "shape '[2, 3]' is invalid for input of size 7",
            "CUDA error: device-side assert triggered",
            "Expected all tensors to be on the same device",
        ] {
            assert!(classify_oom(m).is_none(), "{m}");
        }
    }
}
