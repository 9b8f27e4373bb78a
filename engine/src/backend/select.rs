//! Choosing the compute backend at run time: `backend = auto|cpu|cuda` in the daemon's
//! configuration, `--backend` in the CLI.
//!
//! `auto` takes CUDA when this build has the `cuda` feature and a device answers, and the CPU
//! otherwise; either way [`BackendChoice::resolve`] says why, for the log. `cuda` is an error
//! where CUDA is not usable, naming the reason, rather than a silent fall back to the CPU.
//!
//! What runs on the chosen backend is opened by the layers that own it:
//! `pipeline::open_decoder` opens a decoding session with its pipeline.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// What the configuration asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA if built in and a device is present, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// The backend that runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
}

impl Backend {
    /// `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
        })
    }
}

impl FromStr for BackendChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<BackendChoice> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu),
            "cuda" => Ok(BackendChoice::Cuda),
            other => Err(Error::InvalidArgument {
                arg: "backend",
                reason: format!("{other:?} is not one of auto, cpu, cuda"),
            }),
        }
    }
}

/// Whether a CUDA device can be used, and why not: `Err(reason)` when this build lacks the
/// feature or the driver or device does not answer.
pub fn cuda_available() -> std::result::Result<String, String> {
    #[cfg(feature = "cuda")]
    {
        super::cuda::CudaBackend::new()
            .map(|b| b.device().to_string())
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this build has no CUDA backend (built without feature `cuda`)".into())
    }
}

impl BackendChoice {
    /// The backend to run and the reason, given whether CUDA is usable (`probe`, normally
    /// [`cuda_available`]; a parameter so the decision is testable without a GPU).
    pub fn resolve_with(
        self,
        probe: impl FnOnce() -> std::result::Result<String, String>,
    ) -> Result<(Backend, String)> {
        match self {
            BackendChoice::Cpu => Ok((Backend::Cpu, "backend = cpu was asked for".into())),
            BackendChoice::Cuda => match probe() {
                Ok(device) => Ok((Backend::Cuda, format!("backend = cuda on {device}"))),
                Err(why) => Err(Error::Cuda(format!("backend = cuda was asked for: {why}"))),
            },
            BackendChoice::Auto => Ok(match probe() {
                Ok(device) => (Backend::Cuda, format!("auto: CUDA device {device} found")),
                Err(why) => (Backend::Cpu, format!("auto: using the CPU because {why}")),
            }),
        }
    }

    /// [`BackendChoice::resolve_with`] the real probe, logging the decision.
    pub fn resolve(self) -> Result<Backend> {
        let (backend, why) = self.resolve_with(cuda_available)?;
        tracing::info!(backend = backend.name(), "compute backend: {why}");
        Ok(backend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_names_and_refuses_others() {
        for (s, c) in [
            ("auto", BackendChoice::Auto),
            ("cpu", BackendChoice::Cpu),
            ("cuda", BackendChoice::Cuda),
        ] {
            assert_eq!(s.parse::<BackendChoice>().unwrap(), c);
            assert_eq!(c.to_string(), s);
        }
        assert!("gpu".parse::<BackendChoice>().is_err());
    }

    #[test]
    fn auto_follows_the_probe_and_says_why() {
        let (b, why) = BackendChoice::Auto
            .resolve_with(|| Err("no driver".into()))
            .unwrap();
        assert_eq!(b, Backend::Cpu);
        assert!(why.contains("no driver"), "{why}");
        let (b, why) = BackendChoice::Auto
            .resolve_with(|| Ok("Orin".into()))
            .unwrap();
        assert_eq!(b, Backend::Cuda);
        assert!(why.contains("Orin"), "{why}");
    }

    #[test]
    fn cuda_without_a_device_is_an_error_not_a_fallback() {
        let e = BackendChoice::Cuda
            .resolve_with(|| Err("no device".into()))
            .unwrap_err();
        assert!(e.to_string().contains("no device"), "{e}");
        let (b, _) = BackendChoice::Cpu
            .resolve_with(|| panic!("cpu must not probe"))
            .unwrap();
        assert_eq!(b, Backend::Cpu);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn this_build_reports_that_it_lacks_cuda() {
        let why = cuda_available().unwrap_err();
        assert!(why.contains("feature `cuda`"), "{why}");
        assert_eq!(BackendChoice::Auto.resolve().unwrap(), Backend::Cpu);
        assert!(BackendChoice::Cuda.resolve().is_err());
    }
}
