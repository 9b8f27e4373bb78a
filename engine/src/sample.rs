//! Token sampling: greedy, temperature, top-k, top-p, repetition penalty, seeded.
//!
//! The same seed and settings give the same tokens: the RNG is ChaCha8 seeded from `seed`, and the
//! candidate order is fully determined (ties broken by lower id).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

/// Sampling settings. Defaults are greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 is greedy (argmax); otherwise logits are divided by it. Range 0..=100.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; 1.0 disables. Range (0, 1].
    pub top_p: f32,
    /// Divides positive (multiplies negative) logits of tokens already seen; 1.0 disables.
    pub repetition_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    pub repetition_window: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            repetition_window: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Rejects absurd values with the name of the offending setting.
    pub fn validate(&self) -> Result<()> {
        let bad = |arg: &'static str, reason: String| Err(Error::InvalidArgument { arg, reason });
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return bad(
                "temperature",
                format!("{} is outside 0..=100", self.temperature),
            );
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} is outside (0, 1]", self.top_p));
        }
        if !(self.repetition_penalty.is_finite() && (0.1..=10.0).contains(&self.repetition_penalty))
        {
            return bad(
                "repetition_penalty",
                format!("{} is outside 0.1..=10", self.repetition_penalty),
            );
        }
        Ok(())
    }
}

/// A sampler with its RNG and a candidate buffer sized once for the vocabulary.
#[derive(Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha8Rng,
    candidates: Vec<(f32, u32)>,
}

impl Sampler {
    /// Creates a sampler for a vocabulary of `vocab` tokens.
    pub fn new(cfg: SamplerConfig, vocab: usize) -> Result<Sampler> {
        cfg.validate()?;
        Ok(Sampler {
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            cfg,
            candidates: Vec::with_capacity(vocab),
        })
    }

    /// Picks the next token from `logits` (modified in place by the repetition penalty), given the
    /// tokens so far in `history`.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let cfg = &self.cfg;
        if cfg.repetition_penalty != 1.0 {
            let start = history.len().saturating_sub(cfg.repetition_window);
            for &t in &history[start..] {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / cfg.repetition_penalty
                    } else {
                        *l * cfg.repetition_penalty
                    };
                }
            }
        }
        if cfg.temperature == 0.0 {
            return argmax(logits);
        }
        // Candidates sorted by logit (descending), ties by id, truncated to top-k. Each logit is
        // taken relative to the largest before the division, so a tiny temperature sends the
        // others to -inf (probability 0) instead of overflowing every logit to ±inf (inf - inf
        // is NaN, and a NaN softmax picks an arbitrary token).
        let top = logits[argmax(logits) as usize];
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| ((l - top) / cfg.temperature, i as u32)),
        );
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = if cfg.top_k == 0 {
            self.candidates.len()
        } else {
            cfg.top_k.min(self.candidates.len())
        };
        if k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(k - 1, by_logit);
            self.candidates.truncate(k);
        }
        self.candidates.sort_unstable_by(by_logit);
        // Softmax over the survivors, then the top-p cut.
        let max = self.candidates[0].0;
        let mut total = 0.0f64;
        for c in self.candidates.iter_mut() {
            c.0 = (c.0 - max).exp();
            total += f64::from(c.0);
        }
        let mut kept = self.candidates.len();
        if cfg.top_p < 1.0 {
            let mut cum = 0.0f64;
            for (i, c) in self.candidates.iter().enumerate() {
                cum += f64::from(c.0) / total;
                if cum >= f64::from(cfg.top_p) {
                    kept = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = self.candidates[..kept].iter().map(|c| f64::from(c.0)).sum();
        let mut r = self.rng.random::<f64>() * mass;
        for c in &self.candidates[..kept] {
            r -= f64::from(c.0);
            if r <= 0.0 {
                return c.1;
            }
        }
        self.candidates[kept - 1].1
    }
}

/// Index of the largest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 7919) % 100) as f32 / 10.0).collect()
    }

    #[test]
    fn greedy_picks_the_argmax() {
        let mut s = Sampler::new(SamplerConfig::default(), 100).unwrap();
        let mut l = logits();
        let best = argmax(&l);
        assert_eq!(l[best as usize], 9.9);
        assert_eq!(s.sample(&mut l, &[]), best);
    }

    #[test]
    fn same_seed_same_tokens_and_other_seed_differs() {
        let cfg = SamplerConfig {
            temperature: 1.5,
            seed: 7,
            ..Default::default()
        };
        let run = |cfg: SamplerConfig| {
            let mut s = Sampler::new(cfg, 100).unwrap();
            (0..50)
                .map(|_| s.sample(&mut logits(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(cfg.clone()), run(cfg.clone()));
        assert_ne!(run(cfg.clone()), run(SamplerConfig { seed: 8, ..cfg }));
    }

    #[test]
    fn the_smallest_temperatures_sample_the_argmax_not_nan() {
        for temperature in [1e-38f32, f32::MIN_POSITIVE, 1e-45, 1e-30] {
            let cfg = SamplerConfig {
                temperature,
                seed: 3,
                ..Default::default()
            };
            let mut s = Sampler::new(cfg, 100).unwrap();
            for _ in 0..20 {
                let mut l = logits();
                let best = argmax(&l);
                assert_eq!(s.sample(&mut l, &[]), best, "temperature {temperature}");
            }
        }
    }

    #[test]
    fn top_k_one_is_greedy() {
        let cfg = SamplerConfig {
            temperature: 2.0,
            top_k: 1,
            seed: 3,
            ..Default::default()
        };
        let mut s = Sampler::new(cfg, 100).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits(), &[]), argmax(&logits()));
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds ~88 % of the mass; top_p 0.5 must always pick it.
        let mut l = vec![0.0f32; 10];
        l[4] = 4.0;
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_p: 0.5,
            seed: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(cfg, 10).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&mut l.clone(), &[]), 4);
        }
        // Without the cut, other tokens do appear.
        let cfg = SamplerConfig {
            temperature: 1.0,
            seed: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(cfg, 10).unwrap();
        assert!((0..200).any(|_| s.sample(&mut l.clone(), &[]) != 4));
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut l = vec![1.0f32, 0.9, 0.0];
        let cfg = SamplerConfig {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(cfg, 3).unwrap();
        assert_eq!(s.sample(&mut l, &[0]), 1);
    }

    #[test]
    fn absurd_settings_are_refused_by_name() {
        for (cfg, name) in [
            (
                SamplerConfig {
                    temperature: -1.0,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplerConfig {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplerConfig {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplerConfig {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
        ] {
            let err = Sampler::new(cfg, 10).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
    }
}
