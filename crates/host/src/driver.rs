//! Owns the Docker image's start-up check of the host's NVIDIA driver against the image's CUDA.
//! Keeps: a driver too old is refused before anything else, naming both versions; outside the
//! image nothing is checked.

/// The host's driver version from /proc/driver/nvidia/version's first line
/// (`NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 ...`).
pub fn parse_driver(text: &str) -> Option<String> {
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|w| {
            w.split('.').count() >= 2
                && w.split('.')
                    .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
        })
        .map(String::from)
}

/// The refusal, if the host's `driver` is older than the image's CUDA needs: a pure decision.
pub fn refusal(image_cuda: &str, min_driver: u32, driver: &str) -> Option<String> {
    let major: u32 = driver.split('.').next()?.parse().ok()?;
    (major < min_driver).then(|| {
        format!(
            "this image's PyTorch is built for CUDA {image_cuda}, which needs NVIDIA driver {min_driver} or newer, but this host's driver is {driver}. \
             Run on a host with a newer driver, or build the image for CUDA 12: docker build --build-arg TORCH_CUDA=cu126 (driver 525 or newer; see \
             docker/README.md)"
        )
    })
}

/// Checks the image's CUDA against the host's driver; Err(message) when it cannot run.
/// `OOMGUARD_NVIDIA_VERSION` (a path) stands in for /proc/driver/nvidia/version in tests.
pub fn check_image() -> Result<(), String> {
    let Some(spec) = std::env::var_os("OOMGUARD_IMAGE_ENV").and_then(|p| std::fs::read_to_string(p).ok()) else {
        return Ok(());
    };
    let get = |key: &str| {
        spec.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('=').map(str::trim).map(String::from))
    };
    let (Some(cuda), Some(min)) = (
        get("OOMGUARD_IMAGE_CUDA"),
        get("OOMGUARD_IMAGE_MIN_DRIVER").and_then(|m| m.parse().ok()),
    ) else {
        return Ok(());
    };
    let path = std::env::var("OOMGUARD_NVIDIA_VERSION").unwrap_or_else(|_| "/proc/driver/nvidia/version".into());
    // No NVIDIA driver: a CPU host, where the image runs on the CPU.
    let Some(driver) = std::fs::read_to_string(path).ok().as_deref().and_then(parse_driver) else {
        return Ok(());
    };
    refusal(&cuda, min, &driver).map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_versions() {
        let text = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(parse_driver(text).as_deref(), Some("535.104.05"));
        assert_eq!(
            parse_driver("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build")
                .as_deref(),
            Some("580.65.06")
        );
        assert_eq!(parse_driver(""), None);
        let no = refusal("13.0", 580, "535.104.05").unwrap();
        assert!(
            no.contains("CUDA 13.0") && no.contains("580") && no.contains("535.104.05"),
            "{no}"
        );
        assert_eq!(refusal("13.0", 580, "580.65.06"), None);
        assert_eq!(refusal("12.6", 525, "535.104.05"), None);
    }
}
