//! Owns one parameter's domain: its seeded draws, its grid values and its map to and from the
//! unit interval (the CDF and its inverse).
//! Keeps: draws are seeded; a value outside the domain has no CDF rather than a wrong one.
use serde_json::Value;

/// A parameter's domain. Bounds of `Real` are in its sampling space (logarithms for `Log`).
#[derive(Debug, Clone, PartialEq)]
pub enum Domain {
    /// `value`, `values` (categorical; W&B's `probabilities` as weights).
    Values {
        values: Vec<Value>,
        weights: Option<Vec<f64>>,
    },
    /// `int_uniform`: every integer in [min, max] equally likely.
    Int { min: i64, max: i64 },
    /// `uniform`, `q_uniform`, `log_uniform(_values)`, `q_log_uniform_values`.
    Real {
        scale: Scale,
        lo: f64,
        hi: f64,
        q: Option<Quantum>,
    },
    /// `normal`, `q_normal`, `log_normal`, `q_log_normal`: N(mu, sigma) (of the logarithm for `Log`).
    Normal {
        scale: Scale,
        mu: f64,
        sigma: f64,
        q: Option<Quantum>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    Linear,
    Log,
}

/// W&B's `q`: values rounded to multiples of it; integers when it is written as one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantum {
    pub q: f64,
    pub int: bool,
}

impl Domain {
    /// Only one value: nothing to search.
    pub fn is_constant(&self) -> bool {
        matches!(self, Domain::Values { values, .. } if values.len() == 1)
    }

    /// The value at `u` in [0, 1): the inverse CDF (a seeded uniform draw maps through it).
    pub fn ppf(&self, u: f64) -> Value {
        match self {
            Domain::Values { values, weights: None } => {
                values[((u * values.len() as f64) as usize).min(values.len() - 1)].clone()
            }
            Domain::Values {
                values,
                weights: Some(w),
            } => {
                let total: f64 = w.iter().sum();
                let mut acc = 0.0;
                let i = w.iter().position(|p| {
                    acc += p / total;
                    u < acc
                });
                values[i.unwrap_or(values.len() - 1)].clone()
            }
            Domain::Int { min, max } => {
                let span = *max as i128 - *min as i128;
                Value::from((*min as i128 + ((u * (span + 1) as f64) as i128).min(span)) as i64)
            }
            Domain::Real { scale, lo, hi, q } => finish(unscale(*scale, lo + u * (hi - lo)), *q),
            Domain::Normal { scale, mu, sigma, q } => finish(
                unscale(*scale, mu + sigma * normal_ppf(u.clamp(1e-12, 1.0 - 1e-12))),
                *q,
            ),
        }
    }

    /// Where `v` sits in [0, 1] (the CDF; a categorical's index at its band's middle), or
    /// None when `v` is not in the domain (an edited sweep file's old trial).
    pub fn cdf(&self, v: &Value) -> Option<f64> {
        match self {
            Domain::Values { values, .. } => {
                let i = values.iter().position(|x| same(x, v))?;
                let (lo, hi) = self.bands()?[i];
                Some((lo + hi) / 2.0)
            }
            Domain::Int { min, max } => v
                .as_f64()
                .map(|x| ((x - *min as f64 + 0.5) / (*max as i128 - *min as i128 + 1) as f64).clamp(0.0, 1.0)),
            Domain::Real { scale, lo, hi, .. } => {
                let x = rescale(*scale, v.as_f64()?)?;
                Some(if hi > lo {
                    ((x - lo) / (hi - lo)).clamp(0.0, 1.0)
                } else {
                    0.5
                })
            }
            Domain::Normal { scale, mu, sigma, .. } => Some(normal_cdf((rescale(*scale, v.as_f64()?)? - mu) / sigma)),
        }
    }

    /// Categorical for the model-based search (no order between its values).
    pub fn categories(&self) -> Option<usize> {
        match self {
            Domain::Values { values, .. } => Some(values.len()),
            _ => None,
        }
    }

    /// A categorical's values as bands of [0, 1], the ones `ppf` maps to each value: equal,
    /// or as wide as W&B's `probabilities`. Keeps: `ppf` of a band's middle is its value.
    pub fn bands(&self) -> Option<Vec<(f64, f64)>> {
        let Domain::Values { values, weights } = self else {
            return None;
        };
        let n = values.len();
        let w = weights.clone().unwrap_or_else(|| vec![1.0; n]);
        let total: f64 = w.iter().sum();
        let mut lo = 0.0;
        Some(
            w.iter()
                .map(|p| {
                    let band = (lo, lo + p / total);
                    lo = band.1;
                    band
                })
                .collect(),
        )
    }

    /// The values a grid takes (W&B's grid_search.py: values as written, `int_uniform` every
    /// integer of [min, max], `q_uniform` numpy's arange(min, max, q), max excluded); None
    /// for a distribution a grid cannot take.
    pub fn grid_values(&self) -> Option<Vec<Value>> {
        let n = usize::try_from(self.grid_len()?).ok()?;
        match self {
            Domain::Values { values, .. } => Some(values.clone()),
            Domain::Int { min, .. } => Some((0..n as i64).map(|i| Value::from(min + i)).collect()),
            Domain::Real { lo, q: Some(q), .. } => Some((0..n).map(|i| number(lo + i as f64 * q.q, q.int)).collect()),
            _ => None,
        }
    }

    /// How many values `grid_values` gives, counted without making them (a grid's size is
    /// checked before it is built); None where a grid cannot take this distribution.
    pub fn grid_len(&self) -> Option<u128> {
        match self {
            Domain::Values { values, weights: None } => Some(values.len() as u128),
            Domain::Int { min, max } => Some((*max as i128 - *min as i128 + 1) as u128),
            Domain::Real {
                scale: Scale::Linear,
                lo,
                hi,
                q: Some(q),
            } => Some(((hi - lo) / q.q).ceil().max(0.0) as u128),
            _ => None,
        }
    }
}

/// Equal as W&B's grid dedupes them (3000000.0 is 3000000).
pub fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

fn unscale(scale: Scale, x: f64) -> f64 {
    match scale {
        Scale::Linear => x,
        Scale::Log => x.exp(),
    }
}

fn rescale(scale: Scale, v: f64) -> Option<f64> {
    match scale {
        Scale::Linear => Some(v),
        Scale::Log => (v > 0.0).then(|| v.ln()),
    }
}

/// Rounded to `q` (W&B: round(x / q) * q), else to six significant digits: readable in
/// tables, exact through --set.
fn finish(x: f64, q: Option<Quantum>) -> Value {
    match q {
        Some(q) => number((x / q.q).round() * q.q, q.int),
        None => Value::from(format!("{x:.5e}").parse::<f64>().unwrap_or(x)),
    }
}

fn number(x: f64, int: bool) -> Value {
    if int {
        Value::from(x.round() as i64)
    } else {
        Value::from(format!("{x:.10e}").parse::<f64>().unwrap_or(x))
    }
}

/// The standard normal CDF, Φ(z) = (1 + erf(z/√2)) / 2, with libm's erf.
pub fn normal_cdf(z: f64) -> f64 {
    0.5 * (1.0 + libm::erf(z / std::f64::consts::SQRT_2))
}

/// Φ⁻¹(p) by Acklam's rational approximation (relative error below 1.2e-9).
pub fn normal_ppf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.38357751867269e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// A small, well-known generator: the draws must not change with a crate's version.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn draws(d: &Domain, n: usize) -> Vec<f64> {
        let mut rng = SplitMix(42);
        (0..n).map(|_| d.ppf(rng.unit()).as_f64().unwrap()).collect()
    }

    /// Counts of `xs` in `bins` equal bins over [lo, hi).
    fn histogram(xs: &[f64], lo: f64, hi: f64, bins: usize) -> Vec<usize> {
        let mut h = vec![0; bins];
        for x in xs {
            h[(((x - lo) / (hi - lo)) * bins as f64).clamp(0.0, bins as f64 - 1.0) as usize] += 1;
        }
        h
    }

    fn flat(h: &[usize], n: usize) {
        let each = n as f64 / h.len() as f64;
        assert!(
            h.iter().all(|&c| (c as f64 - each).abs() < 0.06 * each),
            "not flat: {h:?}"
        );
    }

    /// Each distribution's draws (fixed seed) stay in range and have its shape.
    #[test]
    fn draws_are_in_range_with_the_right_shape() {
        let n = 20000;
        let lin = |lo, hi| Domain::Real {
            scale: Scale::Linear,
            lo,
            hi,
            q: None,
        };
        // uniform
        let x = draws(&lin(-2.0, 3.0), n);
        assert!(x.iter().all(|v| (-2.0..=3.0).contains(v)));
        flat(&histogram(&x, -2.0, 3.0, 10), n);
        // log_uniform_values 1e-4..1e-1: flat in the logarithm, one decade per bin
        let x = draws(
            &Domain::Real {
                scale: Scale::Log,
                lo: 1e-4f64.ln(),
                hi: 1e-1f64.ln(),
                q: None,
            },
            n,
        );
        assert!(x.iter().all(|v| (1e-4 * 0.99999..=1e-1 * 1.00001).contains(v)));
        flat(
            &histogram(&x.iter().map(|v| v.log10()).collect::<Vec<_>>(), -4.0, -1.0, 3),
            n,
        );
        // int_uniform 1..=4: each integer a quarter
        let x = draws(&Domain::Int { min: 1, max: 4 }, n);
        flat(&histogram(&x, 0.5, 4.5, 4), n);
        // q_uniform 0..1 by 0.25: multiples of q; the ends take half a band (W&B's rounding)
        let x = draws(
            &Domain::Real {
                scale: Scale::Linear,
                lo: 0.0,
                hi: 1.0,
                q: Some(Quantum { q: 0.25, int: false }),
            },
            n,
        );
        assert!(x
            .iter()
            .all(|v| ((v / 0.25).round() * 0.25 - v).abs() < 1e-9 && (0.0..=1.0).contains(v)));
        let h = histogram(&x, -0.125, 1.125, 5);
        assert!(
            (h[0] as f64 / n as f64 - 0.125).abs() < 0.01 && (h[2] as f64 / n as f64 - 0.25).abs() < 0.015,
            "{h:?}"
        );
        // q_log_uniform_values 1..1000 by 1 (integers)
        let d = Domain::Real {
            scale: Scale::Log,
            lo: 0.0,
            hi: 1000f64.ln(),
            q: Some(Quantum { q: 1.0, int: true }),
        };
        let mut rng = SplitMix(1);
        assert!((0..n).all(|_| d.ppf(rng.unit()).as_i64().is_some_and(|v| (1..=1000).contains(&v))));
        // normal(1, 2): mean, spread, and 68% within one sigma
        let x = draws(
            &Domain::Normal {
                scale: Scale::Linear,
                mu: 1.0,
                sigma: 2.0,
                q: None,
            },
            n,
        );
        let mean = x.iter().sum::<f64>() / n as f64;
        let sd = (x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
        let within = x.iter().filter(|v| (**v - 1.0).abs() < 2.0).count() as f64 / n as f64;
        assert!(
            (mean - 1.0).abs() < 0.05 && (sd - 2.0).abs() < 0.05 && (within - 0.6827).abs() < 0.01,
            "{mean} {sd} {within}"
        );
        // log_normal(0, 1): positive, its logarithm normal
        let x = draws(
            &Domain::Normal {
                scale: Scale::Log,
                mu: 0.0,
                sigma: 1.0,
                q: None,
            },
            n,
        );
        assert!(x.iter().all(|v| *v > 0.0));
        let logs: Vec<f64> = x.iter().map(|v| v.ln()).collect();
        assert!((logs.iter().sum::<f64>() / n as f64).abs() < 0.03);
        assert!(
            (x.iter().filter(|v| **v < 1.0).count() as f64 / n as f64 - 0.5).abs() < 0.01,
            "median e^mu"
        );
        // categorical with probabilities
        let d = Domain::Values {
            values: vec![json!("a"), json!("b")],
            weights: Some(vec![0.2, 0.8]),
        };
        let mut rng = SplitMix(3);
        let b = (0..n).filter(|_| d.ppf(rng.unit()) == json!("b")).count() as f64 / n as f64;
        assert!((b - 0.8).abs() < 0.01, "{b}");
    }

    #[test]
    fn cdf_inverts_ppf() {
        for d in [
            Domain::Real {
                scale: Scale::Log,
                lo: -9.0,
                hi: -2.0,
                q: None,
            },
            Domain::Normal {
                scale: Scale::Linear,
                mu: 0.5,
                sigma: 0.1,
                q: None,
            },
            Domain::Int { min: 2, max: 9 },
        ] {
            for u in [0.05, 0.3, 0.77] {
                let back = d.cdf(&d.ppf(u)).unwrap();
                assert!((back - u).abs() < 0.07, "{d:?} {u} {back}");
            }
        }
        assert!((normal_ppf(0.975) - 1.959964).abs() < 1e-5 && (normal_cdf(1.959964) - 0.975).abs() < 1e-6);
        // A weighted categorical: each value's place maps back to it (the middle of its band).
        let d = Domain::Values {
            values: vec![json!("a"), json!("b"), json!("c")],
            weights: Some(vec![0.6, 0.2, 0.2]),
        };
        for v in ["a", "b", "c"] {
            assert_eq!(d.ppf(d.cdf(&json!(v)).unwrap()), json!(v));
        }
    }
}
