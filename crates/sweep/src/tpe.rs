//! Owns model-based search (`method: bayes` or `tpe`): a Tree-structured Parzen Estimator.
//! Keeps: pure and seeded, the same results give the same proposal; trials that did not fit,
//! failed or diverged count as bad.
use serde_json::Value;
use std::collections::BTreeMap;

use super::domain::{normal_cdf, normal_ppf, Domain, SplitMix};

/// A finished trial as the search sees it: each parameter's place in [0, 1] (None: its
/// value is not in the domain) and how it went.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub at: Vec<Option<f64>>,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// The metric, lower is better (a maximized metric negated).
    Value(f64),
    /// Infeasible (does not fit), failed, or no finite metric: worse than any value.
    Bad,
}

/// Random proposals before the model has enough to go on.
pub fn startup(count: usize) -> usize {
    (count / 4).clamp(2, 10)
}

/// Candidates drawn from l(x) per proposal (hyperopt's n_EI_candidates).
const CANDIDATES: usize = 24;

/// Trial `index`'s parameters, from `observations` (in trial order) and the seed.
pub fn propose(
    domains: &[(String, Domain)],
    observations: &[Observation],
    seed: u64,
    index: usize,
    count: usize,
) -> BTreeMap<String, Value> {
    let mut rng = SplitMix(seed ^ (index as u64).wrapping_mul(0x9e3779b97f4a7c15) ^ 0x7470_6521);
    let at: Vec<f64> = if observations.len() < startup(count) {
        domains.iter().map(|_| rng.unit()).collect()
    } else {
        let (good, bad) = split(observations);
        let models: Vec<(Parzen, Parzen)> = (0..domains.len())
            .map(|d| {
                (
                    Parzen::new(&domains[d].1, &good, d),
                    Parzen::new(&domains[d].1, &bad, d),
                )
            })
            .collect();
        let mut best: Option<(f64, Vec<f64>)> = None;
        for _ in 0..CANDIDATES {
            let x: Vec<f64> = models.iter().map(|(l, _)| l.sample(&mut rng)).collect();
            let score: f64 = models
                .iter()
                .zip(&x)
                .map(|((l, g), x)| l.density(*x).ln() - g.density(*x).ln())
                .sum();
            if best.as_ref().is_none_or(|(s, _)| score > *s) {
                best = Some((score, x));
            }
        }
        best.map(|b| b.1).unwrap_or_default()
    };
    domains
        .iter()
        .zip(at)
        .map(|((k, d), u)| (k.clone(), d.ppf(u.clamp(0.0, 1.0 - 1e-12))))
        .collect()
}

/// The good observations (the best ceil(gamma n) by value, gamma 0.25) and the rest.
fn split(observations: &[Observation]) -> (Vec<&Observation>, Vec<&Observation>) {
    let mut valued: Vec<(f64, &Observation)> = observations
        .iter()
        .filter_map(|o| match o.outcome {
            Outcome::Value(v) if v.is_finite() => Some((v, o)),
            _ => None,
        })
        .collect();
    valued.sort_by(|a, b| a.0.total_cmp(&b.0));
    let n_good = ((valued.len() as f64 * 0.25).ceil() as usize).clamp(usize::from(!valued.is_empty()), 25);
    let good = valued[..n_good].iter().map(|(_, o)| *o).collect();
    let mut bad: Vec<&Observation> = valued[n_good..].iter().map(|(_, o)| *o).collect();
    bad.extend(
        observations
            .iter()
            .filter(|o| !matches!(o.outcome, Outcome::Value(v) if v.is_finite())),
    );
    (good, bad)
}

/// One parameter's Parzen density over [0, 1]: the uniform prior and one component per
/// observation (a categorical: smoothed counts of its values).
enum Parzen {
    Numeric {
        points: Vec<(f64, f64)>,
    },
    /// Pseudo-counts by value, and each value's band of [0, 1] (`Domain::bands`).
    Categorical {
        weights: Vec<f64>,
        bands: Vec<(f64, f64)>,
    },
}

/// The band `x` falls in.
fn band_of(bands: &[(f64, f64)], x: f64) -> usize {
    bands.iter().position(|(_, hi)| x < *hi).unwrap_or(bands.len() - 1)
}

impl Parzen {
    fn new(domain: &Domain, obs: &[&Observation], d: usize) -> Parzen {
        let xs: Vec<f64> = obs.iter().filter_map(|o| o.at.get(d).copied().flatten()).collect();
        if let Some(bands) = domain.bands() {
            // The prior: the domain's own probabilities, k pseudo-counts in all.
            let k = bands.len() as f64;
            let mut weights: Vec<f64> = bands.iter().map(|(lo, hi)| (hi - lo) * k).collect();
            for x in xs {
                weights[band_of(&bands, x)] += 1.0;
            }
            return Parzen::Categorical { weights, bands };
        }
        // Widths: the larger gap to a neighbour (0 and 1 bound the ends), clipped between
        // 1/min(100, n + 1) and 1, as hyperopt's adaptive Parzen estimator.
        let mut sorted = xs.clone();
        sorted.sort_by(f64::total_cmp);
        let floor = 1.0 / (sorted.len() + 1).min(100) as f64;
        let points = sorted
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let left = x - if i == 0 { 0.0 } else { sorted[i - 1] };
                let right = if i + 1 == sorted.len() { 1.0 } else { sorted[i + 1] } - x;
                (x, left.max(right).clamp(floor, 1.0))
            })
            .collect();
        Parzen::Numeric { points }
    }

    fn density(&self, x: f64) -> f64 {
        match self {
            Parzen::Categorical { weights, bands } => {
                let i = band_of(bands, x);
                // Per unit of [0, 1]: the band's mass over its width.
                weights[i] / weights.iter().sum::<f64>() / (bands[i].1 - bands[i].0).max(1e-12)
            }
            Parzen::Numeric { points } => {
                let sum: f64 = points
                    .iter()
                    .map(|&(mu, sigma)| {
                        let mass = normal_cdf((1.0 - mu) / sigma) - normal_cdf(-mu / sigma);
                        let z = (x - mu) / sigma;
                        (-0.5 * z * z).exp() / (sigma * (2.0 * std::f64::consts::PI).sqrt()) / mass.max(1e-12)
                    })
                    .sum();
                ((sum + 1.0) / (points.len() + 1) as f64).max(1e-300)
            }
        }
    }

    /// A draw: a component chosen uniformly (the prior among them), then from it.
    fn sample(&self, rng: &mut SplitMix) -> f64 {
        match self {
            Parzen::Categorical { weights, bands } => {
                let total: f64 = weights.iter().sum();
                let u = rng.unit() * total;
                let mut acc = 0.0;
                let i = weights.iter().position(|w| {
                    acc += w;
                    u < acc
                });
                let (lo, hi) = bands[i.unwrap_or(weights.len() - 1)];
                (lo + hi) / 2.0
            }
            Parzen::Numeric { points } => {
                let pick = ((rng.unit() * (points.len() + 1) as f64) as usize).min(points.len());
                let u = rng.unit();
                match points.get(pick) {
                    None => u,
                    // The truncated Gaussian by its inverse CDF.
                    Some(&(mu, sigma)) => {
                        let (a, b) = (normal_cdf(-mu / sigma), normal_cdf((1.0 - mu) / sigma));
                        (mu + sigma * normal_ppf((a + u * (b - a)).clamp(1e-12, 1.0 - 1e-12))).clamp(0.0, 1.0)
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Scale;

    /// Branin (minimum 0.397887 at three points), and a band of it that "does not fit".
    fn branin(x: f64, y: f64) -> f64 {
        let pi = std::f64::consts::PI;
        let b = 5.1 / (4.0 * pi * pi);
        (y - b * x * x + 5.0 / pi * x - 6.0).powi(2) + 10.0 * (1.0 - 1.0 / (8.0 * pi)) * x.cos() + 10.0
    }

    fn domains() -> Vec<(String, Domain)> {
        vec![
            (
                "a.x".into(),
                Domain::Real {
                    scale: Scale::Linear,
                    lo: -5.0,
                    hi: 10.0,
                    q: None,
                },
            ),
            (
                "a.y".into(),
                Domain::Real {
                    scale: Scale::Linear,
                    lo: 0.0,
                    hi: 15.0,
                    q: None,
                },
            ),
            (
                "a.k".into(),
                Domain::Values {
                    values: vec![Value::from(0), Value::from(1), Value::from(2)],
                    weights: None,
                },
            ),
        ]
    }

    /// Runs `n` trials: TPE or (with `random`) independent uniform draws. Returns the best
    /// value found and how many proposals did not fit.
    fn search(seed: u64, n: usize, random: bool) -> (f64, usize) {
        let d = domains();
        let mut obs: Vec<Observation> = vec![];
        let (mut best, mut infeasible) = (f64::INFINITY, 0);
        for i in 0..n {
            let p = if random {
                super::super::spec::random(&d, n, seed)[i].params.clone()
            } else {
                propose(&d, &obs, seed, i, n)
            };
            let (x, y, k) = (
                p["a.x"].as_f64().unwrap(),
                p["a.y"].as_f64().unwrap(),
                p["a.k"].as_i64().unwrap(),
            );
            // k = 2 and the top-right corner do not fit in memory.
            let fits = k != 2 && x + y < 18.0;
            let outcome = if fits {
                Outcome::Value(branin(x, y) + k as f64)
            } else {
                Outcome::Bad
            };
            if let Outcome::Value(v) = outcome {
                best = best.min(v);
            } else if i >= n / 2 {
                infeasible += 1;
            }
            obs.push(Observation {
                at: d.iter().map(|(k, dom)| dom.cdf(&p[k])).collect(),
                outcome,
            });
        }
        (best, infeasible)
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    }

    /// Over 20 seeds at the same trial count, TPE's best is better than random search's in
    /// the median, and in the second half it proposes fewer configurations that do not fit.
    #[test]
    fn tpe_beats_random_search_and_learns_the_memory_boundary() {
        let n = 40;
        let (tpe, rnd): (Vec<_>, Vec<_>) = (0..20).map(|s| (search(s, n, false), search(s, n, true))).unzip();
        let (mt, mr) = (
            median(tpe.iter().map(|r| r.0).collect()),
            median(rnd.iter().map(|r| r.0).collect()),
        );
        let (it, ir) = (
            tpe.iter().map(|r| r.1).sum::<usize>(),
            rnd.iter().map(|r| r.1).sum::<usize>(),
        );
        println!("median best over 20 seeds, {n} trials: TPE {mt:.4}, random {mr:.4}; infeasible proposals in the second halves: TPE {it}, random {ir}");
        assert!(mt < mr, "TPE {mt} vs random {mr}");
        assert!(it * 2 < ir, "TPE proposed {it} infeasible, random {ir}");
    }

    #[test]
    fn proposals_are_deterministic_given_the_results() {
        let d = domains();
        let obs: Vec<Observation> = (0..12)
            .map(|i| Observation {
                at: vec![Some(i as f64 / 12.0), Some(0.5), Some(0.5)],
                outcome: if i == 3 { Outcome::Bad } else { Outcome::Value(i as f64) },
            })
            .collect();
        assert_eq!(propose(&d, &obs, 1, 12, 40), propose(&d, &obs, 1, 12, 40));
        assert_ne!(propose(&d, &obs, 1, 12, 40), propose(&d, &obs, 2, 12, 40));
        let mut moved = obs.clone();
        moved[11].outcome = Outcome::Value(-100.0); // a new best, far from the old ones
        assert_ne!(propose(&d, &moved, 1, 12, 40), propose(&d, &obs, 1, 12, 40));
    }

    /// W&B's `probabilities` on a categorical: every value can be proposed, and the model
    /// follows where the good trials were (the middle value, 20% of the prior).
    #[test]
    fn a_weighted_categorical_proposes_every_value() {
        use serde_json::json;
        let d = vec![(
            "optim.kind".to_string(),
            Domain::Values {
                values: vec![json!("a"), json!("b"), json!("c")],
                weights: Some(vec![0.6, 0.2, 0.2]),
            },
        )];
        // Twelve finished trials: "b" did best, then "c", then "a".
        let obs: Vec<Observation> = (0..12)
            .map(|i| {
                let v = ["a", "b", "c"][i % 3];
                let metric = match v {
                    "b" => 1.0,
                    "c" => 2.0,
                    _ => 3.0,
                } + i as f64 * 0.01;
                Observation {
                    at: vec![d[0].1.cdf(&json!(v))],
                    outcome: Outcome::Value(metric),
                }
            })
            .collect();
        let proposed: Vec<Value> = (12..60)
            .map(|i| propose(&d, &obs, 5, i, 60)["optim.kind"].clone())
            .collect();
        let b = proposed.iter().filter(|v| **v == json!("b")).count();
        assert!(
            b > proposed.len() / 2,
            "the good value is proposed most: {b} of {}",
            proposed.len()
        );
    }
}
