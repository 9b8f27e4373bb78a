//! Teacher-forced passes over a text in windows, each from an empty context, through the engine's
//! own forward pass ([`Session::forward_batch_with`]) in exact precision with f32 keys and values,
//! each layer's FFN left to a calibration executor ([`super::Collector`], [`super::Thresholded`]).

use std::sync::Arc;

use crate::backend::cpu::Precision;
use crate::forward::{FfnExecutor, Model, Session};
use crate::generate::token_nll;
use crate::kv::KvType;
use crate::{Error, Result};

/// A session of `window` tokens, reset before every window.
#[derive(Debug)]
pub struct Windows {
    session: Session,
    window: usize,
}

impl Windows {
    /// Windows of up to `window` tokens (2 ..= the model's context length).
    pub fn new(model: &Arc<Model>, window: usize) -> Result<Windows> {
        let context = model.weights.config.context_length;
        if window < 2 || window > context {
            return Err(Error::InvalidArgument {
                arg: "window",
                reason: format!("{window} is outside 2..={context}"),
            });
        }
        let session = Session::new(Arc::clone(model), window, Precision::Exact, KvType::F32)?;
        Ok(Windows { session, window })
    }

    /// Runs `ids` in windows of the configured length (a last window of one token is dropped:
    /// it predicts nothing), calling `exec` for every layer and token, and `progress(done,
    /// total)` after each window. Returns the mean NLL (nats) of every token given its window's
    /// prefix, and how many tokens were predicted.
    pub fn run(
        &mut self,
        ids: &[u32],
        exec: &mut dyn FfnExecutor,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(f64, usize)> {
        let windows: Vec<&[u32]> = ids.chunks(self.window).filter(|w| w.len() >= 2).collect();
        if windows.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "text",
                reason: format!("{} tokens; at least 2 are needed", ids.len()),
            });
        }
        let (mut nll, mut n) = (0f64, 0usize);
        for (i, win) in windows.iter().enumerate() {
            self.session.reset();
            self.session
                .forward_batch_with(win, exec, &mut |t, logits| {
                    if let Some(&next) = win.get(t + 1) {
                        nll += token_nll(logits, next);
                        n += 1;
                    }
                    Ok(())
                })?;
            progress(i + 1, windows.len());
        }
        Ok((nll / n as f64, n))
    }
}
