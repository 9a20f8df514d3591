//! Owns numbers, sizes and steps as the pictures and tables print them.
//! Keeps: pure formatting; the same value always prints the same way.

/// 93.3 MiB, 1.50 GiB
pub fn human_bytes(b: f64) -> String {
    let (div, unit) = bytes_unit(b);
    format!(
        "{:.prec$} {unit}",
        b / div,
        prec = if div >= (1u64 << 30) as f64 { 2 } else { 1 }
    )
}

/// MiB below 2 GiB, else GiB.
pub fn bytes_unit(max: f64) -> (f64, &'static str) {
    if max >= 2.0 * (1u64 << 30) as f64 {
        ((1u64 << 30) as f64, "GiB")
    } else {
        ((1u64 << 20) as f64, "MiB")
    }
}

/// 12k, 1.5M
pub fn short_number(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 || (a >= 1e3 && v % 1e3 == 0.0) {
        format!("{:.0}k", v / 1e3)
    } else if a >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 10.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// A step on an axis `span` steps wide: 20k and 1M on a wide axis (its ticks are round),
/// every digit on a narrow one (1000200), so that no two ticks read alike.
pub fn step_label(v: f64, span: f64) -> String {
    if span < 1e4 {
        format!("{v}")
    } else if v != 0.0 && v % 1e6 == 0.0 {
        format!("{:.0}M", v / 1e6)
    } else if v != 0.0 && v % 1e3 == 0.0 {
        format!("{:.0}k", v / 1e3)
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_sizes_read_short() {
        assert_eq!(short_number(12_345.0), "12k");
        assert_eq!([0.0, 20_000.0, 2e6].map(|v| step_label(v, 1e5)), ["0", "20k", "2M"]);
        assert_eq!(
            [2.5, 1_000_000.0, 1_000_200.0].map(|v| step_label(v, 2e3)),
            ["2.5", "1000000", "1000200"]
        );
        assert_eq!(short_number(2_500.0), "2.5k");
        assert_eq!(short_number(5_000.0), "5k");
        assert_eq!(short_number(8.0), "8");
        assert_eq!(short_number(1.25), "1.25");
        assert_eq!(human_bytes(93.3 * 1048576.0), "93.3 MiB");
        assert_eq!(human_bytes(3.0 * (1u64 << 30) as f64), "3.00 GiB");
    }
}
